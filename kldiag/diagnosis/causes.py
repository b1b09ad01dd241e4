"""Cause detectors: each is `f(analysis) -> list[Cause]` (or `f(analysis, ctx)`), listed in DETECTORS.

Another module adds its detectors with `register(f)` at import time (e.g. the parity
detectors of kldiag/diagnosis/parity.py, imported by kldiag.diagnosis.core), or a caller
passes its own list to `diagnose(analysis, detectors=[...])`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kldiag import fmt
from kldiag.analysis.rules import episodes as EP
from kldiag.diagnosis import evidence
from kldiag.diagnosis.types import Cause, DiagnosisConfig, Episode
from kldiag.frameworks import CLAMPED_K3, clamps, fix_for


@dataclass
class Context:
    """What the built-in detectors share: the steps as arrays, the loss, the side scan, the episodes."""

    cols: dict[str, np.ndarray]  # the analysis steps table (episodes.table_cols)
    manifest: Any
    estimator: str
    config: DiagnosisConfig = DiagnosisConfig()
    side: dict[str, np.ndarray] = field(default_factory=dict)  # scan.table(): the side scan by step
    episodes: list[Episode] = field(default_factory=list)

    def side_at(self, step: np.ndarray, name: str) -> np.ndarray:
        """A side-scan column aligned on `step` (NaN where the scan has no such step)."""
        out = np.full(len(step), np.nan)
        if name in self.side and len(self.side["step"]):
            idx = np.searchsorted(self.side["step"], step)
            known = self.side["step"]
            ok = (idx < len(known)) & (known[np.minimum(idx, len(known) - 1)] == step)
            out[ok] = self.side[name][idx[ok]]
        return out


Detector = Callable[..., list[Cause]]
DETECTORS: list[Detector] = []  # detectors of other packages, added with `register`


def register(detector: Detector) -> Detector:
    """Add another package's detector (usable as a decorator); registering twice is a no-op. kldiag's own
    detectors are listed in kldiag.diagnosis.detectors, which runs these after them."""
    if detector not in DETECTORS:
        DETECTORS.append(detector)
    return detector


# ---- the built-in detectors ---------------------------------------------------------------


def _first(step: np.ndarray, fire: np.ndarray) -> int | None:
    hit = np.flatnonzero(fire)
    return int(step[hit[0]]) if len(hit) else None


def _peak(step: np.ndarray, v: np.ndarray, fire: np.ndarray) -> tuple[int, float]:
    vals = np.where(fire, np.nan_to_num(v, nan=-np.inf), -np.inf)
    i = int(np.argmax(vals))
    return int(step[i]), float(v[i])


def _sustained(ctx: Context, fire: np.ndarray) -> np.ndarray:
    return EP.sustained(fire, ctx.config.persistence)


def _clamp_fire(ctx: Context) -> tuple[np.ndarray, np.ndarray]:
    """(share of a step's tokens in the clamp's dead zone, sustained steps over clamp_frac); no steps
    when the loss is not a clamped K3."""
    c = ctx.cols
    share = EP.col(c, "clamp_saturated_count") / np.maximum(EP.col(c, "tokens"), 1.0)
    if ctx.estimator not in ("k3", CLAMPED_K3) or not clamps(ctx.manifest):
        return share, np.zeros(len(share), bool)
    return share, _sustained(ctx, EP.gt(share, ctx.config.clamp_frac))


def _k3_fire(ctx: Context) -> tuple[np.ndarray, np.ndarray]:
    """(sustained steps of a K3 weight past blowup_weight, sustained steps of blame_share past its limit)."""
    c, cfg = ctx.cols, ctx.config
    fire = EP.gt(EP.col(c, "weight_k3_abs_max"), cfg.blowup_weight)
    blame = EP.gt(EP.col(c, "blame_share"), cfg.blame_share)
    return _sustained(ctx, fire), _sustained(ctx, blame)


def _k3_summary(c, cfg: DiagnosisConfig, fire, onset: int, peak: float, peak_step: int, ev: dict) -> str:
    if fire.any():
        head = (f"K3's gradient weight 1 - pi_ref/pi_theta reaches {fmt.metric(peak)} at step {peak_step} (above "
                f"{fmt.metric(cfg.blowup_weight)} from step {_first(c['step'], fire)})")
        if onset < _first(c["step"], fire):
            head += f"; flagged tokens carry over {cfg.blame_share:.0%} of the |k3 weight| from step {onset}"
    else:  # no sustained blow-up: the max may still pass the limit on steps too few in a row
        where = (f"above the blow-up limit {fmt.metric(cfg.blowup_weight)} on isolated steps, not yet sustained: "
                 f"{cfg.persistence.describe()}" if peak > cfg.blowup_weight
                 else f"below the blow-up limit {fmt.metric(cfg.blowup_weight)} so far")
        head = (f"from step {onset}, flagged tokens carry up to {ev['blame_share_max']:.0%} of the |k3 weight| "
                f"(max {fmt.metric(peak)}, {where})")
    return (f"{head}: tokens with pi_theta << pi_ref dominate the KL gradient; the corrected k3_is weight "
            f"at step {peak_step} is {fmt.metric(ev['weight_k3_is_abs_max_at_peak'])}")


def k3_weight_blowup(analysis, ctx: Context) -> list[Cause]:
    """K3 is the loss and its weight 1 - pi_ref/pi_theta passes blowup_weight (DeepSeek-V3.2 3.1):
    critical; or only flagged tokens carry over blame_share of the |k3 weight|: warning. Both need
    a sustained signal (DiagnosisConfig.persistence). On a clamping trainer whose dead zone
    is a cause, the blame share is that of the dead-zone tokens, which have no K3 gradient there: it
    is clamp_dead_zone's evidence, not a second cause."""
    if ctx.estimator != "k3":
        return []
    c, cfg = ctx.cols, ctx.config
    fire, blame = _k3_fire(ctx)
    if not fire.any() and _clamp_fire(ctx)[1].any():
        return []
    onset = _first(c["step"], fire | blame)
    if onset is None:
        return []
    w, share = EP.col(c, "weight_k3_abs_max"), EP.col(c, "blame_share")
    peak_step, peak = _peak(c["step"], w, fire | blame)
    at = int(np.flatnonzero(c["step"] == peak_step)[0])
    ev = {"metric": "weight_k3_abs_max", "threshold": cfg.blowup_weight, "peak": peak, "peak_step": peak_step,
          "steps_over": int(fire.sum()), "steps_blame": int(blame.sum()),
          "blame_share_max": float(np.nanmax(np.where(blame, share, np.nan), initial=0.0)),
          "theta_ll_ref_tokens": int(np.nansum(EP.col(c, "theta_ll_ref_count"))),
          "weight_k3_is_abs_max_at_peak": float(EP.col(c, "weight_k3_is_abs_max")[at]),
          "persistence": cfg.persistence.describe(),
          "tokens": evidence.worst_tokens(analysis.flags, onset, None, cfg.evidence_tokens)}
    summary = _k3_summary(c, cfg, fire, onset, peak, peak_step, ev)
    severity = "critical" if fire.any() else "warning"
    return [Cause("k3_weight_blowup", onset, severity, ev, fix_for("k3_weight_blowup", ctx.manifest), summary)]


def clamp_dead_zone(analysis, ctx: Context) -> list[Cause]:
    """A clamping trainer gives tokens with k3 > 10 (pi_ref/pi_theta > 13.6) no KL gradient: over
    clamp_frac of a step's tokens there, sustained. The blame share of those tokens (K3's
    would-be weight) is folded into its evidence."""
    c, cfg = ctx.cols, ctx.config
    share, fire = _clamp_fire(ctx)
    onset = _first(c["step"], fire)
    if onset is None:
        return []
    peak_step, peak = _peak(c["step"], share, fire)
    _, blame = _k3_fire(ctx)
    blame_share = EP.col(c, "blame_share")
    ev = {"metric": "clamp_saturated_count / tokens", "threshold": cfg.clamp_frac, "peak": peak,
          "peak_step": peak_step, "tokens_in_dead_zone": int(np.nansum(EP.col(c, "clamp_saturated_count"))),
          "steps": int(fire.sum()), "persistence": cfg.persistence.describe(),
          "k3_blame_share_max": float(np.nanmax(blame_share, initial=0.0)) if np.isfinite(blame_share).any() else None,
          "k3_blame_steps": int(blame.sum()),
          "tokens": evidence.worst_tokens(analysis.flags, onset, None, cfg.evidence_tokens, "clamp_saturated")}
    summary = (f"up to {peak:.2%} of a step's tokens have k3 > 10, where the trainer's clamp zeroes their KL gradient "
               f"(pi_theta < pi_ref/13.6), from step {onset}")
    if blame.any():
        summary += (f"; K3 would put up to {ev['k3_blame_share_max']:.0%} of its |weight| on these flagged tokens "
                    "(blame share), which the clamp drops")
    return [Cause("clamp_dead_zone", onset, "warning", ev, fix_for("clamp_dead_zone", ctx.manifest), summary)]


def _level_fire(ctx: Context) -> tuple[np.ndarray, np.ndarray]:
    """(steps whose rho_clip_frac passes clip_frac_high, those whose drift_abs_mean passes drift_abs_high),
    each sustained, and only when the run's median step passes that level: a run chronically far off-policy
    (from its first step, say) is named, a transient early phase or an isolated spike is left to the rules
    on change."""
    c, cfg = ctx.cols, ctx.config
    out = []
    levels = ((EP.col(c, "rho_clip_frac"), cfg.clip_frac_high), (EP.col(c, "drift_abs_mean"), cfg.drift_abs_high))
    for v, level in levels:
        chronic = np.isfinite(v).any() and float(np.nanmedian(v)) > level
        out.append(_sustained(ctx, EP.gt(v, level)) if chronic else np.zeros(len(v), bool))
    return out[0], out[1]


def _drift_reasons(ev: dict, cfg: DiagnosisConfig, fire_ess, fire_mean, fire_clip, fire_drift, w_is) -> list[str]:
    lo, hi = cfg.rho_mean_range
    why = []
    if fire_ess.any():
        why.append(f"rho's effective sample size falls to {ev['rho_ess_min']:.3g} (< {cfg.ess_low})")
    if fire_mean.any():
        why.append(f"mean rho leaves [{lo}, {hi}]")
    if fire_clip.any():
        why.append(f"up to {ev['rho_clip_frac_max']:.0%} of a step's tokens lie outside the PPO clip range "
                   f"(> {cfg.clip_frac_high:.0%} on {ev['steps_clip_high']} steps, the run's median step included; "
                   "healthy runs: a few percent)")
    if fire_drift.any():
        why.append(f"|log pi_theta - log pi_old| averages up to {ev['drift_abs_mean_max']:.3g} nats a token "
                   f"(> {cfg.drift_abs_high:g} on {ev['steps_drift_high']} steps, the run's median step included)")
    if len(w_is) and np.isfinite(w_is).any() and ev["steps_k3_is_blowup"]:
        why.append(f"the k3_is weight rho*log(pi_theta/pi_ref) reaches {fmt.metric(float(np.nanmax(w_is)))}")
    return why


def _finite_max(v: np.ndarray) -> float | None:
    return float(np.nanmax(v)) if np.isfinite(v).any() else None


def offpolicy_drift(analysis, ctx: Context) -> list[Cause]:
    """rho = pi_theta/pi_old: ESS below ess_low or mean outside rho_mean_range (verl rollout_corr.md
    troubleshooting), the k3_is loss's weight blowing up through rho, or an absolute level: the share of
    tokens outside the clip range above clip_frac_high or the mean |log rho| above drift_abs_high
    (docs/metrics.md gives the healthy levels); each sustained."""
    c, cfg = ctx.cols, ctx.config
    ess, mean = EP.col(c, "rho_ess"), EP.col(c, "rho_mean")
    lo, hi = cfg.rho_mean_range
    fire_ess = np.isfinite(ess) & (np.nan_to_num(ess, nan=1.0) < cfg.ess_low)
    fire_mean = np.isfinite(mean) & ((np.nan_to_num(mean, nan=1.0) < lo) | (np.nan_to_num(mean, nan=1.0) > hi))
    w_is = EP.col(c, "weight_k3_is_abs_max")
    fire_is = EP.gt(w_is, cfg.blowup_weight) & (ctx.estimator == "k3_is")
    fire_ess, fire_mean, fire_is = (_sustained(ctx, f) for f in (fire_ess, fire_mean, fire_is))
    fire_clip, fire_drift = _level_fire(ctx)
    fire = fire_ess | fire_mean | fire_is | fire_clip | fire_drift
    onset = _first(c["step"], fire)
    if onset is None:
        return []
    clip, drift = EP.col(c, "rho_clip_frac"), EP.col(c, "drift_abs_mean")
    k = max(1, min(len(clip) // 4, 20))
    ev = {"rho_ess_min": float(np.nanmin(ess, initial=np.inf)), "ess_threshold": cfg.ess_low,
          "rho_mean_range": list(cfg.rho_mean_range), "rho_max": float(np.nanmax(EP.col(c, "rho_max"), initial=0)),
          "rho_clip_frac_first": float(np.nanmean(clip[:k])) if np.isfinite(clip[:k]).any() else None,
          "rho_clip_frac_last": float(np.nanmean(clip[-k:])) if np.isfinite(clip[-k:]).any() else None,
          "rho_clip_frac_max": _finite_max(clip), "clip_frac_threshold": cfg.clip_frac_high,
          "drift_abs_mean_max": _finite_max(drift), "drift_abs_threshold": cfg.drift_abs_high,
          "steps_ess_low": int(fire_ess.sum()), "steps_mean_out": int(fire_mean.sum()),
          "steps_k3_is_blowup": int(fire_is.sum()), "steps_clip_high": int(fire_clip.sum()),
          "steps_drift_high": int(fire_drift.sum())}
    why = _drift_reasons(ev, cfg, fire_ess, fire_mean, fire_clip, fire_drift, w_is)
    summary = f"off-policy drift from step {onset}: " + "; ".join(why)
    severity = "critical" if fire_is.any() else "warning"
    return [Cause("offpolicy_drift", onset, severity, ev, fix_for("offpolicy_drift", ctx.manifest), summary)]


def engine_mismatch(analysis, ctx: Context) -> list[Cause]:
    """Sampler vs trainer. Warning when the mismatch dominates the off-policy gap (kldiag report's
    rule: mean KL(mu||pi_old) above mismatch_kl and sqrt(2 KL) above the mean policy drift
    |log pi_theta/pi_old|); info when it is present but smaller, i.e. the median token_mult_prob_error
    exceeds NeMo-RL's 1.05. Onset: the first step where either holds, sustained (no cause when neither
    persists on any stretch). parity.py may replace it."""
    c, cfg = ctx.cols, ctx.config
    kl, drift = EP.col(c, "mismatch_kl"), EP.col(c, "drift_abs_mean")
    tmpe = ctx.side_at(c["step"], "token_mult_prob_error")
    mean_kl = float(np.nanmean(kl)) if np.isfinite(kl).any() else math.nan
    mean_drift = float(np.nanmean(drift)) if np.isfinite(drift).any() else 0.0
    dominates = mean_kl > cfg.mismatch_kl and math.sqrt(2 * mean_kl) > mean_drift
    median_t = float(np.nanmedian(tmpe)) if np.isfinite(tmpe).any() else math.nan
    if not (dominates or median_t > cfg.token_mult_prob_error):
        return []
    fire_kl, _ = EP.mismatch_rule(c, EP.RuleContext(config=cfg))
    onset = EP.first_sustained(c["step"], fire_kl | EP.gt(tmpe, cfg.token_mult_prob_error), cfg)
    if onset is None:  # the run's means come from isolated steps: a note, left to the episodes
        return []
    ev = {"mismatch_kl_mean": mean_kl, "mismatch_kl_max": float(np.nanmax(kl)) if np.isfinite(kl).any() else None,
          "mismatch_kl_threshold": cfg.mismatch_kl, "drift_abs_mean": mean_drift, "dominates_drift": dominates,
          "token_mult_prob_error_median": median_t,
          "token_mult_prob_error_max": float(np.nanmax(tmpe)) if np.isfinite(tmpe).any() else None,
          "token_mult_prob_error_threshold": cfg.token_mult_prob_error}
    verb = "dominates the off-policy gap" if dominates else "is present, though smaller than the policy drift"
    summary = (f"sampler/trainer mismatch {verb}: mean KL(mu||pi_old) {fmt.metric(mean_kl)} per token vs policy drift "
               f"|log pi_theta/pi_old| {fmt.metric(mean_drift)}; median token_mult_prob_error {fmt.metric(median_t)} "
               f"(NeMo-RL flags > {cfg.token_mult_prob_error})")
    return [Cause("engine_mismatch", onset, "warning" if dominates else "info", ev,
                  fix_for("engine_mismatch", ctx.manifest), summary)]


def numerical_fault(analysis, ctx: Context) -> list[Cause]:
    """NaN/inf or positive log-probs, with where they first appear (step, seq, pos, rank, column)."""
    c = ctx.cols
    nonfinite, invalid = np.nan_to_num(EP.col(c, "nonfinite_count")), np.nan_to_num(EP.col(c, "invalid_count"))
    onset = _first(c["step"], (nonfinite + invalid) > 0)
    if onset is None:
        return []
    first = (evidence.worst_tokens(analysis.flags, onset, onset, 1, "nonfinite")
             or evidence.worst_tokens(analysis.flags, onset, onset, 1, "invalid"))
    where = ""
    if first:
        t = first[0]
        bad = [k for k in ("logp", "logp_old", "logp_ref", "logp_sampler")
               if t.get(k) is not None and (not math.isfinite(t[k]) or t[k] > 0)]
        where = f" (first at seq {t['seq']} pos {t['pos']} rank {t['rank']}{', in ' + ', '.join(bad) if bad else ''})"
    ev = {"nonfinite_tokens": int(nonfinite.sum()), "invalid_tokens": int(invalid.sum()),
          "steps": int(((nonfinite + invalid) > 0).sum()), "first": first[0] if first else None}
    summary = (f"{ev['nonfinite_tokens']} NaN/inf and {ev['invalid_tokens']} positive log-probs, the first at step "
               f"{onset}{where}")
    return [Cause("numerical_fault", onset, "critical", ev, fix_for("numerical_fault", ctx.manifest), summary)]


def _runs_of(fire: np.ndarray, length: int) -> np.ndarray:
    """Indices of the last row of each stretch of `length` consecutive firing rows."""
    run = np.convolve(fire.astype(int), np.ones(length, int), "full")[:len(fire)]
    return np.flatnonzero(run >= length)


def _early(v: np.ndarray, k: int) -> tuple[float, float]:
    """(median, robust standard deviation 1.4826 * MAD) of the first k finite values."""
    x = v[:k][np.isfinite(v[:k])]
    if not len(x):
        return math.nan, math.nan
    med = float(np.median(x))
    return med, float(1.4826 * np.median(np.abs(x - med)))


def _entropy_onset(ent: np.ndarray, confirmed: int, level: float, spread: float, cfg: DiagnosisConfig) -> int:
    """Row where the fall began: the one after the last row, before `confirmed`, whose entropy was still
    within the early band (entropy_band of the early level, or 3 robust sd, whichever is larger)."""
    band = max(cfg.entropy_band * level, 3.0 * spread)
    inside = np.flatnonzero(ent[:confirmed] >= level - band)
    return int(inside[-1]) + 1 if len(inside) else 0


def entropy_collapse(analysis, ctx: Context) -> list[Cause]:
    """The mean entropy falls below collapse_entropy_ratio x the run's own early level (the median of
    its first max(quiet_steps, steps/10) steps) for quiet_steps steps in a row; the onset is where it
    left its early band. Without recorded entropies: over collapse_share of the tokens have
    p > confident_p, from a start below collapse_share - 0.2, for quiet_steps steps in a row.
    kldiag's own thresholds (no framework documents one)."""
    s, cfg = ctx.side, ctx.config
    step, share, ent = s["step"], s["confident_share"], s["entropy_mean"]
    q = max(cfg.quiet_steps, 1)
    if len(step) < 2 * q:
        return []
    k = max(q, len(step) // 10)
    start_share = float(np.nanmedian(share[:k])) if np.isfinite(share[:k]).any() else math.nan
    level, spread = _early(ent, k)
    if math.isfinite(level):
        done = _runs_of(EP.gt(cfg.collapse_entropy_ratio * level - ent, 0), q)
        first = _entropy_onset(ent, int(done[0]) - q + 1, level, spread, cfg) if len(done) else None
    else:
        done = _runs_of(EP.gt(share, cfg.collapse_share) & (start_share < cfg.collapse_share - 0.2), q)
        first = int(done[0]) - q + 1 if len(done) else None
    if first is None:
        return []
    onset = int(step[first])
    ev = {"confident_p": cfg.confident_p, "confident_share_start": start_share,
          "confident_share_last": float(share[-1]), "entropy_mean_start": level, "entropy_early_sd": spread,
          "entropy_mean_last": float(ent[-1]), "entropy_mean_min": float(np.nanmin(ent, initial=np.inf)),
          "collapse_entropy_ratio": cfg.collapse_entropy_ratio, "collapse_share": cfg.collapse_share,
          "confirmed_step": int(step[done[0]]), "early_steps": k}
    if math.isfinite(level):
        summary = (f"entropy collapse from step {onset}: the mean entropy falls from {level:.3g} nats (the run's "
                   f"first {k} steps) to {ev['entropy_mean_last']:.3g}, below {cfg.collapse_entropy_ratio:g}x its "
                   f"early level for {q} steps in a row by step {ev['confirmed_step']}")
    else:
        summary = (f"entropy collapse from step {onset}: {share[-1]:.0%} of the tokens now have p > "
                   f"{cfg.confident_p} (at the start {start_share:.0%}; no entropies recorded)")
    return [Cause("entropy_collapse", onset, "warning", ev, fix_for("entropy_collapse", ctx.manifest), summary)]
