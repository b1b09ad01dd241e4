"""slime's mismatch / TIS / KL metrics, recomputed from the recorded tokens.

From THUDM/slime@624b824a `slime/backends/megatron_utils/loss.py` (`policy_loss_function`, l. 960-1175;
`vanilla_tis_function` l. 884, `icepop_function` l. 908) and `slime/utils/ppo_utils.py` `compute_approx_kl`:
every metric is `sum_of_sample_mean`: per sample the masked mean, then the mean over the step's samples.
- `train_rollout_logprob_abs_diff`: |log_probs - rollout| with --use-rollout-logprobs, else |old - rollout|.
- `ois` = exp(-ppo_kl) = exp(log_probs - old_log_probs), old = rollout with --use-rollout-logprobs.
- `tis`, `tis_abs`, `tis_clipfrac`: tis = exp(old - rollout) (old: the trainer's recompute, batch
  ["log_probs"]), clipped to [tis_clip_low, tis_clip] (vanilla) or zeroed outside it (icepop); logged with
  --use-tis or --get-mismatch-metrics. With --use-rollout-logprobs (which slime forbids with --use-tis) the
  recompute exists only for --get-mismatch-metrics and the run holds the rollout as logp_old: null, with why.
- `kl_loss`: compute_approx_kl(log_probs, ref, kl_loss_type), times rho = exp(log_probs - old) with
  --use-unbiased-kl; low_var_kl clamped to +-10 after (kldiag.analysis.slime_kl.approx_kl).
log_probs is pi_theta at the step's first update (kldiag's logp).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kldiag.analysis.slime_kl import approx_kl
from kldiag.crosswalk.batch import StepBatch

NAME = "slime"
NAMES = ["train_rollout_logprob_abs_diff", "ois", "tis", "tis_abs", "tis_clipfrac", "kl_loss"]
NO_SAMPLER = "the run has no logp_sampler (slime's rollout_log_probs from SGLang)"
NO_REF = "the run has no logp_ref (slime logs kl_loss only with --use-kl-loss)"
TIS_NAMES = ("tis", "tis_abs", "tis_clipfrac")
NO_RECOMPUTE = ("with --use-rollout-logprobs slime computes TIS from the trainer's recomputed log-probs (made only "
                "for --get-mismatch-metrics), which the run does not hold: its logp_old is the rollout's log-probs")


@dataclass(frozen=True)
class Settings:
    """slime arguments (slime/utils/arguments.py defaults), dashes as underscores."""

    use_rollout_logprobs: bool = False
    tis_clip: float = 2.0
    tis_clip_low: float = 0.0
    tis_function: str = "vanilla"  # "vanilla" (vanilla_tis_function) or "icepop" (icepop_function)
    kl_loss_type: str = "k1"
    use_unbiased_kl: bool = False


def sample_mean(x: np.ndarray, mask: np.ndarray) -> float:
    """slime's sum_of_sample_mean over one step: mean over samples of sum(x*mask) / max(mask sum, 1)."""
    per = np.where(mask, x, 0.0).sum(-1) / np.maximum(mask.sum(-1), 1)
    return float(per.mean()) if len(per) else float("nan")


def step_metrics(b: StepBatch, s: Settings):
    out: dict[str, float | None] = {}
    why: dict[str, str] = {}
    if b.has_sampler:
        rollout = np.where(b.mask, b.logp_sampler, 0.0)
        old = rollout if s.use_rollout_logprobs else b.logp_old
        compare = b.logp if s.use_rollout_logprobs else b.logp_old
        with np.errstate(over="ignore"):
            tis = np.exp(b.logp_old - rollout)
            if s.tis_function == "icepop":
                w = np.where((tis >= s.tis_clip_low) & (tis <= s.tis_clip), tis, 0.0)
            elif s.tis_function == "vanilla":
                w = np.clip(tis, s.tis_clip_low, s.tis_clip)
            else:
                raise ValueError(f"tis_function={s.tis_function!r}: use vanilla or icepop")
            out.update({"train_rollout_logprob_abs_diff": sample_mean(np.abs(compare - rollout), b.mask),
                        "ois": sample_mean(np.exp(b.logp - old), b.mask)})
            if s.use_rollout_logprobs:  # loss.py l. 1008: TIS reads batch["log_probs"], not the rollout
                why.update(dict.fromkeys(TIS_NAMES, NO_RECOMPUTE))
            else:
                out.update({"tis": sample_mean(tis, b.mask), "tis_abs": sample_mean(np.abs(tis - 1), b.mask),
                            "tis_clipfrac": sample_mean((w != tis).astype(float), b.mask)})
    else:
        why.update({n: NO_SAMPLER for n in NAMES[:-1]})
    if b.has_ref:
        old = np.where(b.mask, b.logp_sampler, 0.0) if s.use_rollout_logprobs and b.has_sampler else b.logp_old
        rho = np.exp(b.logp - old) if s.use_unbiased_kl else None
        out["kl_loss"] = sample_mean(approx_kl(b.logp, np.where(b.mask, b.logp_ref, 0.0), s.kl_loss_type, rho),
                                     b.mask)
    else:
        why["kl_loss"] = NO_REF
    return out, why


def metric_names(s: Settings) -> list[str]:
    return list(NAMES)
