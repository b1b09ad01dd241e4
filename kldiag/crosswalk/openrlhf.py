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

With `--algo.kl.use_loss` the actor also logs `kl` and `logprobs_diff` (ppo_actor.py `training_step` l. 321-335):
kl = aggregate_loss(compute_approx_kl(pi_theta, pi_ref, pi_old, estimator, unbiased_gradient), mask,
**loss_batch_info), the estimator's value clamped to +-10 (`openrlhf/models/utils.py` l. 96-113; with
`--algo.kl.unbiased_gradient` the forward value is the same, only the gradient becomes w * k1 with
w = pi_theta / pi_old clipped at 10, l. 115-128), summed over the micro-batch's tokens and divided by the
optimizer window's tokens (all micro-batches of `accumulated_gradient` consecutive calls of an epoch, every
DP rank) / gas, times dp_size (`openrlhf/utils/loss_utils.py` `_optimizer_step_loss_norm`);
logprobs_diff = masked_mean(pi_theta - pi_ref) per micro-batch. Both 0-d, token-weighted like vllm_kl.
The window needs the micro-batch's index within its epoch: the hook records micro = that index and
iteration = the epoch. With --train.dynamic_batch_enable the normaliser comes from the replay buffer's
dynamic batches, which kldiag does not record: null, with why.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from kldiag.crosswalk.batch import StepBatch, masked_mean, masked_sum

NAME = "openrlhf"
NAMES = ["vllm_kl", "is_filter_ratio"]
KL_NAMES = ["kl", "logprobs_diff"]
KL_OFF = ("kl_use_loss is off: OpenRLHF's actor logs kl and logprobs_diff only with --algo.kl.use_loss, where the "
          "run's logp_ref are its base_action_log_probs (in reward mode the KL is folded into the reward on the "
          "driver)")
NO_REF = "the run has no logp_ref (OpenRLHF's base_action_log_probs, on the actor with --algo.kl.use_loss only)"
DYNAMIC = ("--train.dynamic_batch_enable: the KL loss is normalised by the replay buffer's dynamic batches, which "
           "kldiag does not record")
KL_CLAMP = 10.0  # compute_approx_kl clamps every estimator's value (openrlhf/models/utils.py)
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
    kl_use_loss: bool = False  # --algo.kl.use_loss
    kl_estimator: str = "k1"  # --algo.kl.estimator k1 | k2 | k3
    kl_init_coef: float = 0.01  # --algo.kl.init_coef (0: OpenRLHF logs kl = 0)
    kl_unbiased_gradient: bool = False  # --algo.kl.unbiased_gradient (the logged value is the same)
    accumulated_gradient: int = 1  # the DeepSpeed strategy's gradient-accumulation steps (micro-batches per window)
    dynamic_batch_enable: bool = False  # --train.dynamic_batch_enable

    def __post_init__(self) -> None:
        object.__setattr__(self, "is_correction_threshold", band(self.is_correction_threshold))
        checks = [(self.is_correction_level in ("off", "token", "seq"), "is_correction_level must be off/token/seq"),
                  (self.is_correction_mode in ("mask", "clip"), "is_correction_mode must be mask/clip"),
                  (self.is_correction_gating in ("ratio", "binary_kl", "tv"),
                   "is_correction_gating must be ratio/binary_kl/tv"),
                  (self.is_correction_mode != "clip" or (self.is_correction_level != "seq"
                                                         and self.is_correction_gating == "ratio"),
                   "is_correction_mode=clip requires is_correction_level=token and is_correction_gating=ratio"),
                  (self.kl_estimator in ("k1", "k2", "k3"), "kl_estimator must be k1/k2/k3"),
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


def kl_value(logp: np.ndarray, logp_ref: np.ndarray, estimator: str) -> np.ndarray:
    """compute_approx_kl's forward value (the same with unbiased_gradient): k1/k2/k3 of log(pi/pi_ref),
    k3's log ratio bounded below at -10, every value clamped to +-10."""
    lr = logp - logp_ref
    if estimator == "k1":
        value = lr
    elif estimator == "k2":
        value = lr ** 2 / 2.0
    else:
        k3_lr = np.maximum(lr, -10.0)
        value = np.exp(-k3_lr) - 1 + k3_lr
    return np.clip(value, -KL_CLAMP, KL_CLAMP)


def kl_step_metrics(calls: list[StepBatch], s: Settings) -> tuple[dict, dict]:
    """(kl, logprobs_diff) of the step: each call's 0-d figures, token-weighted (module doc)."""
    if not s.kl_use_loss:
        return {}, {n: KL_OFF for n in KL_NAMES}
    if s.dynamic_batch_enable:
        return {}, {n: DYNAMIC for n in KL_NAMES}
    calls = [c for c in calls if len(c.seq)]
    if not calls or not all(c.has_ref for c in calls if c.mask.any()):
        return {}, {n: NO_REF for n in KL_NAMES}
    tokens = np.array([c.mask.sum() for c in calls], np.float64)
    if (tokens == 0).any():
        return {}, {n: EMPTY_MICRO for n in KL_NAMES}
    if s.kl_init_coef <= 0:  # training_step logs zeros (l. 327-329)
        return {"kl": 0.0, "logprobs_diff": 0.0}, {}
    gas = max(int(s.accumulated_gradient), 1)
    keys = [(int(c.iteration[0]), int(c.micro[0])) for c in calls]
    window = [(it, micro // gas) for it, micro in keys]
    dp = max(sum(k == key for k in keys) for key in keys)  # calls with the same (epoch, micro): one per DP rank
    window_tokens = {w: sum(n for w2, n in zip(window, tokens) if w2 == w) for w in set(window)}
    kl_sum = np.array([masked_sum(kl_value(c.logp, c.logp_ref, s.kl_estimator), c.mask) for c in calls])
    kl = kl_sum / (np.array([window_tokens[w] for w in window]) / gas) * dp
    diff = np.array([masked_mean(c.logp - c.logp_ref, c.mask) for c in calls])
    weighted = (lambda x: float((x * tokens).sum() / tokens.sum()))
    return {"kl": weighted(kl), "logprobs_diff": weighted(diff)}, {}


def step_metrics(b: StepBatch, s: Settings, calls: list[StepBatch] | None = None):
    """`calls`: the step's micro-batches (every epoch and rank); None: the step's batch as one."""
    kl, kl_why = kl_step_metrics(calls or [b], s)
    values, why = is_step_metrics(b, s, calls)
    return {**values, **kl}, {**why, **kl_why}


def is_step_metrics(b: StepBatch, s: Settings, calls: list[StepBatch] | None = None):
    """vllm_kl and is_filter_ratio of the step (module doc)."""
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
    return [*NAMES, *KL_NAMES]
