"""The compiled kernel: one pass over a record batch gives every per-sequence and per-step sum.

Per-token maths is that of kldiag.estimators (DESIGN.md section 2), from d = logp_ref - logp
and x = logp - logp_old, each float32 input converted to float64 as it is read:

    k1 = -d    k2 = d^2 / 2    k3 = expm1(d) - d    weight_k3 = -expm1(d)
    rho = exp(x)    k3_is = rho * k3    weight_k3_is = rho * (-d)

`token` is the one place these are computed; tests/test_analysis_kernel.py checks it against
estimators.py (exactly, or within 1 ulp where LLVM's exp/expm1 rounds differently from
numpy's). A token is *valid for d* when d is finite and *valid for x* when x is finite (a
null logp_old means on-policy: x = 0). Invalid tokens hold 0 in every sum and are not
binned; sums keep finite summands only and count them (docs/metrics.md).

Rows are grouped by (step, seq) as runs of equal consecutive keys: recorder files are
step-ordered. Sums run per sequence, then add into their step, so a step's sum is the sum
of its sequences' sums. Functions are compiled once and cached on disk (numba cache=True)
and release the GIL, so the next batch decodes on another core meanwhile.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

JIT = dict(cache=True, nogil=True, error_model="numpy")

# Columns of the float and count outputs, per sequence and per step (partial names, stats.py).
SEQ_F = ("sum_k3", "sum_k3_is", "max_w", "max_w_is", "sum_adv", "sum_opsm", "sum_trl_x")
SEQ_I = ("n_tokens", "n_k3", "n_k3_is", "n_flagged", "n_nonfinite", "n_adv")
STEP_F = ("sum_k1", "sum_k2", "sum_w", "sum_w_is", "sum_w_flagged", "sum_rho", "sum_rho2", "sum_drift",
          "max_rho", "min_rho", "sum_mismatch", "sum_k3", "sum_k3_is", "max_w", "max_w_is")
STEP_I = ("n_d", "n_x", "n_w", "n_w_is", "n_rho", "n_clip", "n_mismatch", "n_theta", "n_blowup", "n_clamp",
          "n_nonfinite", "n_invalid", "n_flagged", "n_tokens", "n_k3", "n_k3_is")
BAD_NONFINITE, BAD_INVALID = 1, 2  # bits of the per-row code of bad log-probs


def exps(s, r, o, m, o_null) -> tuple[np.ndarray, ...]:
    """(d, expm1(d), x, exp(x), z, expm1(z)) float64 [n] with numpy's SIMD exp and expm1.

    d = r - s, x = s - o (0 without a logp_old column; a null logp_old is logp itself),
    z = o - m (o = s without a logp_old column; NaN without a sampler). Non-finite values
    are left for `token` to exclude. A scalar libm exp costs ~5x numpy's vector one here.
    """
    s64 = s.astype(np.float64)
    n = len(s64)
    o64 = s64 if len(o) != n else o.astype(np.float64)
    if len(o_null) == n:
        o64[o_null] = s64[o_null]
    with np.errstate(all="ignore"):
        d = r - s64 if len(r) == n else np.full(n, np.nan)
        x = s64 - o64 if len(o) == n else np.zeros(n)
        z = o64 - m if len(m) == n else np.zeros(0)
        return d, np.expm1(d), x, np.exp(x), z, np.expm1(z)


@njit(**JIT)
def token(d, em, x, rho):
    """(d, valid_d, x, valid_x, rho, k3, w, k3_is, w_is) of one token from `exps`' values.

    Invalid: d = 0, x = 0, rho = NaN, k3_is = w_is = 0. rho * k3 and rho * |d| are 0 * inf
    only at a valid token, where estimators.py gives +inf (the limit of the product).
    """
    valid_d = math.isfinite(d)
    if not valid_d:
        d, em = 0.0, 0.0
    valid_x = math.isfinite(x)
    if not valid_x:
        x, rho = 0.0, np.nan
    k3 = em - d
    w = abs(em)
    k3_is, w_is = 0.0, 0.0
    if valid_d and valid_x:
        k3_is = rho * k3
        if math.isnan(k3_is):
            k3_is = -np.inf if k3 == -np.inf else np.inf
        w_is = rho * abs(d)
        if math.isnan(w_is):
            w_is = np.inf
    return d, valid_d, x, valid_x, rho, k3, w, k3_is, w_is


@njit(**JIT)
def abs_bin(v, shift, lo, cut):
    """bins.BinTable (positive) for one value >= +0.0: searchsorted(edges, v, "right")."""
    cell = np.float64(v).view(np.int64) >> shift
    return lo[cell] + (1 if v >= cut[cell] else 0)


@njit(**JIT)
def d_bin(d, inv_step, offset, n_edges):
    """bins.d_bins for one value: exact arithmetic on uniform edges with a power-of-two step."""
    k = np.floor(d * inv_step)  # a float: math.floor returns an int64, which overflows
    k = min(max(k, -offset - 1.0), n_edges - 1.0 - offset)
    return int(k) + int(offset) + 1


@njit(**JIT)
def seq_starts(step, seq):
    """Start row of each run of equal (step, seq), and n as a last entry; int64 [n_seq + 1]."""
    n = len(step)
    out = np.empty(n + 1, np.int64)
    k = 0
    for i in range(n):
        if i == 0 or step[i] != step[i - 1] or seq[i] != seq[i - 1]:
            out[k] = i
            k += 1
    out[k] = n
    return out[:k + 1]


@njit(**JIT)
def step_of_seqs(step, starts):
    """Index of each sequence's step run, int64 [n_seq], and the number of step runs."""
    n_seq = len(starts) - 1
    out = np.empty(n_seq, np.int64)
    k = -1
    for j in range(n_seq):
        if j == 0 or step[starts[j]] != step[starts[j - 1]]:
            k += 1
        out[j] = k
    return out, k + 1


@njit(**JIT)
def fused_pass(starts, sidx, n_steps, s, o, m, o_null, mask, adv, bad, ex, params, abs_lo, abs_cut, abs_shift,
               n_abs, d_grid):
    """Every per-sequence and per-step partial of one batch, in one pass over its rows.

    starts: seq_starts; sidx: step_of_seqs. s, o, m, adv: float32 [n] logp, logp_old,
    logp_sampler, advantage, empty when the column is all null; o_null, bad: [n] or empty;
    ex: the arrays of `exps`. params: log(tau), weight_limit, clamp, 1 - clip_low,
    1 + clip_high. abs_*: a bins.BinTable of n_abs - 1 edges; d_grid: 1 / step, offset,
    number of d edges. Returns seq_f [n_seq, SEQ_F], seq_i [n_seq, SEQ_I], step_f, step_i,
    the four histograms [n_steps, bins], and |weight_k3| per row (NaN where
    not masked or not valid for d: the top-k candidates).
    """
    n, n_seq = len(s), len(starts) - 1
    has_o, has_m, has_adv = len(o) == n, len(m) == n, len(adv) == n
    ed, eem, ex_, erho, ez, eez = ex
    has_onull, has_bad = len(o_null) == n, len(bad) == n
    log_tau, limit, clamp, clip_lo, clip_hi = params[0], params[1], params[2], params[3], params[4]
    n_dbin = int(d_grid[2]) + 1
    seq_f = np.zeros((n_seq, len(SEQ_F)))
    seq_i = np.zeros((n_seq, len(SEQ_I)), np.int64)
    step_f = np.zeros((n_steps, len(STEP_F)))
    step_i = np.zeros((n_steps, len(STEP_I)), np.int64)
    for k in range(n_steps):
        for c in (8, 9, 13, 14):  # max_rho, min_rho, max_w, max_w_is: NaN = no value
            step_f[k, c] = np.nan
    h_d = np.zeros((n_steps, n_dbin), np.int64)
    h_w = np.zeros((n_steps, n_abs), np.int64)
    h_w_is = np.zeros((n_steps, n_abs), np.int64)
    h_rho = np.zeros((n_steps, n_abs), np.int64)
    wtop = np.empty(n)
    for j in range(n_seq):
        k = sidx[j]
        # per-sequence accumulators
        sum_k3 = sum_k3_is = sum_adv = sum_opsm = sum_x = 0.0
        max_w = max_w_is = np.nan
        n_tok = n_k3 = n_k3_is = n_flag = n_bad = n_adv = 0
        # per-step accumulators of this sequence
        sum_d = sum_d2 = sum_w = sum_w_is = sum_wf = sum_rho = sum_rho2 = sum_drift = sum_mm = 0.0
        max_rho = min_rho = np.nan
        n_d = n_x = n_w = n_w_is = n_rho = n_clip = n_mm = n_theta = n_blow = n_clamp = n_nf = n_inv = 0
        for i in range(starts[j], starts[j + 1]):
            code = bad[i] if has_bad else 0
            if code:
                n_bad += 1
                n_nf += code & 1
                n_inv += (code >> 1) & 1
            if has_adv:
                a = adv[i]
                if math.isfinite(a):
                    sum_adv += np.float64(a)
                    n_adv += 1
            if not mask[i]:
                wtop[i] = np.nan
                continue
            sv = np.float64(s[i])
            ov = np.float64(o[i]) if has_o else sv
            on = has_onull and o_null[i]
            if on:
                ov = sv
            d, valid_d, x, valid_x, rho, k3, w, k3_is, w_is = token(ed[i], eem[i], ex_[i], erho[i])
            n_tok += 1
            wtop[i] = w if valid_d else np.nan
            theta, blow, clamped = d > log_tau, w > limit, k3 > clamp
            flag = theta or blow or clamped or code != 0
            n_theta += theta
            n_blow += blow
            n_clamp += clamped
            n_flag += flag
            max_w, max_w_is = fmax(max_w, w), fmax(max_w_is, w_is)  # invalid tokens count as 0, as before
            if valid_d:
                n_d += 1
                sum_d += d
                sum_d2 += d * d
                h_d[k, d_bin(d, d_grid[0], d_grid[1], d_grid[2])] += 1
                h_w[k, abs_bin(w, abs_shift, abs_lo, abs_cut)] += 1
                if math.isfinite(k3):
                    sum_k3 += k3
                    n_k3 += 1
                if math.isfinite(w):
                    sum_w += w
                    n_w += 1
                    if flag:
                        sum_wf += w
            if valid_x:
                n_x += 1
                sum_x += x
                sum_drift += abs(x)
                h_rho[k, abs_bin(rho, abs_shift, abs_lo, abs_cut)] += 1
                if math.isfinite(rho):
                    sum_rho += rho
                    n_rho += 1
                    rho2 = rho * rho
                    if math.isfinite(rho2):
                        sum_rho2 += rho2
                max_rho, min_rho = fmax(max_rho, rho), fmin(min_rho, rho)
                if rho < clip_lo or rho > clip_hi:
                    n_clip += 1
                if valid_d:
                    h_w_is[k, abs_bin(w_is, abs_shift, abs_lo, abs_cut)] += 1
                    if math.isfinite(k3_is):
                        sum_k3_is += k3_is
                        n_k3_is += 1
                    if math.isfinite(w_is):
                        sum_w_is += w_is
                        n_w_is += 1
            base = ov if has_o else sv
            if has_m:
                mv = np.float64(m[i])
                y = (base - sv) if math.isnan(mv) else (mv - sv)
                z = ez[i]
                if math.isfinite(z):
                    kz = eez[i] - z
                    if math.isfinite(kz):
                        sum_mm += kz
                        n_mm += 1
            else:
                y = base - sv
            if math.isfinite(y):
                sum_opsm += y
        f = seq_f[j]
        f[0], f[1], f[2], f[3], f[4], f[5], f[6] = sum_k3, sum_k3_is, max_w, max_w_is, sum_adv, sum_opsm, sum_x
        c = seq_i[j]
        c[0], c[1], c[2], c[3], c[4], c[5] = n_tok, n_k3, n_k3_is, n_flag, n_bad, n_adv
        g = step_f[k]
        g[0] -= sum_d
        g[1] += 0.5 * sum_d2
        g[2] += sum_w
        g[3] += sum_w_is
        g[4] += sum_wf
        g[5] += sum_rho
        g[6] += sum_rho2
        g[7] += sum_drift
        g[8] = fmax(g[8], max_rho)
        g[9] = fmin(g[9], min_rho)
        g[10] += sum_mm
        g[11] += sum_k3
        g[12] += sum_k3_is
        g[13] = fmax(g[13], max_w)
        g[14] = fmax(g[14], max_w_is)
        h = step_i[k]
        for c_, v in enumerate((n_d, n_x, n_w, n_w_is, n_rho, n_clip, n_mm, n_theta, n_blow, n_clamp, n_nf, n_inv,
                                n_flag, n_tok, n_k3, n_k3_is)):
            h[c_] += v
    return seq_f, seq_i, step_f, step_i, h_d, h_w, h_w_is, h_rho, wtop


@njit(**JIT)
def fmax(a, b):
    """np.fmax: NaN only when both are NaN."""
    if math.isnan(a):
        return b
    return a if math.isnan(b) or a >= b else b


@njit(**JIT)
def fmin(a, b):
    if math.isnan(a):
        return b
    return a if math.isnan(b) or a <= b else b


@njit(**JIT)
def trl_pass(starts, s, r, o, o_null, mask):
    """Per-sequence sums over every row of kl * mask, kl * exp(x) * mask and x * mask, [n_seq, 3].

    TRL's formula with IEEE semantics (GRPOTrainer: kl = exp(r - s) - (r - s) - 1, x = s - o,
    0 where logp_old is null, r NaN where logp_ref is absent): a non-finite kl outside the
    mask still makes the sum NaN (0 * inf), as it does in the trainer.
    """
    n, n_seq = len(s), len(starts) - 1
    has_r, has_o, has_onull = len(r) == n, len(o) == n, len(o_null) == n
    out = np.zeros((n_seq, 3))
    for j in range(n_seq):
        a = b = c = 0.0
        for i in range(starts[j], starts[j + 1]):
            sv = np.float64(s[i])
            dd = (np.float64(r[i]) if has_r else np.nan) - sv
            x = 0.0
            if has_o and not (has_onull and o_null[i]):
                x = sv - np.float64(o[i])
            mf = 1.0 if mask[i] else 0.0
            kl = math.exp(dd) - dd - 1.0
            a += kl * mf
            b += kl * math.exp(x) * mf
            c += x * mf
        out[j, 0], out[j, 1], out[j, 2] = a, b, c
    return out
