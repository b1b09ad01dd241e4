"""OpenRLHF's `vllm_kl` and `is_filter_ratio`, recomputed from the recorded tokens.

From openrlhf 0.11.2 (PyPI wheel) `openrlhf/models/loss.py` `PolicyLoss.forward` (l. 214-247), logged by
`openrlhf/trainer/ray/ppo_actor.py` (experience.info): with --algo.advantage.is_correction_* on and the
ppo loss, vllm_kl = masked_mean(rollout_log_probs - old_log_probs) (K1 of KL(mu || pi_old)), and
is_filter_ratio = the share of tokens (or sequences, level "seq") outside the [low, high] band of the
gated statistic (ratio exp(old - rollout), its geometric mean per sequence, or a binary KL / TV): in mask
mode every unit not kept by (stat >= low) & (stat <= high), so a NaN statistic (a sequence without a
trained token) counts as filtered; in clip mode (stat < low) | (stat > high).
The step's figure (`openrlhf/trainer/ray/ppo_actor.py` `ppo_train`): both are 0-d per micro-batch
(`training_step`), so token-weighted: sum over the step's micro-batches (every epoch, every DP rank) of
value * its action tokens, over their total tokens. vllm_kl and the token-level ratio are then the step's
token means whatever the micro-batches; the seq-level ratio (a share of each micro-batch's sequences) needs
them: kldiag's recorded (iteration, rank, micro) groups. A micro-batch with no action token makes OpenRLHF's
weighted mean NaN (its masked_mean is 0/0): null, with why.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from kldiag.crosswalk.batch import StepBatch, masked_mean

NAME = "openrlhf"
NAMES = ["vllm_kl", "is_filter_ratio"]
NO_SAMPLER = "the run has no logp_sampler (OpenRLHF's rollout_log_probs, kept with is_correction enabled)"
EMPTY_MICRO = ("a micro-batch of this step has no action token: OpenRLHF's masked_mean there is 0/0, so the "
               "token-weighted step mean it logs is NaN")
NAN_ROLLOUT = "a rollout log-prob of this step is NaN: OpenRLHF's vllm_kl (a masked mean over it) is NaN"
NEEDS_ALL_ITERATIONS = True  # ppo_train weights every micro-batch of every epoch by its action tokens


OFF = "is_correction_level=off: OpenRLHF computes vllm_kl and is_filter_ratio only with token or seq correction"


@dataclass(frozen=True)
class Settings:
    """OpenRLHF's `--algo.advantage.is_correction_*` keys (defaults: `PolicyLoss`, but level token: with
    OpenRLHF's own default, off, it logs neither metric). Refused as `PolicyLoss.__init__` refuses them."""

    is_correction_level: str = "token"  # off | token | seq
    is_correction_mode: str = "mask"  # mask | clip
    is_correction_gating: str = "ratio"  # ratio | binary_kl | tv
    is_correction_threshold: Any = (0.5, 5.0)  # "LOW HIGH", or "HIGH" alone for [0, HIGH] (train_ppo_ray.py)

    def __post_init__(self) -> None:
        object.__setattr__(self, "is_correction_threshold", band(self.is_correction_threshold))
        checks = [(self.is_correction_level in ("off", "token", "seq"), "is_correction_level must be off/token/seq"),
                  (self.is_correction_mode in ("mask", "clip"), "is_correction_mode must be mask/clip"),
                  (self.is_correction_gating in ("ratio", "binary_kl", "tv"),
                   "is_correction_gating must be ratio/binary_kl/tv"),
                  (self.is_correction_mode != "clip" or (self.is_correction_level != "seq"
                                                         and self.is_correction_gating == "ratio"),
                   "is_correction_mode=clip requires is_correction_level=token and is_correction_gating=ratio"),
                  (self.is_correction_gating == "ratio" or self.is_correction_level == "off"
                   or self.is_correction_threshold[0] <= 0,
                   f"is_correction_gating={self.is_correction_gating} takes an upper bound only (a single delta): "
                   "set is_correction_threshold=HIGH")]
        for ok, why in checks:
            if not ok:
                raise ValueError(f"OpenRLHF refuses this configuration (PolicyLoss): {why}")


def band(threshold: Any) -> tuple[float, float]:
    """(low, high) from OpenRLHF's is_correction_threshold: LOW HIGH, or HIGH alone meaning [0, HIGH]."""
    if isinstance(threshold, str):
        threshold = [x for x in re.split(r"[\s,_]+", threshold.strip()) if x]
    values = [float(x) for x in (threshold if isinstance(threshold, (list, tuple)) else [threshold])]
    if len(values) == 1:
        values.insert(0, 0.0)
    if len(values) != 2:
        raise ValueError(f"is_correction_threshold={threshold!r}: OpenRLHF takes HIGH or LOW HIGH")
    return values[0], values[1]


def _stat(old: np.ndarray, rollout: np.ndarray, mask: np.ndarray, s: Settings) -> np.ndarray:
    lr = old - rollout
    seq = s.is_correction_level == "seq"
    if s.is_correction_gating == "ratio":
        return np.exp(masked_mean(lr, mask, axis=-1)[:, None] if seq else lr)
    p = np.clip(np.exp(rollout), 1e-6, 1 - 1e-6)
    q = np.clip(np.exp(old), 1e-6, 1 - 1e-6)
    if s.is_correction_gating == "binary_kl":
        stat = p * np.log(p / q) + (1 - p) * np.log((1 - p) / (1 - q))
    elif s.is_correction_gating == "tv":
        stat = np.abs(p - q)
    else:
        raise ValueError(f"is_correction_gating={s.is_correction_gating!r}: use ratio, binary_kl or tv")
    return masked_mean(stat, mask, axis=-1)[:, None] if seq else stat


def micro_metrics(b: StepBatch, s: Settings) -> tuple[float, float]:
    """(vllm_kl, is_filter_ratio) of one micro-batch, as PolicyLoss.forward returns them."""
    rollout = np.where(b.mask, b.logp_sampler, 0.0)
    stat = _stat(b.logp_old, rollout, b.mask, s)
    low, high = s.is_correction_threshold
    with np.errstate(invalid="ignore"):  # a NaN statistic (a sequence with no token in the loss):
        if s.is_correction_mode == "clip":  # clip counts it as kept, mask as filtered (~keep), as OpenRLHF does
            filtered = (stat < low) | (stat > high)
        else:
            filtered = ~((stat >= low) & (stat <= high))
        ratio = float(filtered.astype(float).mean()) if s.is_correction_level == "seq" else float(
            masked_mean(filtered.astype(float), b.mask))
        return float(masked_mean(rollout - b.logp_old, b.mask)), ratio


def step_metrics(b: StepBatch, s: Settings, calls: list[StepBatch] | None = None):
    """`calls`: the step's micro-batches (every epoch and rank); None: the step's batch as one."""
    if s.is_correction_level == "off":
        return {}, {n: OFF for n in NAMES}
    calls = [c for c in (calls or [b]) if len(c.seq)]
    if not any(np.isfinite(c.logp_sampler[c.mask]).any() for c in calls):
        return {}, {n: NO_SAMPLER for n in NAMES}
    tokens = np.array([c.mask.sum() for c in calls], np.float64)
    if (tokens == 0).any():
        return {}, {n: EMPTY_MICRO for n in NAMES}
    values = np.array([micro_metrics(c, s) for c in calls])  # [calls, 2]
    kl, ratio = (values * tokens[:, None]).sum(0) / tokens.sum()
    # a NaN rollout log-prob (the engine's) makes OpenRLHF's vllm_kl NaN; its statistic fails the band
    # check, so is_filter_ratio stays a number (mask mode: filtered; clip mode: kept)
    if not np.isfinite(kl):
        return {"is_filter_ratio": float(ratio)}, {"vllm_kl": NAN_ROLLOUT}
    return {"vllm_kl": float(kl), "is_filter_ratio": float(ratio)}, {}


def metric_names(s: Settings) -> list[str]:
    return list(NAMES)
