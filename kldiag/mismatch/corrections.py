"""The 2026 corrections the what-if replays (kldiag.mismatch.whatif): which tokens or sequences each rejects.

Every function takes the tokens of one replay (float64 [n]: log pi_theta `logp`, the behaviour policy's `logp_b`,
log r = logp - logp_b, the advantage; `sidx` each token's sequence index of k, `stidx` its step index) and
returns what it rejects. None of them reweights the tokens it keeps.

  dppo_tv     DPPO Binary-TV (arXiv 2602.04879 eq. 13): a token whose probability moved past the trust region in
              the direction its advantage pushes it, A > 0 and pi - b > delta_high, or A < 0 and b - pi > delta_low.
              SkyRL 0.3.0 skyrl/backends/skyrl_train/utils/ppo_utils.py `dppo_policy_loss` (DPPOConfig defaults
              0.2 / 0.2; b = the rollout policy mu); verl 0.9.1 verl/trainer/ppo/core_algos.py
              `compute_policy_loss_dppo_tv` (b = pi_old; clip_ratio_low/high as the deltas).
  dppo_kl     DPPO Binary-KL (eq. 14): the binary KL b log(b/pi) + (1-b) log((1-b)/(1-pi)) (1e-8 added inside the
              second log, as both frameworks do) past delta in that direction (A > 0 and pi > b, or A < 0 and
              pi < b); SkyRL recommends delta 0.05. Same files, `binary_kl` / `compute_policy_loss_dppo_kl`.
  m2po        M2PO (arXiv 2510.01161): per step, the tokens with the largest (log r)^2 are masked, largest first,
              until the mean (log r)^2 of the kept ones is at most tau (0.04).
  seq_error   NeMo-RL's sequence log-prob-error rejection: a sequence is dropped when mean_t exp|log r_t| exceeds
              the threshold (NVIDIA-NeMo/RL nemo_rl/algorithms/grpo.py `compute_and_apply_seq_logprob_error_masking`,
              `grpo.seq_logprob_error_threshold`; NeMo-RL configs gate at 2.0).
  any_token   SkyRL's outlier rejection: a sequence is dropped when any token's r lies outside [low, high]
              (SkyRL 0.3.0 skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py
              `compute_outlier_token_mask`, `outlier_token_is_threshold_low/high`, suggested 1e-4 and 100).

DENOMINATORS says how each framework normalises the loss after rejecting: "all" (rejected tokens stay in the
token-mean denominator: the kept tokens' gradient shrinks with the share rejected) or "kept" (the denominator counts
only what is kept: the gradient scale is preserved).
"""

from __future__ import annotations

import numpy as np

BINARY_KL_EPS = 1e-8  # inside log((1 - b) / (1 - pi)), as SkyRL 0.3.0 and verl 0.9.1 add it

# method -> (denominator, who normalises so, and where)
DENOMINATORS: dict[str, tuple[str, str]] = {
    "tis_token": ("all", "nothing rejected: the weights are capped, the token-mean keeps every token"),
    "tis_seq": ("all", "nothing rejected: the weights are capped, the token-mean keeps every token"),
    "icepop": ("all", "verl 0.9.1 rollout_corr: the rejection mask multiplies the loss, agg_loss over the response "
                      "mask"),
    "geo_rs": ("all", "verl 0.9.1 rollout_corr: the rejection mask multiplies the loss, agg_loss over the response "
                      "mask"),
    "seq_mask_tis": ("all", "NeMo-RL ClippedPGLossFn and OpenRLHF's PolicyLoss: the sequence mask multiplies the IS "
                            "weights; the loss's token mask is unchanged"),
    "opsm": ("all", "slime/TRL: the sequence mask multiplies the per-token loss; the token count is unchanged"),
    "dppo_tv": ("all", "verl 0.9.1 compute_policy_loss_dppo_tv: agg_loss over the response mask; SkyRL 0.3.0: "
                       "advantages pre-divided by the loss-mask token count"),
    "dppo_kl": ("all", "verl 0.9.1 compute_policy_loss_dppo_kl: agg_loss over the response mask; SkyRL 0.3.0: "
                       "advantages pre-divided by the loss-mask token count"),
    "m2po": ("all", "kldiag's assumption (no installable implementation): the mask multiplies the per-token loss"),
    "seq_error": ("kept", "NeMo-RL grpo.py: sample_mask set to 0, and the loss divides by the tokens of unmasked "
                          "samples"),
    "any_token": ("all", "SkyRL 0.3.0: loss_mask zeroed after the advantages were divided by the mini-batch's "
                         "loss-mask token count (apply_loss_reduction_to_advantages_minibatch)"),
}


def dppo_tv(logp: np.ndarray, logp_b: np.ndarray, adv: np.ndarray, low: float, high: float) -> np.ndarray:
    """[n] bool: tokens DPPO Binary-TV masks (module docstring)."""
    diff = np.exp(logp) - np.exp(logp_b)
    return ((adv > 0) & (diff > high)) | ((adv < 0) & (-diff > low))


def binary_kl(logp: np.ndarray, logp_b: np.ndarray) -> np.ndarray:
    """[n] KL(Bernoulli(b) || Bernoulli(pi)) of the sampled token's probability, with BINARY_KL_EPS."""
    p, b = np.exp(logp), np.exp(logp_b)
    with np.errstate(divide="ignore", invalid="ignore"):
        return b * (logp_b - logp) + (1.0 - b) * np.log((1.0 - b + BINARY_KL_EPS) / (1.0 - p + BINARY_KL_EPS))


def dppo_kl(logp: np.ndarray, logp_b: np.ndarray, adv: np.ndarray, low: float, high: float) -> np.ndarray:
    """[n] bool: tokens DPPO Binary-KL masks (module docstring)."""
    kl = binary_kl(logp, logp_b)
    p, b = np.exp(logp), np.exp(logp_b)  # the direction as the frameworks read it: on probabilities
    up, down = p > b, p < b
    return ((adv > 0) & up & (kl > high)) | ((adv < 0) & down & (kl > low))


def m2po(lr: np.ndarray, stidx: np.ndarray, tau: float) -> np.ndarray:
    """[n] bool: per step, the fewest tokens of largest (log r)^2 whose removal brings the kept tokens' mean
    (log r)^2 to tau or below (none when it already is)."""
    out = np.zeros(len(lr), bool)
    if not len(lr):  # no token in the loss with an advantage: nothing to mask
        return out
    m2 = lr * lr
    order = np.lexsort((-m2, stidx))  # by step, largest first
    starts = np.flatnonzero(np.r_[True, stidx[order][1:] != stidx[order][:-1]])
    for a, b in zip(starts, np.r_[starts[1:], len(lr)], strict=True):
        x = m2[order[a:b]]
        n = len(x)
        tail = np.cumsum(x[::-1])[::-1]  # tail[j]: sum of x[j:] (the kept ones once j are removed)
        ok = tail <= tau * (n - np.arange(n))
        j = int(np.argmax(ok)) if ok.any() else n
        out[order[a:a + j]] = True
    return out


def seq_error(lr: np.ndarray, sidx: np.ndarray, k: int, threshold: float) -> np.ndarray:
    """[k] bool: sequences whose mean exp|log r| exceeds `threshold`."""
    with np.errstate(over="ignore"):
        e = np.exp(np.minimum(np.abs(lr), 700.0))
    mean = np.bincount(sidx, weights=e, minlength=k) / np.maximum(np.bincount(sidx, minlength=k), 1)
    return mean > threshold


def any_token(lr: np.ndarray, sidx: np.ndarray, k: int, low: float, high: float) -> np.ndarray:
    """[k] bool: sequences with a token whose r lies outside [low, high]."""
    out_tok = (lr < np.log(low)) | (lr > np.log(high))
    return np.bincount(sidx, weights=out_tok, minlength=k) > 0
