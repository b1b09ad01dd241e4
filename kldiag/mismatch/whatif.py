"""What-if replay: what a correction would have done to the recorded tokens, per step.

For each token of a step's batch (first reuse iteration, tokens in the loss), the importance ratio
r = pi_theta / b with b the behaviour policy under one of two conventions of "old":
`trainer` (b = pi_old, the trainer's recompute: slime's OPSM, PPO) or `sampler` (b = mu, the
engine's log-prob: TRL's OPSM, TIS/MIS on the training-inference mismatch). Methods:

  tis_token     w = min(r, C)                                   (token TIS, "Your Efficient RL Framework
                                                                 Secretly Brings You Off-Policy RL Training")
  tis_seq       w = min(R, C), R = prod r over the sequence     (sequence TIS)
  icepop        w = r if a <= r <= b else 0                     (MIS / IcePop, Ring-1T arXiv 2510.18855)
  geo_rs        drop the sequence when G = exp(mean log r) is outside [a, b]  (geometric-mean rejection)
  seq_mask_tis  drop the sequence outside [a, b] by G; kept tokens w = min(r, C)  (OpenRLHF/NeMo-RL)
  opsm          drop the sequence when A < 0 and mean(log b - log pi_theta) > delta (DeepSeek-V3.2 eq. 9)
  dppo_tv       DPPO Binary-TV: zero a token whose pi_theta - b left [-delta, delta] the way A pushes it
  dppo_kl       DPPO Binary-KL: the same on the binary KL of the sampled token's probability
  m2po          M2PO: per step, zero the tokens of largest (log r)^2 until mean (log r)^2 <= tau
  seq_error     drop the sequence when mean exp|log r| > threshold (NeMo-RL seq_logprob_error_threshold)
  any_token     drop the sequence when any token's r is outside [outlier_low, outlier_high] (SkyRL)
(the last five: kldiag.mismatch.corrections, with each one's source and its framework's loss denominator)

Per step: the fraction of tokens and of sequences masked or clipped, the effective sample size
(sum w)^2 / (n sum w^2) of the corrected weights, chi-square mean(w^2) - 1 (verl's chi2_token applied to
the corrected weights: negative once truncation pulls the mean below 1), and the gradient mass
removed from the policy-gradient term, sum |r A| - sum |w A| (split by the sign of A, also as a share
of that sign's sum |r A|). float64 inside; NaN log-probs leave their token out. After rejection each framework
normalises its token-mean loss by all the tokens or by the kept ones (corrections.DENOMINATORS): per step,
denominator_share = D / n, and grad_scale = (sum |w A| / D) / (sum |r A| / n), the corrected policy-gradient weight
mass per token against the uncorrected one under that denominator.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from kldiag.jit import njit
from kldiag.mismatch import corrections as CR
from kldiag.mismatch.tokenset import TokenSet, unique_inverse

METHODS = ("tis_token", "tis_seq", "icepop", "geo_rs", "seq_mask_tis", "opsm",
           "dppo_tv", "dppo_kl", "m2po", "seq_error", "any_token")  # the last five: the 2026 corrections (DPPO, M2PO, NeMo-RL, SkyRL)
CONVENTIONS = ("trainer", "sampler")
SAFE = 700.0  # exp() stays finite in float64


@dataclass(frozen=True)
class WhatIf:
    """One correction and its thresholds (defaults: verl's rollout_is_threshold 2.0, IcePop's [0.5, 2],
    DeepSeek-V3.2's delta as slime's --opsm-delta 1e-4)."""

    method: str = "tis_token"
    convention: str = "sampler"
    cap: float = 2.0  # C
    low: float = 0.5  # a
    high: float = 2.0  # b
    delta: float = 1e-4
    tv_delta: float = 0.2  # DPPO Binary-TV's delta (SkyRL 0.3.0 DPPOConfig, both sides)
    kl_delta: float = 0.05  # DPPO Binary-KL's delta (SkyRL's recommendation for KL)
    tau: float = 0.04  # M2PO's second-moment bound
    error_threshold: float = 2.0  # NeMo-RL's seq_logprob_error_threshold
    outlier_low: float = 1e-4  # SkyRL's suggested outlier_token_is_threshold_low ...
    outlier_high: float = 100.0  # ... and _high


def log_ratio(ts: TokenSet, convention: str) -> np.ndarray:
    """log r = log pi_theta - log b, [N] (NaN where b is unknown)."""
    if convention not in CONVENTIONS:
        raise ValueError(f"convention={convention!r}: use trainer (pi_old) or sampler (mu)")
    b = ts.logp_old if convention == "trainer" else ts.logp_sampler
    return ts.logp - b


def _seq_index(step: np.ndarray, seq: np.ndarray) -> tuple[np.ndarray, int]:
    """Each token's sequence index (sequences ordered by step, then seq) and the number of sequences."""
    _, inv = unique_inverse(step * (1 << 40) + seq)  # a TokenSet is sorted by (step, seq): no sort
    return inv, int(inv.max(initial=-1)) + 1


def _seq_mean(x: np.ndarray, sidx: np.ndarray, k: int) -> np.ndarray:
    return np.bincount(sidx, weights=x, minlength=k) / np.maximum(np.bincount(sidx, minlength=k), 1)


def corrected_weights(lr: np.ndarray, adv: np.ndarray, sidx: np.ndarray, k: int, w: WhatIf,
                      logp: np.ndarray | None = None, stidx: np.ndarray | None = None):
    """(uncorrected weight r, corrected weight, token affected, sequence affected [k]) for tokens with
    finite lr, [n] each; r is the token ratio, or the sequence ratio R for tis_seq. DPPO needs `logp`
    (log pi_theta; the behaviour's is logp - lr), M2PO `stidx` (each token's step index)."""
    r = np.exp(np.clip(lr, -SAFE, SAFE))
    if w.method in ("dppo_tv", "dppo_kl", "m2po"):
        if w.method == "m2po":
            hit = CR.m2po(lr, np.zeros(len(lr), np.int64) if stidx is None else stidx, w.tau)
        else:
            fn, d = (CR.dppo_tv, w.tv_delta) if w.method == "dppo_tv" else (CR.dppo_kl, w.kl_delta)
            hit = fn(logp, logp - lr, adv, d, d)
        return r, np.where(hit, 0.0, r), hit, np.bincount(sidx, weights=hit, minlength=k) > 0
    if w.method in ("seq_error", "any_token"):
        drop = (CR.seq_error(lr, sidx, k, w.error_threshold) if w.method == "seq_error"
                else CR.any_token(lr, sidx, k, w.outlier_low, w.outlier_high))
        return r, np.where(drop[sidx], 0.0, r), drop[sidx], drop
    if w.method == "tis_token":
        wt = np.minimum(r, w.cap)
        return r, wt, r > w.cap, np.bincount(sidx, weights=r > w.cap, minlength=k) > 0
    if w.method == "tis_seq":
        log_seq = np.bincount(sidx, weights=lr, minlength=k)
        seq_r = np.exp(np.clip(log_seq, -SAFE, SAFE))
        clipped = seq_r > w.cap
        return seq_r[sidx], np.minimum(seq_r, w.cap)[sidx], clipped[sidx], clipped  # the sequence's ratio
    if w.method == "icepop":
        out = (r < w.low) | (r > w.high)
        return r, np.where(out, 0.0, r), out, np.bincount(sidx, weights=out, minlength=k) > 0
    if w.method in ("geo_rs", "seq_mask_tis"):
        g = np.exp(np.clip(_seq_mean(lr, sidx, k), -SAFE, SAFE))
        drop = (g < w.low) | (g > w.high)
        kept = np.minimum(r, w.cap) if w.method == "seq_mask_tis" else r
        affected = drop[sidx] | ((r > w.cap) if w.method == "seq_mask_tis" else False)
        return r, np.where(drop[sidx], 0.0, kept), affected, drop
    if w.method == "opsm":
        neg = np.bincount(sidx, weights=adv < 0, minlength=k) > 0
        drop = neg & (_seq_mean(-lr, sidx, k) > w.delta)
        return r, np.where(drop[sidx], 0.0, r), drop[sidx], drop
    raise ValueError(f"method={w.method!r}: use one of {', '.join(METHODS)}")


COLUMNS = ("step", "tokens", "sequences", "token_frac", "seq_frac", "ess", "chi2", "mass_removed_pos",
           "mass_removed_neg", "mass_removed_pos_share", "mass_removed_neg_share", "denominator_share", "grad_scale")


def replay(ts: TokenSet, w: WhatIf = WhatIf()) -> pa.Table:
    """Per step (COLUMNS): what correction `w` does to the recorded tokens in the loss."""
    lr = log_ratio(ts, w.convention)
    keep = ts.mask & np.isfinite(lr) & np.isfinite(ts.advantage)
    step, lr, adv = ts.step[keep], lr[keep], ts.advantage[keep]  # only the columns it reads
    sidx, k = _seq_index(step, ts.seq[keep])
    steps, stidx = unique_inverse(step)
    r, wt, tok_hit, seq_hit = corrected_weights(lr, adv, sidx, k, w, ts.logp[keep], stidx)
    s = len(steps)
    seq_step = np.zeros(k, np.int64)
    seq_step[sidx] = stidx

    n, sw, sw2, hit, removed_pos, removed_neg, full_pos, full_neg = _step_sums(
        stidx, s, r, wt, np.asarray(tok_hit, np.float64), adv).T
    nseq = np.bincount(seq_step, minlength=s).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        cols = {
            "step": steps, "tokens": n.astype(np.int64), "sequences": nseq.astype(np.int64),
            "token_frac": hit / n, "seq_frac": np.bincount(seq_step, weights=seq_hit, minlength=s) / nseq,
            "ess": sw**2 / (n * sw2), "chi2": sw2 / n - 1.0,
            "mass_removed_pos": removed_pos, "mass_removed_neg": removed_neg,
            "mass_removed_pos_share": removed_pos / full_pos, "mass_removed_neg_share": removed_neg / full_neg,
        }
        cols.update(_denominator(w.method, n, np.bincount(stidx, weights=wt != 0, minlength=s),
                                 full_pos + full_neg, removed_pos + removed_neg))
    return pa.table({c: np.ascontiguousarray(cols[c]) for c in COLUMNS})


def _denominator(method: str, n: np.ndarray, kept: np.ndarray, full: np.ndarray, removed: np.ndarray) -> dict:
    """denominator_share D / n and grad_scale (sum |w A| / D) / (sum |r A| / n) per step (module docstring)."""
    d = kept if CR.DENOMINATORS.get(method, ("all",))[0] == "kept" else n
    with np.errstate(invalid="ignore", divide="ignore"):
        return {"denominator_share": d / n, "grad_scale": ((full - removed) / d) / (full / n)}


@njit(nogil=True, cache=True)
def _step_sums(stidx, s, r, wt, hit, adv):  # pragma: no cover - compiled
    """[s, 8] per step: tokens, sum w, sum w^2, tokens hit, |r A| - |w A| for A > 0 and A < 0, |r A| for
    A > 0 and A < 0; each summed over the step's tokens in index order (np.bincount's order: its sums)."""
    out = np.zeros((s, 8))
    for i in range(len(stidx)):
        g, w, a = stidx[i], wt[i], adv[i]
        full, kept = abs(r[i] * a), abs(w * a)
        out[g, 0] += 1.0
        out[g, 1] += w
        out[g, 2] += w * w
        out[g, 3] += hit[i]
        out[g, 4] += full - kept if a > 0 else 0.0
        out[g, 5] += full - kept if a < 0 else 0.0
        out[g, 6] += full if a > 0 else 0.0
        out[g, 7] += full if a < 0 else 0.0
    return out


def sweep(ts: TokenSet, base: WhatIf, name: str, values) -> pa.Table:
    """Run-level totals of `replay` as one threshold (`name`: cap, low, high or delta) varies."""
    from dataclasses import replace

    rows = []
    for v in values:
        t = replay(ts, replace(base, **{name: float(v)}))
        n, nseq = np.sum(t.column("tokens").to_numpy()), np.sum(t.column("sequences").to_numpy())
        tf, sf = t.column("token_frac").to_numpy(), t.column("seq_frac").to_numpy()
        rows.append({name: float(v), "token_frac": float(np.nansum(tf * t.column("tokens").to_numpy()) / max(n, 1)),
                     "seq_frac": float(np.nansum(sf * t.column("sequences").to_numpy()) / max(nseq, 1)),
                     "ess_mean": float(np.nanmean(t.column("ess").to_numpy())),
                     "mass_removed_pos_share": float(np.nanmean(t.column("mass_removed_pos_share").to_numpy())),
                     "mass_removed_neg_share": float(np.nanmean(t.column("mass_removed_neg_share").to_numpy()))})
    return pa.Table.from_pylist(rows)
