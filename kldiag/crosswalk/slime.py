"""slime's mismatch / TIS / KL metrics, recomputed from the recorded tokens.

From THUDM/slime@624b824a `slime/backends/megatron_utils/loss.py` (`policy_loss_function`, l. 934-1173;
`vanilla_tis_function` l. 884, `icepop_function` l. 908), `slime/utils/ppo_utils.py` (`compute_approx_kl`,
`compute_gspo_kl`), `slime/backends/megatron_utils/cp_utils.py` `get_sum_of_sample_mean` and
`slime/observability/train_metric_utils.py` `reduce_train_step_metrics`. The step reduction:
- default: `sum_of_sample_mean`, per sample sum(x * mask) / max(its mask sum, 1), summed over the step's
  micro-batches and DP ranks, divided by the step's sample count (`step_global_batch_size`);
- `--calculate-per-token-loss`: `sum_of_token`, sum(x * mask) over the step divided by the sum over
  samples of max(mask sum, 1) (loss_function's `num_tokens`: a sample with no loss token counts 1).
Per token:
- `train_rollout_logprob_abs_diff`: |log_probs - rollout| with --use-rollout-logprobs, else |old - rollout|.
- `ois` = exp(-ppo_kl): ppo_kl = old - log_probs per token, or with `--advantage-estimator gspo` the
  sample's masked mean of old - log_probs (compute_gspo_kl) on each of its tokens; old = rollout with
  --use-rollout-logprobs.
- `tis`, `tis_abs`, `tis_clipfrac`: tis = exp(old - rollout) (old: the trainer's recompute, batch
  ["log_probs"]), clipped to [tis_clip_low, tis_clip] (vanilla) or zeroed outside it (icepop); logged with
  --use-tis or --get-mismatch-metrics. With --use-rollout-logprobs (which slime forbids with --use-tis) the
  recompute exists only for --get-mismatch-metrics and the run holds the rollout as logp_old: null, with why.
- `kl_loss`: compute_approx_kl(log_probs, ref, kl_loss_type), times rho = exp(log_probs - old) with
  --use-unbiased-kl; low_var_kl clamped to +-10 after (kldiag.analysis.core.slime_kl.approx_kl).
log_probs is pi_theta at the step's first update (kldiag's logp). Not reproduced: samples that share a
`rollout_id` (a custom rollout fanning one rollout out into several samples), whose `rollout_mask_sums`
denominator is the rollout's total (slime/ray/rollout.py l. 690-700); kldiag records no rollout id.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kldiag.analysis.core.slime_kl import approx_kl
from kldiag.crosswalk.batch import StepBatch

NAME = "slime"
NAMES = ["train_rollout_logprob_abs_diff", "ois", "tis", "tis_abs", "tis_clipfrac", "kl_loss"]
NO_SAMPLER = "the run has no logp_sampler (slime's rollout_log_probs from SGLang)"
NO_REF = "the run has no logp_ref (slime logs kl_loss only with --use-kl-loss)"
NAN_SAMPLER = "a rollout log-prob of this step is NaN: slime's sample means over it are NaN"
TIS_NAMES = ("tis", "tis_abs", "tis_clipfrac")
NO_RECOMPUTE = ("with --use-rollout-logprobs slime computes TIS from the trainer's recomputed log-probs (made only "
                "for --get-mismatch-metrics), which the run does not hold: its logp_old is the rollout's log-probs")
ESTIMATORS = ("grpo", "gspo", "cispo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo")
KL_TYPES = ("k1", "k2", "k3", "low_var_kl")


@dataclass(frozen=True)
class Settings:
    """slime arguments (slime/utils/arguments.py defaults), dashes as underscores; refused as
    slime's `slime_validate_args` / argparse choices refuse them."""

    use_rollout_logprobs: bool = False
    use_tis: bool = False
    tis_clip: float = 2.0
    tis_clip_low: float = 0.0
    tis_function: str = "vanilla"  # "vanilla" (vanilla_tis_function) or "icepop" (icepop_function)
    kl_loss_type: str = "k1"
    use_unbiased_kl: bool = False
    calculate_per_token_loss: bool = False
    advantage_estimator: str = "grpo"

    def __post_init__(self) -> None:
        checks = [(not (self.use_rollout_logprobs and self.use_tis),
                   "use_rollout_logprobs and use_tis cannot be set at the same time (drop use_tis, or "
                   "use_rollout_logprobs)"),
                  (self.advantage_estimator in ESTIMATORS,
                   f"advantage_estimator must be one of {', '.join(ESTIMATORS)}"),
                  (self.kl_loss_type in KL_TYPES, f"kl_loss_type must be one of {', '.join(KL_TYPES)}"),
                  (self.tis_function in ("vanilla", "icepop"), "tis_function must be vanilla or icepop")]
        for ok, why in checks:
            if not ok:
                raise ValueError(f"slime refuses this configuration (slime/utils/arguments.py): {why}")


def reducer(mask: np.ndarray, per_token: bool):
    """slime's step reduction of a per-token [B, T] value under `mask`, as a function x -> float.

    per_token False: mean over samples of sum(x*mask) / max(mask sum, 1) (sum_of_sample_mean / sample count);
    True: sum(x*mask) / sum over samples of max(mask sum, 1) (sum_of_token / num_tokens)."""
    n = mask.sum(-1)
    denom = np.maximum(n, 1).astype(np.float64)

    def reduce(x: np.ndarray) -> float:
        sums = np.where(mask, x, 0.0).sum(-1)
        if not len(sums):
            return float("nan")
        return float(sums.sum() / denom.sum()) if per_token else float((sums / denom).mean())

    return reduce


def ppo_kl(logp: np.ndarray, old: np.ndarray, mask: np.ndarray, estimator: str) -> np.ndarray:
    """[B, T] old - log_probs; with gspo each sample's masked mean of it on all its positions."""
    kl = old - logp
    if estimator != "gspo":
        return kl
    per = np.where(mask, kl, 0.0).sum(-1) / np.maximum(mask.sum(-1), 1)
    return np.broadcast_to(per[:, None], kl.shape)


def step_metrics(b: StepBatch, s: Settings):
    out: dict[str, float | None] = {}
    why: dict[str, str] = {}
    reduce = reducer(b.mask, s.calculate_per_token_loss)
    if b.has_sampler:
        rollout = np.where(b.mask, b.logp_sampler, 0.0)
        old = rollout if s.use_rollout_logprobs else b.logp_old
        compare = b.logp if s.use_rollout_logprobs else b.logp_old
        with np.errstate(over="ignore", invalid="ignore"):
            tis = np.exp(b.logp_old - rollout)
            if s.tis_function == "icepop":
                w = np.where((tis >= s.tis_clip_low) & (tis <= s.tis_clip), tis, 0.0)
            else:
                w = np.clip(tis, s.tis_clip_low, s.tis_clip)
            out.update({"train_rollout_logprob_abs_diff": reduce(np.abs(compare - rollout)),
                        "ois": reduce(np.exp(-ppo_kl(b.logp, old, b.mask, s.advantage_estimator)))})
            if s.use_rollout_logprobs:  # loss.py l. 1008: TIS reads batch["log_probs"], not the rollout
                why.update(dict.fromkeys(TIS_NAMES, NO_RECOMPUTE))
            else:
                out.update({"tis": reduce(tis), "tis_abs": reduce(np.abs(tis - 1)),
                            "tis_clipfrac": reduce((w != tis).astype(float))})
    else:
        why.update({n: NAN_SAMPLER if b.nan_sampler else NO_SAMPLER for n in NAMES[:-1]})
    if b.has_ref:
        old = np.where(b.mask, b.logp_sampler, 0.0) if s.use_rollout_logprobs and b.has_sampler else b.logp_old
        with np.errstate(over="ignore"):
            rho = np.exp(b.logp - old) if s.use_unbiased_kl else None
        out["kl_loss"] = reduce(approx_kl(b.logp, np.where(b.mask, b.logp_ref, 0.0), s.kl_loss_type, rho))
    else:
        why["kl_loss"] = NO_REF
    return out, why


def metric_names(s: Settings) -> list[str]:
    return list(NAMES)
