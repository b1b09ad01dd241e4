"""The analysis's compiled pass with the Estimators page's per-token work riding in it.

`fused_pass_est` is fused.fused_pass with estimator_kernel.token_pass's outputs made in the same loop: the
estimator comparison needs the d = logp_ref - logp, x = logp - logp_old, expm1(d) and exp(x) of every token
that the analysis computes, and most of its sums are the analysis's (k1 = -d, k2 = d^2 / 2, k3 and k3_is,
K3's and K3_IS's |weight| and their histograms), so a dashboard's first pass reads each column once,
exponentiates once and adds only what the analysis lacks (|d|, k3_clamped, flagged shares, the kept sets).
It is a second compiled function, not a flag of the first: a bare `kldiag analyze` runs fused.fused_pass
unchanged, its loop no larger (partials.AnalysisReducer.carry, reduce.PartFold).

The two agree where every token in the loss has a finite d and x (and a reference log-prob). A chunk with
another token (NaN, +-inf, a null reference: findings, rare) runs estimator_kernel.chunk_sums on its rows,
which keeps the estimators' own conventions there (expm1 and exp of the raw values, not the analysis's
zeroed ones). So each partial equals its standalone pass's: the analysis's bit for bit (its loop body is
fused.chunk_sums'), the estimators' counts, maxima, histograms, kept tokens and sample exactly and their
sums to rounding (added in other chunks): tests/test_fused_ride.py. The estimators' tokens are numbered in
row order as in token_pass; chunks are cut at sequence starts here, so each chunk's first row and first
token number go to chunk_r0 and chunk_j (estimator_kernel.token_rows_at reads them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kldiag.analysis import estimator_kernel as E
from kldiag.analysis.fused import (ACC_F, ACC_I, BAD_INVALID, BAD_NONFINITE, BIN_COPIES, CHUNK, COUNT_BITS, FIELD,
                                   JIT, MIN_NONE_BITS, NONE_BITS, SEQ_F, SEQ_I, STEP_F, STEP_I, SUMS, abs_bin,
                                   add_sequence, bad_code, bad_rows_of, bits, count_bins, d_bin, finite, from_bits,
                                   mismatch, pack7, token, unpack_counts)
from kldiag.jit import njit

SATURATED = 4  # a bit of chunk_sums_est's code[i] besides estimator_kernel's TOKEN and FLAGGED
if E.CHUNK < CHUNK:
    raise ImportError("fused_ride: estimator_kernel's chunk buffers must hold a fused.CHUNK chunk")


@njit(inline="always", **SUMS)
def chunk_sums_est(s, o, r, m, adv, mask, bad, has, params, abs_grid, d_grid, packed, packed_e, w_k3,
                   code):  # pragma: no cover - compiled
    """fused.chunk_sums' three tuples and packed bins, then the estimators' extras of the same rows: what
    estimator_kernel.chunk_sums gives beyond the analysis's sums on a chunk whose tokens in the loss all have
    a finite d and x (`normal`): sums of min(k3, clamp), |d|, K3_clamped's |weight|, the flagged |weight| of
    k2, k3_is and k3_clamped, k3_weight_lost ((v4, a1, a4, f1, f3, f4, lost)), maxima of |d| and of
    K3_clamped's |weight| and the flagged tokens' select rank (x1, x4, hi_f, as bits); packed_e[i] = row i's
    |d| bin, w_k3[i] its |K3 weight|, code[i] its TOKEN, FLAGGED and SATURATED bits.
    The analysis's body is fused.chunk_sums' own (tests/test_fused_ride.py holds the two passes equal)."""
    has_o, has_m, has_adv = has[0] != 0, has[2] != 0, has[3] != 0
    auto = 0 if has[4] != 0 else BAD_NONFINITE | BAD_INVALID
    r_nan = 0.0 if has[1] != 0 else np.nan
    log_tau, limit, clamp, clip_lo, clip_hi = params[0], params[1], params[2], params[3], params[4]
    m1, k0, n_abs = abs_grid[0], abs_grid[1], abs_grid[2]
    inv_step, d_offset, n_d = d_grid[0], d_grid[1], d_grid[2]
    n_dbin = np.int64(n_d) + 1
    sum_d = sum_d2 = sum_w = sum_w_is = sum_wf = sum_rho = sum_rho2 = sum_drift = sum_mm = 0.0
    sum_k3 = sum_k3_is = sum_adv = sum_opsm = sum_x = 0.0
    cnt0 = cnt1 = cnt2 = 0
    max_r = max_w = max_w_is = NONE_BITS
    min_r = MIN_NONE_BITS
    v4 = a1 = a4 = f1 = f3 = f4 = lost = 0.0
    x1 = x4 = hi_f = NONE_BITS
    for i in range(len(s)):
        sv, ov, rv, mv = np.float64(s[i]), np.float64(o[i]), np.float64(r[i]), np.float64(m[i])
        mk = mask[i]
        own, ph_o, ph_m = bad_code(sv, ov, rv, mv, mk)
        code_ = np.int64(bad[i]) | (own & auto)
        av = np.float64(adv[i])
        aok = has_adv & finite(av)
        sum_adv += av if aok else 0.0
        d, vd, x, vx, rho, k3, w, k3_is, w_is = token(sv, ov, rv + r_nan)
        vd, vx = vd & mk, vx & mk
        both = vd & vx
        theta, blow, clamped = vd & (d > log_tau), mk & (w > limit), mk & (k3 > clamp)
        flag = theta | blow | clamped | (mk & (code_ != 0))
        max_w = max(max_w, bits(w) if mk else NONE_BITS)
        max_w_is = max(max_w_is, bits(w_is) if mk else NONE_BITS)
        dv = d * np.float64(vd)
        sum_d += dv
        sum_d2 += dv * dv
        kok, wok = vd & finite(k3), vd & finite(w)
        sum_k3 += k3 if kok else 0.0
        wv = w if wok else 0.0
        sum_w += wv
        sum_wf += wv * np.float64(flag)
        xv = x * np.float64(vx)
        sum_x += xv
        sum_drift += abs(xv)
        rok = vx & finite(rho)
        rv_ = rho if rok else 0.0
        sum_rho += rv_
        r2 = rv_ * rv_
        sum_rho2 += r2 if finite(r2) else 0.0
        max_r = max(max_r, bits(rho) if vx else NONE_BITS)
        min_r = min(min_r, bits(rho) if vx else MIN_NONE_BITS)
        clip = vx & ((rho < clip_lo) | (rho > clip_hi))
        kiok, wiok = both & finite(k3_is), both & finite(w_is)
        sum_k3_is += k3_is if kiok else 0.0
        sum_w_is += w_is if wiok else 0.0
        y, kz, zok = mismatch(sv, ov, mv, mk, has_m)
        sum_opsm += y if mk & finite(y) else 0.0
        sum_mm += kz if zok else 0.0
        cnt0 += pack7(vd, vx, wok, wiok, rok, clip, zok)
        cnt1 += pack7(theta, blow, clamped, code_ & BAD_NONFINITE != 0, code_ >> 1 != 0, flag, mk)
        cnt2 += pack7(kok, kiok, (has_o & ph_o) | (has_m & ph_m), code_ != 0, aok, False, False)
        b_d = d_bin(d, inv_step, d_offset, n_d) if vd else n_dbin
        b_w = abs_bin(w, m1, k0, n_abs) if vd else n_abs + 1
        b_wi = abs_bin(w_is, m1, k0, n_abs) if both else n_abs + 1
        b_r = abs_bin(rho if vx else 1.0, m1, k0, n_abs) if vx else n_abs + 1
        packed[i] = b_d | (b_w << FIELD) | (b_wi << (2 * FIELD)) | (b_r << (3 * FIELD))
        # the estimators' extras; on a normal chunk a token in the loss has vd (estimator_kernel.chunk_sums:
        # k3_clamped = min(k3, clamp), +inf's too; K2's |weight| |d|; K3_clamped's K3's, 0 once saturated)
        ad = abs(d)
        k3c = k3 if k3 < clamp else clamp
        w4 = 0.0 if clamped else wv
        fl = np.float64(flag)
        v4 += k3c if vd else 0.0
        a1 += ad if vd else 0.0
        a4 += w4
        f1 += ad * fl if vd else 0.0
        f3 += w_is * fl if wiok else 0.0
        f4 += w4 * fl
        lost += wv if clamped else 0.0
        x1 = max(x1, bits(ad) if vd else NONE_BITS)
        x4 = max(x4, bits(0.0 if clamped else w) if mk else NONE_BITS)
        b1 = abs_bin(ad, m1, k0, n_abs) if vd else n_abs + 1
        packed_e[i] = b1
        w_k3[i] = w
        code[i] = np.uint8(mk) | (np.uint8(flag) << 1) | (np.uint8(clamped) << 2)
        hi_f = max(hi_f, bits(w) if flag else NONE_BITS)
    return (((sum_d, sum_d2, sum_w, sum_w_is, sum_wf, sum_rho, sum_rho2, sum_drift, sum_mm, sum_k3, sum_k3_is,
              sum_adv, sum_opsm, sum_x), (cnt0, cnt1, cnt2), (max_r, min_r, max_w, max_w_is)),
            (v4, a1, a4, f1, f3, f4, lost), (x1, x4, hi_f))


@njit(inline="always", **JIT)
def normal_chunk(cf, ci, cb, extra, maxima):  # pragma: no cover - compiled
    """estimator_kernel.chunk_sums' tuple of a normal chunk from chunk_sums_est's: the analysis's sums where
    they are the estimators' (k1 = -d, k2 = d^2 / 2, k3, k3_is; K3's and K3_IS's |weight|, K3's flagged) and
    the extras. Counts: tokens, flagged and saturated are the analysis's; no k1, k2 or k3_clamped value is
    non-finite (d is finite), k3's and k3_is's are the tokens without a finite one."""
    low = (1 << COUNT_BITS) - 1
    v4, a1, a4, f1, f3, f4, lost = extra
    x1, x4, hi_f = maxima  # the select rank of every token: the analysis's max_w
    w1, w2 = ci[1], ci[2]
    tokens, flagged, clamped = (w1 >> (6 * COUNT_BITS)) & low, (w1 >> (5 * COUNT_BITS)) & low, \
        (w1 >> (2 * COUNT_BITS)) & low
    n_k3, n_k3_is = w2 & low, (w2 >> COUNT_BITS) & low
    c0 = (tokens | (flagged << COUNT_BITS) | (clamped << (2 * COUNT_BITS)) | ((tokens - n_k3) << (5 * COUNT_BITS))
          | ((tokens - n_k3_is) << (6 * COUNT_BITS)))
    return ((-cf[0], 0.5 * cf[1], cf[9], cf[10], v4), (a1, cf[2], cf[3], a4), (f1, cf[4], f3, f4),
            (np.int64(x1), cb[2], cb[3], np.int64(x4)), np.int64(c0), np.int64(0), lost, cb[2], np.int64(hi_f))


@njit(inline="always", **JIT)
def count_bins_est(packed_e, packed, code, rows, h, normal, saturated, bin_zero):  # pragma: no cover - compiled
    """Add a chunk's estimator bins into h [BIN_COPIES, 4, bins] (estimator_kernel.count_bins'). K3's, K3_IS's
    and K3_clamped's |weight| bins are the analysis's |weight| and |weight_is| bins, added from its histograms
    at the end; here: of a normal chunk, the |d| bins, and K3_clamped's saturated tokens moved from their K3
    bin to 0's (`saturated`: their count); of another, all four of estimator_kernel.chunk_sums, less the
    analysis's bins of its rows (packed)."""
    low = (1 << FIELD) - 1
    if normal:
        for t in range(rows):
            h[t % BIN_COPIES, 0, packed_e[t]] += 1
        if saturated:
            for t in range(rows):
                if code[t] & SATURATED:
                    h[0, 3, (packed[t] >> FIELD) & low] -= 1
                    h[0, 3, bin_zero] += 1
        return
    E.count_bins(packed_e, rows, h)
    for t in range(rows):
        p = packed[t]
        h[0, 1, (p >> FIELD) & low] -= 1
        h[0, 2, (p >> (2 * FIELD)) & low] -= 1
        h[0, 3, (p >> FIELD) & low] -= 1


@njit(**SUMS)
def fused_pass_est(starts, sidx, n_steps, s, o, r, m, adv, mask, bad, has, params, abs_grid, d_grid,
                   s_null, o_null, r_null, m_null, fsum, icount, hist, scal, top_w, top_j, worst_w,
                   worst_j, chunk_r0, chunk_j):  # pragma: no cover - compiled
    """fused.fused_pass's outputs, and estimator_kernel.token_pass's into fsum .. worst_j, from one pass over
    the rows. Arguments: fused_pass's; null masks bool [n] (r_null true at every row without a reference);
    token_pass's outputs; chunk_r0, chunk_j [n_seq + n // CHUNK + 1] (token_rows_at's: each chunk's first
    row and first token number; chunk_j's entry after the last chunk the tokens in all). The estimators'
    thresholds are the analysis's (params). Returns (fused_pass's nine, k3_weight_lost, number of chunks).

    A chunk some token in the loss of which has a non-finite d or x (or no reference) is not normal: there
    the estimators' own chunk_sums runs on its rows (rare: such tokens are findings)."""
    n, n_seq = len(s), len(starts) - 1
    n_abs, n_d_edges = abs_grid[2], np.int64(d_grid[2])
    seq_f = np.zeros((n_seq, len(SEQ_F)))
    seq_i = np.zeros((n_seq, len(SEQ_I)), np.int64)
    step_f = np.zeros((n_steps, len(STEP_F)))
    step_i = np.zeros((n_steps, len(STEP_I)), np.int64)
    step_b = np.empty((n_steps, 4), np.int64)
    step_b[:, 0], step_b[:, 1], step_b[:, 2], step_b[:, 3] = NONE_BITS, MIN_NONE_BITS, NONE_BITS, NONE_BITS
    h_d = np.zeros((n_steps, BIN_COPIES, n_d_edges + 2), np.int64)
    h_w = np.zeros((n_steps, BIN_COPIES, n_abs + 2), np.int64)
    h_w_is = np.zeros((n_steps, BIN_COPIES, n_abs + 2), np.int64)
    h_rho = np.zeros((n_steps, BIN_COPIES, n_abs + 2), np.int64)
    packed = np.empty(CHUNK, np.int64)
    packed_e, w_k3, code = np.empty(E.CHUNK, np.int64), np.empty(E.CHUNK), np.empty(E.CHUNK, np.uint8)
    eparams = np.array([params[0], params[1], params[2], 0.0, -np.inf])  # estimator_kernel.chunk_sums'
    bin_zero = abs_bin(0.0, abs_grid[0], abs_grid[1], n_abs)
    acc = E.accumulators(abs_grid, top_w, top_j, worst_w, worst_j)
    no_f, no_b, no_i = np.empty(0), np.empty(0, np.bool_), np.empty(0, np.int64)
    auto = 0 if has[4] != 0 else BAD_NONFINITE | BAD_INVALID
    acc_f, acc_i, acc_b = np.empty(len(ACC_F)), np.empty(len(ACC_I), np.int64), np.empty(4, np.int64)
    bad_rows = np.empty(n, np.int64)
    n_bad_rows, tok, n_chunks, low = 0, 0, 0, (1 << COUNT_BITS) - 1
    for j in range(n_seq):
        k = sidx[j]
        acc_f[:], acc_i[:] = 0.0, 0
        acc_b[0], acc_b[1], acc_b[2], acc_b[3] = NONE_BITS, MIN_NONE_BITS, NONE_BITS, NONE_BITS
        for c0 in range(starts[j], starts[j + 1], CHUNK):
            c1 = min(c0 + CHUNK, starts[j + 1])
            (cf, ci, cb), extra, maxima = chunk_sums_est(
                s[c0:c1], o[c0:c1], r[c0:c1], m[c0:c1], adv[c0:c1], mask[c0:c1], bad[c0:c1], has, params, abs_grid,
                d_grid, packed, packed_e, w_k3, code)
            for q in range(len(ACC_F)):
                acc_f[q] += cf[q]
            unpack_counts(ci, acc_i)
            acc_b[0], acc_b[1] = max(acc_b[0], cb[0]), min(acc_b[1], cb[1])
            acc_b[2], acc_b[3] = max(acc_b[2], cb[2]), max(acc_b[3], cb[3])
            count_bins(packed, c1 - c0, h_d[k], h_w[k], h_w_is[k], h_rho[k])
            if (ci[2] >> (3 * COUNT_BITS)) & low:
                n_bad_rows = bad_rows_of(c0, c1, s, o, r, m, mask, bad, auto, bad_rows, n_bad_rows)
            tokens = (ci[1] >> (6 * COUNT_BITS)) & low
            normal = (ci[0] & low) == tokens and ((ci[0] >> COUNT_BITS) & low) == tokens  # n_d, n_x
            if normal:
                est = normal_chunk(cf, ci, cb, extra, maxima)
            else:
                est = E.chunk_sums(s[c0:c1], o[c0:c1], r[c0:c1], m[c0:c1], s_null[c0:c1], o_null[c0:c1],
                                   r_null[c0:c1], m_null[c0:c1], mask[c0:c1], eparams, abs_grid, packed_e, w_k3, code)
            chunk_r0[n_chunks], chunk_j[n_chunks] = c0, tok
            n_chunks += 1
            count_bins_est(packed_e, packed, code, c1 - c0, acc[6], normal, (ci[1] >> (2 * COUNT_BITS)) & low,
                           bin_zero)
            tok = E.add_chunk(est, packed_e, w_k3, code, c1 - c0, c0, tok, acc, False, no_f, no_b, no_i, False)
        add_sequence(acc_f, acc_i, acc_b, seq_f[j], seq_i[j], step_f[k], step_i[k], step_b[k])
    chunk_j[n_chunks] = tok
    h = acc[6]
    for k in range(n_steps):  # the estimators' K3, K3_IS and K3_clamped |weight| bins: the analysis's
        for c in range(BIN_COPIES):
            for b in range(n_abs + 2):
                h[0, 1, b] += h_w[k, c, b]
                h[0, 2, b] += h_w_is[k, c, b]
                h[0, 3, b] += h_w[k, c, b]
    lost = E.totals(acc, abs_grid, fsum, icount, hist, scal)
    for k in range(n_steps):
        step_f[k, 8], step_f[k, 9] = from_bits(step_b[k, 0], NONE_BITS), from_bits(step_b[k, 1], MIN_NONE_BITS)
        step_f[k, 13], step_f[k, 14] = from_bits(step_b[k, 2], NONE_BITS), from_bits(step_b[k, 3], NONE_BITS)
    return (seq_f, seq_i, step_f, step_i, h_d.sum(axis=1)[:, :n_d_edges + 1], h_w.sum(axis=1)[:, :n_abs + 1],
            h_w_is.sum(axis=1)[:, :n_abs + 1], h_rho.sum(axis=1)[:, :n_abs + 1], bad_rows[:n_bad_rows], lost,
            n_chunks)


@dataclass(frozen=True)
class EstimatorRide:
    """The Estimators page's reducer riding in the analysis's pass: its thresholds (the analysis's, or it
    does not ride: partials.AnalysisReducer.carry), its kept sets' sizes, take(b, out), called with each
    kernel.Batch and `run`'s outputs for it, and alone(batch), its own pass over a record batch that the
    analysis reads otherwise (stats.batch_partials: an empty one, one it sorts first)."""

    tau: float
    weight_limit: float
    clamp: float
    keep_top: int
    keep_flagged: int
    take: Callable[[Any, dict], None]
    alone: Callable[[Any], None]


def run(b, starts, sidx, n_steps, inputs, nulls, params, abs_grid, d_grid, ride: EstimatorRide) -> tuple:
    """fused_pass's tuple of one batch (inputs: stats.kernel_inputs(b); nulls: stats.null_masks(b); params: the
    analysis's, whose first three are the ride's thresholds); the estimators' outputs go to
    ride.take(b, out) as named arrays: fsum, icount, hist, scal (estimator_kernel.token_pass's),
    k3_weight_lost [1], top_j, worst_j (the kept token numbers), chunk_r0, chunk_j (token_rows_at's)."""
    fsum, icount = np.zeros((4, E.N_EST)), np.zeros((1, E.N_EST), np.int64)
    hist, scal = np.zeros((E.N_EST, abs_grid[2] + 1), np.int64), np.zeros(5, np.int64)
    top_w, top_j = np.empty(ride.keep_top), np.empty(ride.keep_top, np.int64)
    worst_w, worst_j = np.empty(ride.keep_flagged), np.empty(ride.keep_flagged, np.int64)
    cap = len(starts) + b.n // CHUNK + 1
    chunk_r0, chunk_j = np.empty(cap, np.int64), np.empty(cap, np.int64)
    res = fused_pass_est(starts, sidx, n_steps, *inputs, params, abs_grid, d_grid, *nulls,
                         fsum, icount, hist, scal, top_w, top_j, worst_w, worst_j, chunk_r0, chunk_j)
    n_chunks = res[10]
    ride.take(b, {"fsum": fsum, "icount": icount, "hist": hist, "scal": scal, "k3_weight_lost": np.array([res[9]]),
                  "top_j": top_j[:scal[E.S_TOP]], "worst_j": worst_j[:scal[E.S_WORST]],
                  "chunk_r0": chunk_r0[:n_chunks], "chunk_j": chunk_j[:n_chunks + 1]})
    return res[:9]
