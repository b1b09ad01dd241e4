"""SkyRL's train/rollout mismatch metrics, recomputed from the recorded tokens.

From skyrl 0.4.0 (PyPI wheel; `skyrl/train/trainer.py`, `skyrl/backends/skyrl_train/utils/
off_policy_correction_utils.py`, `skyrl/backends/skyrl_train/workers/worker_utils.py`):

- `policy/rollout_train_logprobs_abs_diff_{max,min,mean,std}` (trainer.py l. 1413-1436): |mu - pi_old| over the
  tokens with loss_mask > 0 of the step's whole training batch (pi_old: the trainer's forward pass;
  std: torch's unbiased std);
- `policy/loss_metrics/is_ratio_{mean,std,max,min}` (`compute_off_policy_correction` l. 307-312): per
  micro-batch, ratio = exp(clamp(pi_old - mu, -20, 20)); mean = its masked mean, std / max / min over the
  micro-batch's whole padded [B, T] tensor of ratio * loss_mask (padding counts as 0); reduced by
  `reduce_metrics` / `all_reduce_metrics` (worker_utils.py l. 77-135): `_max` / `_min` over every micro-batch,
  the others a mean of means (micro-batches of a mini-batch, DP ranks, then mini-batches and epochs), which
  equals the mean over the step's micro-batches when each mini-batch has as many per rank, as SkyRL's fixed
  sizes give. Logged only when an off-policy correction is on (`off_policy_correction.tis_ratio_type`,
  `sequence_mask_metric`, the outlier or token masks).
The micro-batch's padded width is the training batch's: kldiag's SkyRL hook records every padded position
(completion_mask True, mask = loss_mask), so each recorded loss call pads back to it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kldiag.crosswalk.batch import StepBatch, masked_mean

NAME = "skyrl"
NEEDS_ALL_ITERATIONS = True
DIFF = [f"policy/rollout_train_logprobs_abs_diff_{s}" for s in ("max", "min", "mean", "std")]
IS = [f"policy/loss_metrics/is_ratio_{s}" for s in ("mean", "std", "max", "min")]
NO_SAMPLER = "the run has no logp_sampler (SkyRL's rollout_logprobs: generator.sampling_params.logprobs)"
OFF = ("no off-policy correction is on (off_policy_correction.tis_ratio_type, sequence_mask_metric, the outlier or "
       "token masks): SkyRL logs is_ratio_* only with one")


@dataclass(frozen=True)
class Settings:
    """Whether an off-policy correction is on (`trainer.algorithm.off_policy_correction.*`; any one logs is_ratio_*)."""

    off_policy_correction: bool = False


def step_metrics(b: StepBatch, s: Settings, calls: list[StepBatch] | None = None):
    """SkyRL's metrics of one step: `b` each sequence once (the driver's batch), `calls` the loss calls."""
    if not len(b.seq) or not np.isfinite(b.logp_sampler[b.mask]).all() or not b.mask.any():
        return {}, {n: NO_SAMPLER for n in DIFF + IS}
    diff = np.abs(b.logp_sampler - b.logp_old)[b.mask]
    out = {DIFF[0]: float(diff.max()), DIFF[1]: float(diff.min()), DIFF[2]: float(diff.mean()),
           DIFF[3]: float(diff.std(ddof=1)) if diff.size > 1 else float("nan")}
    if not s.off_policy_correction:
        return out, {n: OFF for n in IS}
    per_call = []
    for c in calls or [b]:
        ratio = np.exp(np.clip(c.logp_old - np.where(c.mask, c.logp_sampler, c.logp_old), -20.0, 20.0))
        masked = ratio * c.mask
        per_call.append((float(masked_mean(ratio, c.mask)), float(masked.std(ddof=1)) if masked.size > 1 else np.nan,
                         float(masked.max()), float(masked.min())))
    v = np.array(per_call)
    out.update({IS[0]: float(v[:, 0].mean()), IS[1]: float(v[:, 1].mean()), IS[2]: float(v[:, 2].max()),
                IS[3]: float(v[:, 3].min())})
    return out, {}


def metric_names(s: Settings) -> list[str]:
    return DIFF + IS
