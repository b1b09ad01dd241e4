"""NeMo-RL's generation-vs-training mismatch metrics, recomputed from the recorded tokens.

From NVIDIA-NeMo/RL@7ea279ab `nemo_rl/algorithms/loss/loss_functions.py` (ClippedPGLossFn, l. 404-470)
and `nemo_rl/algorithms/utils.py` `calculate_kl` (no clamps for these metrics), with prev_logprobs =
pi_old (logp_old) and generation_logprobs = mu (logp_sampler); token means over the step's batch
(NeMo-RL normalises by the global valid-token count):
- `token_mult_prob_error` = mean exp(|gen - prev|)
- `gen_kl_error` = mean calculate_kl(gen, prev, reference_policy_kl_type): KL(P_gen || P_train)
- `policy_kl_error` = mean calculate_kl(prev, gen, ...)
- `js_divergence_error` = mean of 0.5 KL(P_train||M) + 0.5 KL(P_gen||M), M = (P_train + P_gen)/2, per token
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kldiag.crosswalk.batch import StepBatch, masked_mean

NAME = "nemo-rl"
NAMES = ["token_mult_prob_error", "gen_kl_error", "policy_kl_error", "js_divergence_error"]
NO_SAMPLER = "the run has no logp_sampler (NeMo-RL's generation_logprobs)"


@dataclass(frozen=True)
class Settings:
    reference_policy_kl_type: str = "k3"  # loss_fn.reference_policy_kl_type
    force_on_policy_ratio: bool = False  # loss_fn.force_on_policy_ratio: prev = curr


def calculate_kl(logprobs: np.ndarray, ref: np.ndarray, kl_type: str) -> np.ndarray:
    logr = ref - logprobs
    if kl_type == "k1":
        return -logr
    if kl_type == "k2":
        return logr**2 / 2
    if kl_type == "k3":
        with np.errstate(over="ignore"):
            return np.exp(logr) - 1 - logr
    raise ValueError(f"reference_policy_kl_type={kl_type!r}: use k1, k2 or k3")


def step_metrics(b: StepBatch, s: Settings):
    if not b.has_sampler:
        return {}, {n: NO_SAMPLER for n in NAMES}
    gen = np.where(b.mask, b.logp_sampler, 0.0)
    prev = b.logp if s.force_on_policy_ratio else b.logp_old
    m = b.mask
    with np.errstate(over="ignore"):
        mix = np.log(0.5 * np.exp(prev) + 0.5 * np.exp(gen))
        js = 0.5 * (np.exp(prev - mix) - (prev - mix) - 1) + 0.5 * (np.exp(gen - mix) - (gen - mix) - 1)
        out = {"token_mult_prob_error": float(masked_mean(np.exp(np.abs(gen - prev) * m), m)),
               "gen_kl_error": float(masked_mean(calculate_kl(gen, prev, s.reference_policy_kl_type), m)),
               "policy_kl_error": float(masked_mean(calculate_kl(prev, gen, s.reference_policy_kl_type), m)),
               "js_divergence_error": float(masked_mean(js, m))}
    return out, {}


def metric_names(s: Settings) -> list[str]:
    return list(NAMES)
