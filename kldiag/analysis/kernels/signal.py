"""The compiled pass of the learning-signal rows (kldiag.analysis.reducers.signal): one loop over a batch's tokens.

One row per run of (step, group, seq) of the loss tokens with a finite advantage and log pi_theta: tokens, tokens
with |A| <= tol, max and min advantage, sum |A rho| (rho = exp(logp - logp_old), 1 where logp_old is null), tokens
with pi_ref, and per estimator of kldiag.estimators the sum of |gradient weight| (the formulas of
`signal.weights_abs`, which tests/test_diagnosis_signal.py holds equal to kldiag.estimators.weight), in ESTIMATOR
order: k1, k2, k3, k3_is, k3_clamped, kl_rev.

Rows come in runs of equal keys (recorder files are step- and sequence-ordered), so the sums of a run are a
branch-free loop over its slice (`run_sums`, which LLVM vectorises, as fused.chunk_sums: conditions combined with &,
values selected, never branched on) kept in locals and written once per run; a run without a loss token gives no
row. Its sums may be reordered (fastmath "reassoc", as fused.SUMS): they equal a row-order sum to rounding.
"""

from __future__ import annotations

import numpy as np

from kldiag.analysis.kernels import fastexp
from kldiag.analysis.kernels.token import SUMS, finite
from kldiag.jit import njit

ESTIMATOR_ORDER = ("k1", "k2", "k3", "k3_is", "k3_clamped", "kl_rev")
FLIP = 0x7FFF_FFFF_FFFF_FFFF
ORDER_NONE_MAX, ORDER_NONE_MIN = -(1 << 63), (1 << 63) - 1  # below and above every float's ordered bits


@njit(inline="always", **SUMS)
def ordered_bits(v):  # pragma: no cover
    """float64 bits as an int64 that orders like the float (NaN aside): negative floats' bits flipped."""
    b = np.float64(v).view(np.int64)
    return b ^ FLIP if b < 0 else b


@njit(inline="always", **SUMS)
def from_ordered(b):  # pragma: no cover
    return np.int64(b ^ FLIP if b < 0 else b).view(np.float64)


@njit(**SUMS)
def key_runs(step, group, seq):  # pragma: no cover
    """Start row of each run of equal (step, group, seq), and n last: int64 [runs + 1]."""
    n = len(step)
    out = np.zeros(n + 1, np.int64)
    if n == 0:
        return out
    k = 1
    for i in range(1, n):
        if (step[i] != step[i - 1]) | (group[i] != group[i - 1]) | (seq[i] != seq[i - 1]):
            out[k] = i
            k += 1
    out[k] = n
    return out[:k + 1]


@njit(inline="always", **SUMS)
def run_sums(mask, adv, ok_a, logp, ok_s, old, ok_o, ref, ok_r, tol, clamp):  # pragma: no cover
    """(tokens, |A| <= tol, with pi_ref; max A, min A as ordered_bits, sum |A rho|, the six sums |w|) of one run's
    slices. The maxima leave as bits: read back inside this function (from_ordered), they kept LLVM from
    vectorising its loop (5 ns a token against 23 here)."""
    n_tok = n_tol = n_ref = 0
    b_max, b_min = ORDER_NONE_MAX, ORDER_NONE_MIN
    s_pg = s_k1 = s_k2 = s_k3 = s_is = s_cl = s_rev = 0.0
    for i in range(len(mask)):
        a, lp = np.float64(adv[i]), np.float64(logp[i])
        use = mask[i] & ok_a[i] & ok_s[i] & finite(a) & finite(lp)
        n_tok += use
        n_tol += use & (abs(a) <= tol)
        b = ordered_bits(a)  # an integer maximum vectorises; a float one does not without fastmath "nnan"
        b_max = max(b_max, b if use else ORDER_NONE_MAX)
        b_min = min(b_min, b if use else ORDER_NONE_MIN)
        lo = np.float64(old[i]) if ok_o[i] else lp
        rho = fastexp.exp(min(lp - lo, 700.0))  # fastexp: inlined, within 1 ulp of numpy's
        pg = abs(a * rho)
        s_pg += pg if use & finite(pg) else 0.0
        rf = np.float64(ref[i])
        on = use & ok_r[i] & finite(rf)
        n_ref += on
        d = lp - rf
        e = fastexp.exp(-d)
        k3 = abs(fastexp.expm1(-d))
        w_is, w_rev = abs(rho * d), abs(d * e)
        w_cl = 0.0 if e + d - 1.0 > clamp else k3
        s_k1 += 1.0 if on else 0.0
        s_k2 += abs(d) if on & finite(d) else 0.0
        s_k3 += k3 if on & finite(k3) else 0.0
        s_is += w_is if on & finite(w_is) else 0.0
        s_cl += w_cl if on & finite(w_cl) else 0.0
        s_rev += w_rev if on & finite(w_rev) else 0.0
    return n_tok, n_tol, n_ref, b_max, b_min, s_pg, s_k1, s_k2, s_k3, s_is, s_cl, s_rev


@njit(inline="always", **SUMS)
def ride_sums(mask, adv, logp, ref, rho, w, tol, clamp):  # pragma: no cover
    """run_sums' tuple of a chunk of the analysis's compiled pass (kernels/ride.py) whose tokens in the loss all have
    a finite log pi_theta, log pi_ref and log-ratio to pi_old (its `normal` chunks), every log-prob present and
    the advantage with no null: from that pass's rho = exp(logp - logp_old) and w = |expm1(logp_ref - logp)| of
    each row (the exponentials it computed already), none computed here. So a loss token is counted when its
    advantage is finite, it has pi_ref, and its K3 weight is w itself; exp(-d) = 1 + expm1(-d) and K3's value
    expm1(-d) + d: equal to run_sums' exp and e + d - 1 to rounding (an absolute 2^-52 |d| at most)."""
    n_tok = n_tol = 0
    b_max, b_min = ORDER_NONE_MAX, ORDER_NONE_MIN
    s_pg = s_k2 = s_k3 = s_is = s_cl = s_rev = 0.0
    rho_max = fastexp.exp(700.0)  # run_sums' exp(min(x, 700)): fastexp is monotone
    for i in range(len(mask)):
        a, lp, rf = np.float64(adv[i]), np.float64(logp[i]), np.float64(ref[i])
        use = mask[i] & finite(a)
        n_tok += use
        n_tol += use & (abs(a) <= tol)
        b = ordered_bits(a)
        b_max = max(b_max, b if use else ORDER_NONE_MAX)
        b_min = min(b_min, b if use else ORDER_NONE_MIN)
        rv = min(rho[i], rho_max)
        pg = abs(a * rv)
        s_pg += pg if use & finite(pg) else 0.0
        d = lp - rf
        k3 = w[i]
        em1 = -k3 if d > 0.0 else k3  # expm1(-d): its sign is -d's
        w_is, w_rev = abs(rv * d), abs(d * (1.0 + em1))
        w_cl = 0.0 if em1 + d > clamp else k3
        s_k2 += abs(d) if use else 0.0
        s_k3 += k3 if use & finite(k3) else 0.0
        s_is += w_is if use & finite(w_is) else 0.0
        s_cl += w_cl if use & finite(w_cl) else 0.0
        s_rev += w_rev if use & finite(w_rev) else 0.0
    return n_tok, n_tol, n_tok, b_max, b_min, s_pg, np.float64(n_tok), s_k2, s_k3, s_is, s_cl, s_rev


@njit(inline="always", **SUMS)
def run_start():  # pragma: no cover
    """A run's sums before its first row, in run_sums' tuple."""
    return 0, 0, 0, ORDER_NONE_MAX, ORDER_NONE_MIN, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0


@njit(inline="always", **SUMS)
def run_add(a, b):  # pragma: no cover
    """Two of run_sums' tuples of one run added (its rows cut in chunks)."""
    return (a[0] + b[0], a[1] + b[1], a[2] + b[2], max(a[3], b[3]), min(a[4], b[4]), a[5] + b[5], a[6] + b[6],
            a[7] + b[7], a[8] + b[8], a[9] + b[9], a[10] + b[10], a[11] + b[11])


@njit(inline="always", **SUMS)
def run_row(t, cnt, val):  # pragma: no cover
    """Write run_sums' tuple t as signal_rows' counts [3] and values [9] of its run (zeros: no loss token)."""
    cnt[0], cnt[1], cnt[2] = t[0], t[1], t[2]
    if t[0] == 0:
        val[:] = 0.0
        return
    val[0], val[1], val[2] = from_ordered(t[3]), from_ordered(t[4]), t[5]
    val[3], val[4], val[5], val[6], val[7], val[8] = t[6], t[7], t[8], t[9], t[10], t[11]


@njit(inline="always", **SUMS)
def one_key(key, first):  # pragma: no cover
    """Whether every value of key (a run's slice) equals first."""
    same = True
    for i in range(len(key)):
        same &= key[i] == first
    return same


@njit(**SUMS)
def signal_rows(step, group, seq, mask, adv, ok_a, logp, ok_s, old, ok_o, ref, ok_r, tol, clamp):  # pragma: no cover
    """(keys [r, 3] int64, counts [r, 3] int64: tokens, |A| <= tol, with pi_ref; values [r, 9] float64: max A,
    min A, sum |A rho|, then the six estimators' sum |w|) over the r runs of (step, group, seq) with a loss token."""
    starts = key_runs(step, group, seq)
    runs = len(starts) - 1  # sized by sequences, not rows: a 1M-row batch is about 5k sequences
    keys = np.zeros((runs, 3), np.int64)
    cnt = np.zeros((runs, 3), np.int64)
    val = np.zeros((runs, 9))
    r = 0
    for k in range(runs):
        a, b = starts[k], starts[k + 1]
        t = run_sums(mask[a:b], adv[a:b], ok_a[a:b], logp[a:b], ok_s[a:b], old[a:b], ok_o[a:b], ref[a:b],
                     ok_r[a:b], tol, clamp)
        if t[0] == 0:
            continue
        keys[r, 0], keys[r, 1], keys[r, 2] = step[a], group[a], seq[a]
        run_row(t, cnt[r], val[r])
        r += 1
    return keys[:r], cnt[:r], val[:r]
