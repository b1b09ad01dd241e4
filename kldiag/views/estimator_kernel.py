"""The Estimators page's per-token pass compiled (numba, float64 inside): one loop over a record batch.

It gives, from the same float64 values, what numpy gives from `views.pages.derive`'s per-token columns
(tests/test_estimator_kernel.py keeps that numpy pass as its reference): per compared estimator (k1, k2,
k3, k3_is, k3_clamped) the sum and non-finite count of its value, the sum, flagged sum, maximum and
histogram of its |gradient weight|; the flag counts; K3's weight per token in the loss (for the token
sample); and per run of equal (step, seq) rows the sequence's advantage and its sum of log mu - s.
The per-token maths are kldiag.estimators' (Schulman 2020's k1, k2, k3; DeepSeek-V3.2 eq. 7 and 9 for
k3_is and its weight), with its convention that a 0 * inf product of non-NaN factors is +-inf, never
NaN. Counts, maxima and histograms equal numpy's exactly; sums are taken in row order, so they differ
from numpy's pairwise sums by rounding only (tests/test_estimator_kernel.py).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from kldiag.analysis import fastexp
from kldiag.analysis.fused import abs_bin

JIT = dict(cache=True, nogil=True, error_model="numpy")
CHUNK = 256  # rows whose exponentials are computed in one vectorised loop
N_EST = 5  # COMPARED's order: k1, k2, k3, k3_is, k3_clamped
# Per-estimator float sums (rows of `fsum`) and counts (rows of `icount`).
F_VALUE, F_WABS, F_WFLAG, F_WMAX = range(4)
I_NONFINITE = 0
# Scalars (`scal`): tokens, flagged, clamp_saturated as counts; k3_weight_lost as a float.
S_TOKENS, S_FLAGGED, S_CLAMP = range(3)


@njit(inline="always", **JIT)
def product(a, b):  # pragma: no cover - compiled
    """a * b, with estimators._nan_to_inf_product's rule: NaN from non-NaN factors (0 * inf) is +-inf."""
    out = a * b
    if out != out and a == a and b == b:
        sa = (1.0 if a > 0 else -1.0) if np.isinf(a) else 1.0
        sb = (1.0 if b > 0 else -1.0) if np.isinf(b) else 1.0
        return sa * sb * np.inf
    return out


@njit(inline="always", **JIT)
def bad(x, present):  # pragma: no cover - compiled
    """(non-finite, invalid) of one present log-prob as views.derive tests it: x > 0 counts +inf too."""
    return present and not np.isfinite(x), present and x > 0


@njit(inline="always", **JIT)
def add_chunk(e, vals, wts, fl, cnt, fsum, icount, hist, abs_grid):  # pragma: no cover - compiled
    """Add estimator e's values and weights of a chunk's cnt tokens to its sums (finite summands only),
    accumulated in registers then added once: memory-held accumulators would chain every token."""
    v_sum, w_sum, w_flag, w_max, n_bad = 0.0, 0.0, 0.0, fsum[F_WMAX, e], 0
    for k in range(cnt):
        v = vals[e, k]
        if np.isfinite(v):
            v_sum += v
        else:
            n_bad += 1
        w = abs(wts[e, k])
        if np.isfinite(w):
            w_sum += w
            if fl[k]:
                w_flag += w
        if w == w:
            if w > w_max:
                w_max = w
            hist[e, abs_bin(w, abs_grid[0], abs_grid[1], abs_grid[2])] += 1
    fsum[F_VALUE, e] += v_sum
    fsum[F_WABS, e] += w_sum
    fsum[F_WFLAG, e] += w_flag
    fsum[F_WMAX, e] = w_max
    icount[I_NONFINITE, e] += n_bad


@njit(inline="always", **JIT)
def put(c, sv, rv, d, em, rho, clamp, vals, wts):  # pragma: no cover - compiled
    """One token's value and weight per estimator (COMPARED's order) into column c of vals, wts [N_EST, CHUNK]:
    k1 = s - r (weight 1), k2 = d^2 / 2 (s - r), k3 = expm1(d) - d (-expm1(d)), k3_is = rho k3 (rho (s - r)),
    k3_clamped = min(k3, clamp) (K3's weight, 0 once k3 > clamp)."""
    k3 = np.inf if d == np.inf else em - d  # expm1(+inf) - inf is NaN; the limit is +inf
    vals[0, c], wts[0, c] = sv - rv, 1.0
    vals[1, c], wts[1, c] = 0.5 * (d * d), sv - rv
    vals[2, c], wts[2, c] = k3, -em
    vals[3, c], wts[3, c] = product(rho, k3), product(rho, sv - rv)
    vals[4, c] = k3 if (k3 != k3 or k3 < clamp) else clamp  # np.minimum: NaN stays NaN
    wts[4, c] = 0.0 if k3 > clamp else -em


@njit(inline="always", **JIT)
def exps(s, o, r, o_null, i0, i1, d, em, rho):  # pragma: no cover - compiled
    """d = r - s, expm1(d) and rho = exp(s - o) of rows i0:i1 into d, em, rho [0:i1 - i0]: a branch-free
    loop that LLVM vectorises (fastexp: within 2 ulp of numpy, NaN and +-inf as numpy's)."""
    for k in range(i1 - i0):
        sv = np.float64(s[i0 + k])
        ov = sv if o_null[i0 + k] else np.float64(o[i0 + k])
        d[k] = np.float64(r[i0 + k]) - sv
        em[k] = fastexp.expm1(d[k])
        rho[k] = fastexp.exp(sv - ov)


@njit(**JIT)
def token_pass(s, o, r, m, s_null, o_null, r_null, m_null, mask, log_tau, limit, clamp, abs_grid,
               fsum, icount, hist, scal, w_k3, flagged_out, rows):  # pragma: no cover - compiled
    """One pass over a batch's rows [n] (log-probs as stored, NaN at nulls; null masks bool [n]).

    Tokens are the rows in the loss (mask) with a reference log-prob; an absent logp_old means
    on-policy (o = s). Adds into fsum [4, N_EST] (value sum, |weight| sum, flagged |weight| sum,
    |weight| max), icount [1, N_EST], hist [N_EST, len(ABS_EDGES) + 1]; writes K3's weight, the
    flagged bit and the row index of the j-th token to w_k3, flagged_out, rows [n]. Rows go in
    chunks of CHUNK: their exponentials (`exps`), each token's values and weights, then the sums
    (`add_chunk`). Returns k3_weight_lost; writes (tokens, flagged, clamp_saturated) to scal."""
    d_, em_, rho_ = np.empty(CHUNK), np.empty(CHUNK), np.empty(CHUNK)
    vals, wts, fl = np.empty((N_EST, CHUNK)), np.empty((N_EST, CHUNK)), np.empty(CHUNK, np.bool_)
    j = 0
    n_flagged = 0
    n_clamp = 0
    lost = 0.0
    for i0 in range(0, len(s), CHUNK):
        i1 = min(i0 + CHUNK, len(s))
        exps(s, o, r, o_null, i0, i1, d_, em_, rho_)
        j0 = j
        for i in range(i0, i1):
            if not mask[i] or r_null[i]:
                continue
            sv = np.float64(s[i])
            rv = np.float64(r[i])
            d, em, rho = d_[i - i0], em_[i - i0], rho_[i - i0]
            k3 = np.inf if d == np.inf else em - d
            wk3 = -em
            saturated = k3 > clamp
            nf_s, inv_s = bad(sv, not s_null[i])
            nf_r, inv_r = bad(rv, True)
            nf_o, inv_o = bad(np.float64(o[i]), not o_null[i])
            nf_m, inv_m = bad(np.float64(m[i]), not m_null[i])
            flagged = (d > log_tau or abs(wk3) > limit or saturated or nf_s or nf_r or nf_o or nf_m
                       or inv_s or inv_r or inv_o or inv_m)
            n_flagged += flagged
            if saturated:
                n_clamp += 1
                if np.isfinite(wk3):
                    lost += abs(wk3)
            put(j - j0, sv, rv, d, em, rho, clamp, vals, wts)
            fl[j - j0] = flagged
            w_k3[j] = wk3
            flagged_out[j] = flagged
            rows[j] = i
            j += 1
        for e in range(N_EST):
            add_chunk(e, vals, wts, fl, j - j0, fsum, icount, hist, abs_grid)
    scal[S_TOKENS] = j
    scal[S_FLAGGED] = n_flagged
    scal[S_CLAMP] = n_clamp
    return lost


@njit(**JIT)
def seq_runs(step, seq, advantage, s, o, m, o_null, m_null, mask, r_step, r_seq, r_adv, r_gap,
             r_n):  # pragma: no cover - compiled
    """Per run of equal consecutive (step, seq): the first non-NaN advantage (else NaN), the sum of
    non-NaN log mu - s over rows in the loss (mu the sampler's log-prob, else pi_old's, else s) and
    their count, as pandas' groupby first/sum give. Writes the runs' rows of r_*; returns their count."""
    k = -1
    for i in range(len(step)):
        if k < 0 or step[i] != r_step[k] or seq[i] != r_seq[k]:
            k += 1
            r_step[k] = step[i]
            r_seq[k] = seq[i]
            r_adv[k] = np.nan
            r_gap[k] = 0.0
            r_n[k] = 0
        a = np.float64(advantage[i])
        if r_adv[k] != r_adv[k] and a == a:
            r_adv[k] = a
        if mask[i]:
            sv = np.float64(s[i])
            mu = np.float64(m[i]) if not m_null[i] else (np.float64(o[i]) if not o_null[i] else sv)
            gap = mu - sv
            if gap == gap:
                r_gap[k] += gap
            r_n[k] += 1
    return k + 1
