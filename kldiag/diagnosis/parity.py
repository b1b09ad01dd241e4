"""The engine-parity causes: `engine_temperature_mismatch`, `engine_mismatch` and the mismatch's root causes.

Registered among the detectors on import (kldiag.diagnosis.core imports this module); the fits
themselves are kldiag.mismatch.parity's, the root-cause signatures kldiag.mismatch.signatures'. This
`engine_mismatch` replaces the built-in one and keeps its evidence. One root cause, one cause: a root cause
(`engine_wrong_token`, `engine_raw_logprobs`, `engine_stale_weights`, `engine_async_lag`,
`engine_precision`) that explains the mismatch is named instead of `engine_mismatch`, with the generic
figures as its `explained_mismatch` evidence; raw log-probs are named instead of the temperature. Truncated
sampling (`engine_truncated_sampling`, kldiag.diagnosis.truncation) is named instead of any of them it explains.
"""

from __future__ import annotations

import math

import numpy as np

from kldiag.analysis import analyze
from kldiag.analysis.types import AnalysisConfig
from kldiag.diagnosis import causes as C
from kldiag.diagnosis import truncation as TR
from kldiag.diagnosis.types import Cause
from kldiag.format import open_run
from kldiag.frameworks import fix_for
from kldiag.mismatch import parity as P
from kldiag.mismatch import sample as SS
from kldiag.mismatch import signatures as S


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



def _root(analysis) -> str | None:
    sig = S.report_for(analysis)
    return sig.root if sig is not None else None


def _generic(rep: P.ParityReport, builtin: Cause | None) -> bool:
    """Whether the mismatch is worth a cause at all: the built-in KL / token_mult_prob_error rule, or a parity
    check (offset, first step, growth, a residual beyond a temperature). A root cause needs it (raw log-probs
    need the temperature instead), so a bf16 engine below NeMo-RL's 1.05 stays quiet."""
    return builtin is not None or bool(_mismatch_reasons(rep))


def _explained(rep: P.ParityReport, builtin: Cause | None) -> dict:
    """The generic mismatch figures a root cause accounts for (its `explained_mismatch` evidence)."""
    ev = {k: builtin.evidence.get(k) for k in KL_KEYS} if builtin else {}
    ev.update({"offset": rep.fit.offset, "first_step_mismatch_abs": float(rep.steps.mismatch_abs[0])
               if len(rep.steps.step) else None, **rep.growth, "reasons": _mismatch_reasons(rep)})
    return ev


def _wrong_token(rep, sig: S.Signatures) -> tuple[str, dict, dict]:
    sh = {k: v for k, v in sig.shift.items() if k != "fire"}
    k = sh["shift"]
    summary = (f"the engine's log-prob at position t is that of the token at position t{k:+d}: |log mu - log "
               f"pi_old| averages {sh['aligned_abs']:.3g} nats aligned but {sh['shifted_abs']:.3g} against log pi_old "
               f"shifted by {k:+d} (ratio {sh['ratio']:.2g}, over {sh['pairs']} neighbouring pairs): a shifted gather, "
               "the sampler log-probs belong to the neighbouring token")
    return summary, {"shift": sh, "shift_ratio_threshold": S.SignatureConfig().shift_ratio}, {"shift": k}


def _raw(rep, sig: S.Signatures) -> tuple[str, dict, dict]:
    f, c = rep.fit, sig.calibration
    mean, se = c["mean_log_mu_over_old"], c["se"] or math.nan
    summary = (f"the engine samples at temperature {f.slope:.3g} but returns pre-temperature (raw) log-probs: within "
               f"shared contexts log mu = {f.slope:.4g} x log pi_old + c (residual {f.residual_std:.2g} nats), and the "
               f"sampled tokens follow pi_old, not mu: mean log(mu/pi_old) = {mean:+.3g} nats ({mean / se:.1f} SE; "
               "an engine reporting what it sampled gives +KL(mu||pi_old) > 0), mean pi_old/mu = "
               f"{c['mean_old_over_mu']:.4g} while mean mu/pi_old = {c['mean_mu_over_old']:.4g} (the true sampler's "
               "ratio averages 1)")
    ev = {"fit": f.to_dict(), "calibration": c, "implied_temperature_per_step": _per_step_temperatures(rep),
          "steps_off": int(rep.temperature_steps.sum()), "steps": int(len(rep.steps.step))}
    return summary, ev, {"sampling_temperature": float(f.slope)}


def _precision(rep, sig: S.Signatures) -> tuple[str, dict, dict]:
    pr, al = sig.precision, sig.alignment
    corr = al["corr_with_drift"]
    summary = (f"a small numerical mismatch: mean |log mu - log pi_old| {pr['mismatch_abs_mean']:.3g} nats, "
               f"{pr['first_step_mismatch_abs']:.3g} at the first step and flat (last/first quarter "
               f"x{pr['quarter_ratio']:.2g}), vanishing on confident tokens (|gap| = {pr['gap_at_p1']:.2g} + "
               f"{pr['gap_slope_in_1_minus_p']:.2g} (1 - p_old)), "
               + (f"unrelated to the policy's drift (corr {corr:.2g})" if corr is not None else "no drift recorded")
               + ": the engine's dtype or kernels differ from the trainer's (a bf16 engine against an fp32 trainer)")
    return summary, {"precision": pr, "alignment": al}, {}


def _stale(rep, sig: S.Signatures) -> tuple[str, dict, dict]:
    sy, al = sig.sync, sig.alignment
    n = sy["period"]
    syncs = ", ".join(str(x) for x in sy["sync_steps"][:4]) + (", ..." if len(sy["sync_steps"]) > 4 else "")
    how = ("the engine's lag, matched across steps, climbs and falls back" if sy["method"] == "lag resets"
           else "the per-step mismatch falls back")
    summary = (f"the engine runs stale weights, synced every {n} steps: {how} at steps {syncs}; the mismatch is "
               f"{sy['mismatch_at_sync']:.3g} nats at the syncs and {sy['mismatch_between']:.3g} between them, rising "
               f"with the steps since the sync (rank corr {sy['rise_corr']:.2g})")
    if al["corr_with_drift"] is not None:
        summary += f", along the policy's own drift (corr {al['corr_with_drift']:.2g})"
    ev = {"sync": sy, "alignment": al, "lag_per_step": _lags(sig)}
    return summary, ev, {"sync_period": n}


def _lags(sig: S.Signatures) -> list | None:
    per = sig.lag["per_step"]
    return [int(x) if x >= 0 else None for x in per] if sig.lag["identified"] else None


def _async(rep, sig: S.Signatures) -> tuple[str, dict, dict]:
    lg, al = sig.lag, sig.alignment
    ev = {"lag": {k: v for k, v in lg.items() if k != "per_step"}, "lag_per_step": _lags(sig), "alignment": al,
          "first_step_mismatch_abs": float(rep.steps.mismatch_abs[0])}
    if lg["identified"] and lg["lag"]:
        summary = (f"the engine samples with the policy of {lg['lag']} steps earlier: on {lg['lag_share']:.0%} of the "
                   f"steps with a lag, log mu equals log pi_old of the same context and token {lg['lag']} steps back "
                   f"({lg['matched_abs']:.2g} nats, against {lg['aligned_abs']:.3g} at the same step)")
        return summary, ev, {"lag": lg["lag"]}
    ev["lag_unidentified"] = ("no prompt's contexts recur across steps (group ids differ at every step): record "
                              "group_ids as the prompt's dataset index to measure the lag")
    summary = (f"the engine's log-probs trail the policy: they agree at the first step "
               f"({ev['first_step_mismatch_abs']:.2g} nats), then the mismatch follows the policy's own drift "
               f"(corr(log pi_old - log mu, log pi_theta - log pi_old) = {al['corr_with_drift']:.2g}) with no periodic "
               f"sync: asynchronous (stale) rollouts; the lag in steps cannot be identified: {ev['lag_unidentified']}")
    return summary, ev, {"lag": None}


ROOTS = {"engine_wrong_token": _wrong_token, "engine_raw_logprobs": _raw, "engine_precision": _precision,
         "engine_stale_weights": _stale, "engine_async_lag": _async}


def root_cause(rep: P.ParityReport, sig: S.Signatures, builtin: Cause | None, manifest) -> Cause | None:
    """The Cause for sig.root, the generic mismatch (built-in rule `builtin`, parity checks) folded into its
    evidence; None when that mismatch is not worth a cause (raw log-probs: the temperature is the gate).
    Severity: the generic mismatch's (warning for raw log-probs); onset: the first sustained step of the
    signature's per-step firing."""
    name = sig.root
    if name is None or (name != "engine_raw_logprobs" and not _generic(rep, builtin)):
        return None
    summary, ev, extra = ROOTS[name](rep, sig)
    ev["explained_mismatch"] = _explained(rep, builtin)
    ev["persistence"] = rep.config.persistence.describe()
    onset = _onset(rep, sig.onset_fire) if sig.onset_fire.any() else (builtin.onset if builtin else None)
    severity = "warning" if name == "engine_raw_logprobs" or builtin is None else builtin.severity
    fix = fix_for(name, manifest, t=extra.get("sampling_temperature", math.nan))
    return Cause(name, onset, severity, ev, fix, summary, extra=extra)


def _fix(manifest, name: str, temperature: float = math.nan) -> str:
    return fix_for(name, manifest, t=temperature) if name == "engine_temperature_mismatch" else fix_for(name, manifest)



def engine_temperature_mismatch(analysis, ctx) -> list[Cause]:
    """Cause `engine_temperature_mismatch` (key implied_temperature) from the within-context fit; the
    KL(mu||pi_old) it explains is its evidence, not a second cause."""
    rep = P.report_for(analysis)
    if rep is None or _root(analysis) in ("engine_wrong_token", "engine_raw_logprobs"):
        return []
    if TR.explains(analysis, "engine_temperature_mismatch"):  # a pooled slope bent by truncation
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
    if TR.explains(analysis, "engine_mismatch"):
        return []  # engine_truncated_sampling names it
    if _root(analysis) is not None and _generic(rep, builtin[0] if builtin else None):
        return []  # engine_root_cause names it, with these figures as its evidence
    cause = mismatch_cause(rep, builtin[0] if builtin else None, _fix(analysis.manifest, "engine_mismatch"))
    return [cause] if cause else []


def engine_root_cause(analysis, ctx) -> list[Cause]:
    """The mismatch's root cause (kldiag.mismatch.signatures) in place of engine_mismatch: a shifted gather,
    raw log-probs, stale weights, an asynchronous lag, or precision."""
    rep, sig = P.report_for(analysis), S.report_for(analysis)
    if rep is None or sig is None or sig.root is None or TR.explains(analysis, sig.root):
        return []
    builtin = C.engine_mismatch(analysis, ctx)
    cause = root_cause(rep, sig, builtin[0] if builtin else None, analysis.manifest)
    return [cause] if cause else []



def parity_causes(run, config: P.ParityConfig = P.ParityConfig()) -> list[dict]:
    """The parity causes as section-6 dicts for a run path or URI, without a diagnosis (tests, notebooks):
    the KL(mu||pi_old) rule of the built-in engine_mismatch is not applied (no steps table at hand)."""
    r = open_run(run)
    analysis = analyze(run, AnalysisConfig(), [SS.SampleReducer()])
    rep = P.report_for(analysis, config)
    if rep is None:
        return []
    sig = S.report_for(analysis, parity=config)
    root = root_cause(rep, sig, None, r.manifest) if sig is not None and sig.root else None
    if root is not None:  # a root cause leaves no temperature (signatures._root) and no generic mismatch
        found = [root]
    else:
        found = [temperature_cause(rep, _fix(r.manifest, "engine_temperature_mismatch", rep.fit.implied_temperature)),
                 mismatch_cause(rep, None, _fix(r.manifest, "engine_mismatch"))]
    return [c.to_dict() for c in found if c is not None]



engine_mismatch.replaces = ("engine_mismatch",)  # the built-in one, even when this one finds nothing

