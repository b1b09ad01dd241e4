"""`engine_wrong_weights`: from some step on, the engine's log-probs agree with the reference model far better
than with the policy the trainer scores (pi_old): the rollout engine serves the wrong weights.

slime #1695 (fixed by #2380): after a resume the rollout engine served the reference model; a token's log-prob
was -0.1106 from the engine, -0.1111 from the reference and -0.1471 from the actor. vLLM #34186 and #34591:
a LoRA adapter silently not applied, the base model sampled. Miles #2835: the weight version resets after a
resume. kldiag records pi_ref beside mu per token, so it can tell which model the engine ran.

On the parity fit set (kldiag.mismatch.parity.tokens_for: the diagnosis's bounded token sample), per step over
the tokens in the loss with log mu, log pi_old and log pi_ref:

    d_ref = mean |log mu - log pi_ref|      d_old = mean |log mu - log pi_old|

A step fires when d_ref <= `ratio` x d_old and d_old - d_ref >= `min_gap` nats; the onset is the first
sustained step (DiagnosisConfig.persistence) from which at least `hold_share` of the steps to the run's end
fire: wrong weights stay served, while an engine that starts stale (its first sync still ahead, or a lag)
serves the initial weights, which are pi_ref's, only until its first sync. Critical: every importance weight,
KL term and advantage of the run is computed against samples of another model. It absorbs `engine_mismatch` and
the mismatch root causes it explains (ABSORBS): the figures of the mismatch are this cause's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kldiag.analysis.rules import episodes as EP
from kldiag.diagnosis import causes as C
from kldiag.diagnosis.types import Cause
from kldiag.frameworks import fix_for
from kldiag.mismatch import parity as P

ABSORBS = ("engine_mismatch", "engine_precision", "engine_async_lag", "engine_stale_weights")


@dataclass(frozen=True)
class WrongWeightsConfig:
    """kldiag's own thresholds (docs/metrics.md, `engine_wrong_weights`)."""

    ratio: float = 0.25  # d_ref at most this x d_old ...
    min_gap: float = 0.02  # ... and below it by this many nats a token (far above bf16 rounding)
    min_tokens: int = 20  # a step's figures need this many tokens with all three log-probs
    hold_share: float = 0.8  # from the onset to the run's end, this share of the steps fire


def distances(ts) -> dict[str, np.ndarray]:
    """Per step of the token set [S]: step, tokens, d_ref and d_old (NaN where a step has no such token)."""
    ok = ts.mask & np.isfinite(ts.logp_sampler) & np.isfinite(ts.logp_ref) & np.isfinite(ts.logp_old)
    steps, idx = np.unique(ts.step[ok], return_inverse=True)
    n = np.bincount(idx, minlength=len(steps)).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        d_ref = np.bincount(idx, weights=np.abs(ts.logp_sampler[ok] - ts.logp_ref[ok]), minlength=len(steps)) / n
        d_old = np.bincount(idx, weights=np.abs(ts.logp_sampler[ok] - ts.logp_old[ok]), minlength=len(steps)) / n
    return {"step": steps, "tokens": n.astype(np.int64), "d_ref": d_ref, "d_old": d_old}


def _fire(d: dict, cfg: WrongWeightsConfig) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        hit = (d["d_ref"] <= cfg.ratio * d["d_old"]) & (d["d_old"] - d["d_ref"] >= cfg.min_gap)
    return np.nan_to_num(hit, nan=False).astype(bool) & (d["tokens"] >= cfg.min_tokens)


def _onset(step: np.ndarray, fire: np.ndarray, cfg: WrongWeightsConfig, dcfg) -> int | None:
    """The first sustained firing step from which hold_share of the steps to the end fire."""
    held = EP.sustained(fire, dcfg.persistence)
    rest = np.cumsum(fire[::-1])[::-1] / np.arange(len(fire), 0, -1)  # share firing from each step to the end
    hit = np.flatnonzero(held & (rest >= cfg.hold_share))
    return int(step[hit[0]]) if len(hit) else None


def _mean(v: np.ndarray) -> float | None:
    return float(np.nanmean(v)) if np.isfinite(v).any() else None


def _evidence(d: dict, fire: np.ndarray, onset: int, cfg: WrongWeightsConfig) -> dict:
    after, before = d["step"] >= onset, d["step"] < onset
    per = [{"step": int(s), "d_ref": float(r), "d_old": float(o)} for s, r, o in
           zip(d["step"], d["d_ref"], d["d_old"], strict=True) if onset - 3 <= s < onset + 5]
    return {"d_ref_after": _mean(d["d_ref"][after]), "d_old_after": _mean(d["d_old"][after]),
            "d_ref_before": _mean(d["d_ref"][before]), "d_old_before": _mean(d["d_old"][before]),
            "steps_firing": int(fire.sum()), "steps_after_onset": int(after.sum()),
            "share_after_onset": float(fire[after].mean()) if after.any() else None,
            "ratio_threshold": cfg.ratio, "min_gap": cfg.min_gap, "around_onset": per,
            "served": "the reference model (pi_ref)"}


def engine_wrong_weights(analysis, ctx: C.Context, cfg: WrongWeightsConfig = WrongWeightsConfig()) -> list[Cause]:
    """The cause (module docstring); none without sampler and reference log-probs."""
    ts = P.tokens_for(analysis)
    if ts is None or not ts.has_ref:
        return []
    d = distances(ts)
    fire = _fire(d, cfg)
    onset = _onset(d["step"], fire, cfg, ctx.config)
    if onset is None:
        return []
    ev = _evidence(d, fire, onset, cfg)
    summary = (f"from step {onset} the engine's log-probs are the reference model's: |log mu - log pi_ref| averages "
               f"{ev['d_ref_after']:.3g} nats a token against {ev['d_old_after']:.3g} from the trainer's pi_old "
               f"({ev['steps_firing']} of {ev['steps_after_onset']} steps from there)")
    if ev["d_ref_before"] is not None:
        summary += f"; before it {ev['d_ref_before']:.3g} and {ev['d_old_before']:.3g}"
    summary += (": the rollout engine serves the wrong weights (a resume that loaded the base, a LoRA adapter not "
                "applied)")
    return [Cause("engine_wrong_weights", onset, "critical", ev, fix_for("engine_wrong_weights", ctx.manifest),
                  summary)]


engine_wrong_weights.absorbs = ABSORBS
