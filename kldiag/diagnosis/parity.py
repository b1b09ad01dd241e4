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



KL_KEYS = ("mismatch_kl_mean", "mismatch_kl_max", "mismatch_kl_threshold", "drift_abs_mean", "dominates_drift",
           "token_mult_prob_error_median", "token_mult_prob_error_max")


def _per_step_temperatures(rep: P.ParityReport) -> dict:
    ok = np.isfinite(rep.steps.slope) & (rep.steps.slope > 0)
    temps = 1.0 / rep.steps.slope[ok]
    return {"min": float(temps.min()) if len(temps) else None,
            "median": float(np.median(temps)) if len(temps) else None,
            "max": float(temps.max()) if len(temps) else None}


def temperature_cause(rep: P.ParityReport, fix: str, builtin: Cause | None = None) -> Cause | None:
    """engine_temperature_mismatch with a numeric implied_temperature (top-level key). Onset: the first
    step whose slope is off the same way, sustained. `builtin`, the KL(mu||pi_old) rule's engine_mismatch,
    is folded into the evidence when the temperature explains it (rep.explains_mismatch)."""
    if not rep.temperature:
        return None
    f, cfg = rep.fit, rep.config
    onset = _onset(rep, rep.temperature_steps)
    ev = {"fit": f.to_dict(), "slope_tolerance": cfg.slope_tol, "explain_ratio": cfg.explain_ratio,
          "implied_temperature_per_step": _per_step_temperatures(rep),
          "steps_off": int(rep.temperature_steps.sum()), "steps": int(len(rep.steps.step)),
          "persistence": cfg.persistence.describe()}
    kind = "sharper" if f.implied_temperature < 1 else "flatter"
    summary = (f"the engine's log-probs are those of temperature {f.implied_temperature:.3g} (slope of log mu on log "
               f"pi_old {f.slope:.4g} within shared contexts, residual {f.residual_std:.2g} nats) while the trainer "
               f"scores at 1: mu is {kind} than pi_old; a sampling temperature the trainer does not apply, or "
               "processed vs raw log-probs")
    if f.method == "pooled":
        summary += " (pooled fit: no shared contexts, the temperature is approximate)"
    if builtin is not None and rep.explains_mismatch:
        ev["explained_mismatch"] = {k: builtin.evidence.get(k) for k in KL_KEYS}
        summary += (f"; it accounts for the KL(mu||pi_old) of {builtin.evidence.get('mismatch_kl_mean', math.nan):.3g} "
                    "per token (no residual mismatch beyond float noise)")
    return Cause("engine_temperature_mismatch", onset, "warning", ev, fix, summary,
                 extra={"implied_temperature": float(f.implied_temperature)})


def _mismatch_reasons(rep: P.ParityReport) -> list[str]:
    s, cfg, why = rep.steps, rep.config, []
    if rep.offset:
        why.append(f"a constant offset: log mu - log pi_old averages {rep.fit.offset:+.3g} nats at slope "
                   f"{rep.fit.slope:.3g}")
    if rep.first_step_disagrees and not rep.temperature:  # a temperature mismatch explains it otherwise
        why.append(f"already at the first step ({int(s.step[0])}) |log mu - log pi_old| averages "
                   f"{s.mismatch_abs[0]:.3g} nats (float noise < {cfg.float_noise})")
    if rep.growing:
        why.append(f"mismatch grows x{rep.growth['mismatch_growth']:.3g} over the run while the policy drift "
                   f"changes x{rep.growth['drift_growth']:.3g}")
    if rep.temperature and rep.residual_steps.any():
        worst = float(np.nanmax(s.resid_rms[rep.residual_steps]))
        why.append(f"beyond the temperature, log mu leaves the fit by up to {worst:.3g} nats rms a step from step "
                   f"{_onset(rep, rep.residual_steps)} (float noise < {cfg.float_noise})")
    return why


def mismatch_cause(rep: P.ParityReport, builtin: Cause | None, fix: str) -> Cause | None:
    """engine_mismatch: offset, first-step disagreement, growth, what a temperature leaves; the built-in
    rule's evidence merged in, unless a temperature mismatch explains it (then it is that cause's evidence)."""
    s, cfg = rep.steps, rep.config
    if rep.explains_mismatch:
        builtin = None
    why, ev = _mismatch_reasons(rep), dict(builtin.evidence) if builtin else {}
    if not why and builtin is None:
        return None
    ev.update({"offset": rep.fit.offset, "offset_se": rep.fit.offset_se, "first_step": int(s.step[0]) if len(s.step)
               else None, "first_step_mismatch_abs": float(s.mismatch_abs[0]) if len(s.step) else None,
               "float_noise": cfg.float_noise, **rep.growth,
               "checks": {"offset": rep.offset, "first_step": rep.first_step_disagrees, "growing": rep.growing,
                          "beyond_temperature": bool(rep.temperature and rep.residual_steps.any())}})
    onset = builtin.onset if builtin else None
    if rep.first_step_disagrees and not rep.temperature:
        onset = int(s.step[0])
    elif rep.temperature and rep.residual_steps.any():
        onset = _onset(rep, rep.residual_steps)
    elif onset is None and len(s.step):
        onset = _onset(rep, s.mismatch_abs > cfg.float_noise)
    summary = "; ".join(([builtin.summary] if builtin else []) + why)
    severity = builtin.severity if builtin else "warning"
    return Cause("engine_mismatch", onset, severity, ev, fix, summary)



def _fix(manifest, name: str, temperature: float = math.nan) -> str:
    return fix_for(name, manifest, t=temperature) if name == "engine_temperature_mismatch" else fix_for(name, manifest)



def engine_temperature_mismatch(analysis, ctx) -> list[Cause]:
    """Cause `engine_temperature_mismatch` (key implied_temperature) from the within-context fit; the
    KL(mu||pi_old) it explains is its evidence, not a second cause."""
    rep = P.report_for(analysis)
    if rep is None:
        return []
    builtin = C.engine_mismatch(analysis, ctx) if rep.explains_mismatch else []
    cause = temperature_cause(rep, _fix(analysis.manifest, "engine_temperature_mismatch", rep.fit.implied_temperature),
                              builtin[0] if builtin else None)
    return [cause] if cause else []



def engine_mismatch(analysis, ctx) -> list[Cause]:
    """Cause `engine_mismatch`: the built-in KL rule plus offset, first-step, growth and beyond-temperature
    checks; none when a temperature mismatch explains the KL rule and nothing else fires."""
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



engine_mismatch.replaces = ("engine_mismatch",)  # the built-in one, even when this one finds nothing
C.register(engine_temperature_mismatch)
C.register(engine_mismatch)

