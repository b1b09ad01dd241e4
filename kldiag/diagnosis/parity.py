"""The engine-parity causes: `engine_temperature_mismatch` and `engine_mismatch` from the parity fits.

Registered among the detectors on import (kldiag.diagnosis.core imports this module); the fits
themselves are kldiag.mismatch.parity's. This `engine_mismatch` replaces the built-in one and keeps
its evidence.
"""

from __future__ import annotations

import math

import numpy as np

from kldiag.diagnosis import causes as C
from kldiag.diagnosis.types import Cause
from kldiag.format import open_run
from kldiag.frameworks import fix_for
from kldiag.mismatch import parity as P


def _onset(rep: P.ParityReport, fire: np.ndarray) -> int | None:
    hit = np.flatnonzero(fire)
    return int(rep.steps.step[hit[0]]) if len(hit) else None



def temperature_cause(rep: P.ParityReport, fix: str) -> Cause | None:
    """engine_temperature_mismatch with a numeric implied_temperature (top-level key)."""
    if not rep.temperature:
        return None
    f, cfg = rep.fit, rep.config
    per_step = np.abs(rep.steps.slope - 1.0) > cfg.slope_tol
    onset = _onset(rep, per_step) if per_step.any() else (int(rep.steps.step[0]) if len(rep.steps.step) else None)
    ok = np.isfinite(rep.steps.slope) & (rep.steps.slope > 0)
    temps = 1.0 / rep.steps.slope[ok]
    ev = {"fit": f.to_dict(), "slope_tolerance": cfg.slope_tol,
          "implied_temperature_per_step": {"min": float(temps.min()) if len(temps) else None,
                                           "median": float(np.median(temps)) if len(temps) else None,
                                           "max": float(temps.max()) if len(temps) else None},
          "steps_off": int(per_step.sum()), "steps": int(len(rep.steps.step))}
    kind = "sharper" if f.implied_temperature < 1 else "flatter"
    summary = (f"the engine's log-probs are those of temperature {f.implied_temperature:.3g} (slope of log mu on log "
               f"pi_old {f.slope:.4g} within shared contexts, residual {f.residual_std:.2g} nats) while the trainer "
               f"scores at 1: mu is {kind} than pi_old; a sampling temperature the trainer does not apply, or "
               "processed vs raw log-probs")
    if f.method == "pooled":
        summary += " (pooled fit: no shared contexts, the temperature is approximate)"
    return Cause("engine_temperature_mismatch", onset, "warning", ev, fix, summary,
                 extra={"implied_temperature": float(f.implied_temperature)})



def mismatch_cause(rep: P.ParityReport, builtin: Cause | None, fix: str) -> Cause | None:
    """engine_mismatch: offset, first-step disagreement, growth; the built-in rule's evidence merged in."""
    s, cfg = rep.steps, rep.config
    why, ev = [], dict(builtin.evidence) if builtin else {}
    if rep.offset:
        why.append(f"a constant offset: log mu - log pi_old averages {rep.fit.offset:+.3g} nats at slope "
                   f"{rep.fit.slope:.3g}")
    if rep.first_step_disagrees and not rep.temperature:  # a temperature mismatch explains it otherwise
        why.append(f"already at the first step ({int(s.step[0])}) |log mu - log pi_old| averages "
                   f"{s.mismatch_abs[0]:.3g} nats (float noise < {cfg.float_noise})")
    if rep.growing:
        why.append(f"mismatch grows x{rep.growth['mismatch_growth']:.3g} over the run while the policy drift "
                   f"changes x{rep.growth['drift_growth']:.3g}")
    if not why and builtin is None:
        return None
    ev.update({"offset": rep.fit.offset, "offset_se": rep.fit.offset_se, "first_step": int(s.step[0]) if len(s.step)
               else None, "first_step_mismatch_abs": float(s.mismatch_abs[0]) if len(s.step) else None,
               "float_noise": cfg.float_noise, **rep.growth,
               "checks": {"offset": rep.offset, "first_step": rep.first_step_disagrees, "growing": rep.growing}})
    onset = builtin.onset if builtin else None
    if rep.first_step_disagrees and not rep.temperature:
        onset = int(s.step[0])
    elif onset is None and len(s.step):
        onset = _onset(rep, s.mismatch_abs > cfg.float_noise)
    summary = "; ".join(([builtin.summary] if builtin else []) + why)
    severity = builtin.severity if builtin else "warning"
    return Cause("engine_mismatch", onset, severity, ev, fix, summary)



def _fix(manifest, name: str, temperature: float = math.nan) -> str:
    return fix_for(name, manifest, t=temperature) if name == "engine_temperature_mismatch" else fix_for(name, manifest)



def engine_temperature_mismatch(analysis, ctx) -> list[Cause]:
    """Cause `engine_temperature_mismatch` (key implied_temperature) from the within-context fit."""
    rep = P.report_for(analysis)
    if rep is None:
        return []
    cause = temperature_cause(rep, _fix(analysis.manifest, "engine_temperature_mismatch", rep.fit.implied_temperature))
    return [cause] if cause else []



def engine_mismatch(analysis, ctx) -> list[Cause]:
    """Cause `engine_mismatch`: the built-in KL rule plus offset, first-step and growth checks."""
    builtin = C.engine_mismatch(analysis, ctx)
    rep = P.report_for(analysis)
    if rep is None:
        return builtin
    cause = mismatch_cause(rep, builtin[0] if builtin else None, _fix(analysis.manifest, "engine_mismatch"))
    return [cause] if cause else []



def parity_causes(run, config: P.ParityConfig = P.ParityConfig()) -> list[dict]:
    """The two causes as section-6 dicts for a run path or URI, without an analysis (tests, notebooks)."""
    r = open_run(run)
    rep = P.check_run(run, config)
    if rep is None:
        return []
    found = [temperature_cause(rep, _fix(r.manifest, "engine_temperature_mismatch", rep.fit.implied_temperature)),
             mismatch_cause(rep, None, _fix(r.manifest, "engine_mismatch"))]
    return [c.to_dict() for c in found if c is not None]



C.register(engine_temperature_mismatch)
C.register(engine_mismatch)

