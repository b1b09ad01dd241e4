"""OpenRLHF's `vllm_kl` and `is_filter_ratio`, recomputed from the recorded tokens.

From openrlhf 0.11.2 (PyPI wheel) `openrlhf/models/loss.py` `PolicyLoss.forward` (l. 214-247), logged by
`openrlhf/trainer/ray/ppo_actor.py` (experience.info): with --algo.advantage.is_correction_* on and the
ppo loss, vllm_kl = masked_mean(rollout_log_probs - old_log_probs) (K1 of KL(mu || pi_old)), and
is_filter_ratio = the share of tokens (or sequences, level "seq") outside the [low, high] band of the
gated statistic (ratio exp(old - rollout), its geometric mean per sequence, or a binary KL / TV).
Computed over the step's batch (OpenRLHF: per micro-batch, averaged).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kldiag.crosswalk.batch import StepBatch, masked_mean

NAME = "openrlhf"
NAMES = ["vllm_kl", "is_filter_ratio"]
NO_SAMPLER = "the run has no logp_sampler (OpenRLHF's rollout_log_probs, kept with is_correction enabled)"


@dataclass(frozen=True)
class Settings:
    is_correction_level: str = "token"  # token | seq
    is_correction_mode: str = "mask"  # mask | clip
    is_correction_gating: str = "ratio"  # ratio | binary_kl | tv
    is_correction_low: float = 0.5
    is_correction_high: float = 5.0


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


def step_metrics(b: StepBatch, s: Settings):
    if not b.has_sampler:
        return {}, {n: NO_SAMPLER for n in NAMES}
    rollout = np.where(b.mask, b.logp_sampler, 0.0)
    stat = _stat(b.logp_old, rollout, b.mask, s)
    filtered = (stat < s.is_correction_low) | (stat > s.is_correction_high)
    ratio = float(filtered.astype(float).mean()) if s.is_correction_level == "seq" else float(
        masked_mean(filtered.astype(float), b.mask))
    return {"vllm_kl": float(masked_mean(rollout - b.logp_old, b.mask)), "is_filter_ratio": ratio}, {}


def metric_names(s: Settings) -> list[str]:
    return list(NAMES)
