"""NeMo-RL's generation-vs-training mismatch metrics, recomputed from the recorded tokens.

From NVIDIA-NeMo/RL@7ea279ab `nemo_rl/algorithms/loss/loss_functions.py` (ClippedPGLossFn.__call__,
l. 404-466) and `nemo_rl/algorithms/utils.py` (`calculate_kl` with no clamps for these metrics,
`masked_mean`: sum(values * mask) / (global_valid_toks + 1e-8)), with prev_logprobs = pi_old (logp_old)
and generation_logprobs = mu (logp_sampler). Per token:
- `token_mult_prob_error` = exp(|gen - prev|)
- `gen_kl_error` = calculate_kl(gen, prev, reference_policy_kl_type): KL(P_gen || P_train)
- `policy_kl_error` = calculate_kl(prev, gen, ...)
- `js_divergence_error` = 0.5 KL(P_train||M) + 0.5 KL(P_gen||M), M = (P_train + P_gen)/2
The step's figure: the step's samples (data.size = num_prompts_per_step * num_generations_per_prompt) are
cut into data.size // train_global_batch_size global batches of consecutive samples
(`BatchedDataDict.shard_by_batch_size`, policy workers' `train`); each micro-batch's metric is its masked
sum over its global batch's valid tokens, divided by the number of global batches
(`nemo_rl/models/automodel/train.py` l. 523-534, megatron_policy_worker.py l. 1014), and grpo.py sums the
step's micro-batch values (l. 3466-3489): the mean over global batches of each one's token mean.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kldiag.crosswalk.batch import StepBatch, masked_mean

NAME = "nemo-rl"
NAMES = ["token_mult_prob_error", "gen_kl_error", "policy_kl_error", "js_divergence_error"]
NO_SAMPLER = "the run has no logp_sampler (NeMo-RL's generation_logprobs)"
NAN_SAMPLER = "a generation log-prob of this step is NaN: NeMo-RL's token means over it are NaN"
SEQ_SHIFT = 32  # kldiag's NeMo-RL importer numbers a step's sample idx as seq = step * 2**32 + idx
EPS = 1e-8  # nemo_rl.algorithms.utils.masked_mean


@dataclass(frozen=True)
class Settings:
    """NeMo-RL config keys: loss_fn.*, policy.train_global_batch_size, grpo.num_prompts_per_step and
    grpo.num_generations_per_prompt (null: one global batch per step, NeMo's setting when
    train_global_batch_size = num_prompts_per_step * num_generations_per_prompt)."""

    reference_policy_kl_type: str = "k3"  # loss_fn.reference_policy_kl_type
    force_on_policy_ratio: bool = False  # loss_fn.force_on_policy_ratio: prev = curr
    train_global_batch_size: int | None = None  # policy.train_global_batch_size
    num_prompts_per_step: int | None = None  # grpo.num_prompts_per_step
    num_generations_per_prompt: int | None = None  # grpo.num_generations_per_prompt

    def __post_init__(self) -> None:
        if self.reference_policy_kl_type not in ("k1", "k2", "k3"):
            raise ValueError(f"reference_policy_kl_type={self.reference_policy_kl_type!r}: NeMo-RL's calculate_kl "
                             "takes k1, k2 or k3")
        if self.train_global_batch_size is not None and int(self.train_global_batch_size) < 1:
            raise ValueError("train_global_batch_size must be a positive number of samples")
        if (self.num_prompts_per_step is None) != (self.num_generations_per_prompt is None):
            raise ValueError("set both num_prompts_per_step and num_generations_per_prompt (their product is the "
                             "step's sample count), or neither")


def calculate_kl(logprobs: np.ndarray, ref: np.ndarray, kl_type: str) -> np.ndarray:
    logr = ref - logprobs
    if kl_type == "k1":
        return -logr
    if kl_type == "k2":
        return logr**2 / 2
    with np.errstate(over="ignore"):
        return np.exp(logr) - 1 - logr


def per_token(prev: np.ndarray, gen: np.ndarray, m: np.ndarray, kl_type: str) -> dict[str, np.ndarray]:
    """The four per-token values, float64 [B, T] (masked positions hold 0 in mult_prob's exponent)."""
    with np.errstate(over="ignore", invalid="ignore"):
        mix = np.log(0.5 * np.exp(prev) + 0.5 * np.exp(gen))
        js = 0.5 * (np.exp(prev - mix) - (prev - mix) - 1) + 0.5 * (np.exp(gen - mix) - (gen - mix) - 1)
        return {"token_mult_prob_error": np.exp(np.abs(gen - prev) * m),
                "gen_kl_error": calculate_kl(gen, prev, kl_type), "policy_kl_error": calculate_kl(prev, gen, kl_type),
                "js_divergence_error": js}


def global_batches(b: StepBatch, s: Settings) -> tuple[np.ndarray | None, int, str | None]:
    """(global batch of each row [B], number of global batches, why not) for this step."""
    if s.train_global_batch_size is None:
        return np.zeros(len(b.seq), np.int64), 1, None
    gbs = int(s.train_global_batch_size)
    base = np.int64(b.step) << SEQ_SHIFT
    idx = b.seq - base
    if not (len(idx) and (idx >= 0).all() and (idx < (1 << SEQ_SHIFT)).all()):
        idx = np.arange(len(b.seq))  # the step's sequences in seq order
    if s.num_prompts_per_step is not None:
        size = int(s.num_prompts_per_step) * int(s.num_generations_per_prompt)
    elif len(idx) % gbs == 0 and int(idx.max(initial=-1)) + 1 == len(idx):
        size = len(idx)
    else:
        return None, 0, (f"the step holds {len(idx)} recorded samples, not a whole number of "
                         f"train_global_batch_size={gbs}: set num_prompts_per_step and num_generations_per_prompt")
    n_gb = size // gbs
    if n_gb < 1 or int(idx.max(initial=-1)) >= size:
        return None, 0, (f"the step's samples do not fit {size} // train_global_batch_size={gbs} global batches "
                         "(check num_prompts_per_step, num_generations_per_prompt, train_global_batch_size)")
    return idx // gbs, n_gb, None


def step_metrics(b: StepBatch, s: Settings):
    if not b.has_sampler:
        return {}, {n: NAN_SAMPLER if b.nan_sampler else NO_SAMPLER for n in NAMES}
    gb, n_gb, why = global_batches(b, s)
    if why is not None:
        return {}, {n: why for n in NAMES}
    gen = np.where(b.mask, b.logp_sampler, 0.0)
    prev = b.logp if s.force_on_policy_ratio else b.logp_old
    values = per_token(prev, gen, b.mask, s.reference_policy_kl_type)
    out = {}
    for name, x in values.items():
        # samples NeMo drops (past n_gb * gbs) are in no global batch; an empty global batch adds 0/(0+eps)
        means = [masked_mean(x, b.mask & (gb == g)[:, None], eps=EPS) for g in range(n_gb)]
        out[name] = float(np.sum(means) / n_gb)
    return out, {}


def metric_names(s: Settings) -> list[str]:
    return list(NAMES)
