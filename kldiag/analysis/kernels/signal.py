"""The compiled pass of the learning-signal rows (kldiag.analysis.reducers.signal): one loop over a batch's tokens.

One row per run of (step, group, seq) of the loss tokens with a finite advantage and log pi_theta: tokens, tokens
with |A| <= tol, max and min advantage, sum |A rho| (rho = exp(logp - logp_old), 1 where logp_old is null), tokens
with pi_ref, and per estimator of kldiag.estimators the sum of |gradient weight| (the formulas of
`signal.weights_abs`, which tests/test_diagnosis_signal.py holds equal to kldiag.estimators.weight), in ESTIMATOR
order: k1, k2, k3, k3_is, k3_clamped, kl_rev.
"""

from __future__ import annotations

import numpy as np

from kldiag.analysis.kernels import fastexp
from kldiag.jit import njit

ESTIMATOR_ORDER = ("k1", "k2", "k3", "k3_is", "k3_clamped", "kl_rev")


@njit(nogil=True, cache=True)
def signal_rows(step, group, seq, mask, adv, ok_a, logp, ok_s, old, ok_o, ref, ok_r, tol, clamp):  # pragma: no cover
    """(keys [r, 3] int64, counts [r, 3] int64: tokens, |A| <= tol, with pi_ref; values [r, 9] float64: max A,
    min A, sum |A rho|, then the six estimators' sum |w|) over the r runs of (step, group, seq)."""
    n = len(step)
    runs = 1  # an upper bound of the rows: runs of equal keys over every row (the loss tokens' are no more)
    for i in range(1, n):
        runs += (step[i] != step[i - 1]) | (group[i] != group[i - 1]) | (seq[i] != seq[i - 1])
    keys = np.zeros((runs, 3), np.int64)  # sized by sequences, not rows: a 1M-row batch is about 5k sequences
    cnt = np.zeros((runs, 3), np.int64)
    val = np.zeros((runs, 9))
    r = -1
    for i in range(n):
        if not (mask[i] and ok_a[i] and ok_s[i]):
            continue
        a, lp = np.float64(adv[i]), np.float64(logp[i])
        if not (np.isfinite(a) and np.isfinite(lp)):
            continue
        if r < 0 or step[i] != keys[r, 0] or group[i] != keys[r, 1] or seq[i] != keys[r, 2]:
            r += 1
            keys[r, 0], keys[r, 1], keys[r, 2] = step[i], group[i], seq[i]
            val[r, 0], val[r, 1] = a, a
        cnt[r, 0] += 1
        if abs(a) <= tol:
            cnt[r, 1] += 1
        val[r, 0] = max(val[r, 0], a)
        val[r, 1] = min(val[r, 1], a)
        lo = np.float64(old[i]) if ok_o[i] else lp
        rho = fastexp.exp(min(lp - lo, 700.0))  # fastexp: inlined, within 1 ulp of numpy's
        pg = abs(a * rho)
        if np.isfinite(pg):
            val[r, 2] += pg
        if not ok_r[i]:
            continue
        rf = np.float64(ref[i])
        if not np.isfinite(rf):
            continue
        cnt[r, 2] += 1
        d = lp - rf
        e = fastexp.exp(-d)
        k3 = abs(fastexp.expm1(-d))
        w = (1.0, abs(d), k3, abs(rho * d), 0.0 if e + d - 1.0 > clamp else k3, abs(d * e))
        for j in range(6):
            if np.isfinite(w[j]):
                val[r, 3 + j] += w[j]
    return keys[:r + 1], cnt[:r + 1], val[:r + 1]
