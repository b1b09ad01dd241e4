"""TRL GRPOTrainer's KL and vLLM importance-sampling metrics, recomputed from the recorded tokens.

From trl 1.16.0 `trl/trainer/grpo_trainer.py`:
- `kl` (`_compute_loss`): per loss call, the masked mean of per_token_kl = exp(r - s) - (r - s) - 1, times
  coef_1 = exp(s - o) with `use_bias_correction_kl` (per token, or exp of the sequence's masked mean log
  ratio when `importance_sampling_level="sequence"`); the logged value is the mean over the step's loss
  calls (kldiag's (step, micro) groups, every reuse iteration).
- `sampling/sampling_logp_difference/{mean,max}` and `sampling/importance_sampling_ratio/{min,mean,max}`
  (`_generate_and_score_completions`): delta = |old - sampler| over the completion mask; the ratio
  exp(old - sampler) per token (`token_*` modes) or exp(sum over the sequence) (`sequence_*`), clipped
  (`*_truncate`) or zeroed outside [clip_min, clip_max] (`*_mask`). TRL computes these only with
  `use_vllm` and `vllm_importance_sampling_correction`; kldiag computes them whenever logp_sampler exists,
  over the step's sequences (TRL: per generation batch, averaged over the logging window).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kldiag.crosswalk.batch import StepBatch, masked_mean

NAME = "trl"
MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
NAMES = ["kl", "sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
         "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
         "sampling/importance_sampling_ratio/max"]
NO_SAMPLER = ("the run has no logp_sampler (vLLM's sampling log-probs): TRL logs sampling/* only with "
              "use_vllm=True and vllm_importance_sampling_correction=True")
NO_REF = "the run has no logp_ref: TRL logs kl only when beta > 0"
SEVERAL_GENERATIONS = (
    "this run makes up to {n} generation calls per logged step (gradient_accumulation_steps {g} > steps_per_generation "
    "{s} x num_iterations {i}, grpo_trainer.py _prepare_inputs): TRL logs the mean of each call's sampling/* "
    "value, which kldiag does not reproduce; train with steps_per_generation = gradient_accumulation_steps / "
    "num_iterations for one generation call per step")
NEEDS_ALL_ITERATIONS = True  # `kl` averages every loss call of the step, reuse iterations included


@dataclass(frozen=True)
class Settings:
    """GRPOConfig fields (trl/trainer/grpo_config.py defaults); None: read from the run's manifest."""

    vllm_importance_sampling_mode: str = "sequence_mask"
    vllm_importance_sampling_clip_max: float | None = 3.0
    vllm_importance_sampling_clip_min: float | None = None
    use_bias_correction_kl: bool | None = None
    importance_sampling_level: str | None = None
    gradient_accumulation_steps: int | None = None  # from the manifest (TRL hook): generation calls per step
    steps_per_generation: int | None = None
    num_iterations: int | None = None

    def __post_init__(self) -> None:
        lo, hi = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        checks = [(self.vllm_importance_sampling_mode in MODES,
                   f"vllm_importance_sampling_mode must be one of {', '.join(MODES)}"),
                  (lo is None or hi is None or lo < hi,
                   f"vllm_importance_sampling_clip_min ({lo}) must be less than "
                   f"vllm_importance_sampling_clip_max ({hi})"),
                  (not str(self.vllm_importance_sampling_mode).endswith("truncate") or lo is not None or hi is not None,
                   "a *_truncate vllm_importance_sampling_mode needs vllm_importance_sampling_clip_min or _clip_max"),
                  (self.importance_sampling_level in (None, "token", "sequence"),
                   "importance_sampling_level must be token or sequence")]
        for ok, why in checks:
            if not ok:
                raise ValueError(f"TRL refuses this configuration (GRPOConfig.__post_init__, GRPOTrainer): {why}")


def per_token_kl(s: np.ndarray, r: np.ndarray, o: np.ndarray, mask: np.ndarray, corrected: bool,
                 level: str) -> np.ndarray:
    """[B, T] TRL's per_token_kl (float64)."""
    with np.errstate(over="ignore", invalid="ignore"):
        kl = np.exp(r - s) - (r - s) - 1
        if corrected:
            lr = s - o
            if level == "sequence":
                lr = (np.where(mask, lr, 0.0).sum(-1) / np.maximum(mask.sum(-1), 1))[:, None]
            kl = kl * np.exp(lr)
    return kl


def kl_of_calls(calls: list[StepBatch], s: Settings) -> float | None:
    """Mean over loss calls of each call's masked mean of per_token_kl."""
    vals = []
    for b in calls:
        if not b.mask.any():
            continue
        kl = per_token_kl(b.logp, np.where(b.mask, b.logp_ref, 0.0), b.logp_old, b.mask,
                          bool(s.use_bias_correction_kl), s.importance_sampling_level or "token")
        vals.append(float(masked_mean(kl, b.mask)))
    return float(np.mean(vals)) if vals else None


def sampling_metrics(b: StepBatch, s: Settings) -> dict[str, float]:
    mode = s.vllm_importance_sampling_mode
    if mode not in MODES:
        raise ValueError(f"vllm_importance_sampling_mode={mode!r}: use one of {', '.join(MODES)}")
    old, smp = b.logp_old, b.logp_sampler
    delta = np.abs(old - smp)[b.mask & np.isfinite(smp)]
    diff = np.nan_to_num((old - np.where(b.mask, smp, 0.0)) * b.mask, nan=0.0)
    seq_level = mode.startswith("sequence")
    ratio = np.exp(diff.sum(-1, keepdims=True) if seq_level else diff)
    lo, hi = s.vllm_importance_sampling_clip_min, s.vllm_importance_sampling_clip_max
    if mode.endswith("truncate"):
        ratio = np.clip(ratio, lo if lo is not None else -np.inf, hi if hi is not None else np.inf)
    else:
        bad = (ratio < (lo if lo is not None else -math.inf)) | (ratio > (hi if hi is not None else math.inf))
        ratio = np.where(bad, 0.0, ratio)
    flat = ratio.ravel() if seq_level else ratio[b.mask]
    return {"sampling/sampling_logp_difference/mean": float(delta.mean()) if delta.size else 0.0,
            "sampling/sampling_logp_difference/max": float(delta.max()) if delta.size else 0.0,
            "sampling/importance_sampling_ratio/min": float(flat.min()) if flat.size else 0.0,
            "sampling/importance_sampling_ratio/mean": float(flat.mean()) if flat.size else 0.0,
            "sampling/importance_sampling_ratio/max": float(flat.max()) if flat.size else 0.0}


def step_metrics(b: StepBatch, s: Settings, calls: list[StepBatch] | None = None):
    """(metrics, {name: why null}); `calls`: the step's loss calls (every iteration) for `kl`."""
    out: dict[str, float | None] = {}
    why: dict[str, str] = {}
    calls = calls if calls is not None else [b]
    if any(c.has_ref for c in calls):
        out["kl"] = kl_of_calls([c for c in calls if c.has_ref], s)
    else:
        why["kl"] = NO_REF
    calls_per_step = generation_calls(s)
    if calls_per_step > 1:
        why.update(dict.fromkeys(NAMES[1:], SEVERAL_GENERATIONS.format(
            n=calls_per_step, g=s.gradient_accumulation_steps, s=s.steps_per_generation, i=s.num_iterations or 1)))
    elif b.mask.any() and np.isfinite(b.logp_sampler[b.mask]).any():  # TRL skips a token vLLM left NaN, not the step
        out.update(sampling_metrics(b, s))
    else:
        why.update({n: NO_SAMPLER for n in NAMES[1:]})
    return out, why


def generation_calls(s: Settings) -> int:
    """Generation calls in one optimizer step (at most): TRL generates every steps_per_generation x num_iterations
    micro-steps (grpo_trainer.py `_prepare_inputs`, `generate_every`); 1 when the manifest does not say."""
    if not s.gradient_accumulation_steps or not s.steps_per_generation:
        return 1
    every = int(s.steps_per_generation) * int(s.num_iterations or 1)
    return max(1, -(-int(s.gradient_accumulation_steps) // every))  # a step may hold a partial cycle


def metric_names(s: Settings) -> list[str]:
    return list(NAMES)
