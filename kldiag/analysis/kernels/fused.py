"""The compiled kernel: one pass over a record batch gives every per-sequence and per-step sum.

Per-token maths (d, x, the estimators, bad log-probs, bins) is fused_token's, inlined here.

Rows are grouped by (step, seq) as runs of equal consecutive keys (scans.seq_starts):
recorder files are step-ordered. Sums run per sequence, then add into their step. Within
a sequence, rows go in chunks of CHUNK: a branch-free loop that LLVM vectorises computes
every per-token value and sum and writes the histogram bins of the chunk, then a scalar
loop counts the bins. Functions are compiled once and cached on disk (numba cache=True)
and release the GIL, so other threads decode and reduce other parts meanwhile.

fused_ride.fused_pass_est, the same pass with the Estimators page's per-token work riding in it, shares
this source: its chunk loop is chunk_sums' compiled with the estimators' extras (make_chunk_sums: a
closure constant numba prunes, so the bare loop holds none of them), and its sequence loop is built from
the same helpers (pass_arrays, start_sequence, add_chunk, add_sequence, pass_result).
"""

from __future__ import annotations

import numpy as np

from kldiag.analysis.kernels.token import (
    BAD_INVALID,
    BAD_NONFINITE,
    JIT,
    MIN_NONE_BITS,
    NONE_BITS,
    SUMS,
    abs_bin,
    bad_code,
    bits,
    d_bin,
    finite,
    from_bits,
    mismatch,
    token,
)
from kldiag.jit import njit

CHUNK = 256  # rows per vectorised chunk: its bin buffers stay in L1
BIN_COPIES = 4  # copies of each step's histograms, summed at the end (count_bins)

# Columns of the float and count outputs, per sequence and per step (partial names, stats.py).
SEQ_F = ("sum_k3", "sum_k3_is", "max_w", "max_w_is", "sum_adv", "sum_opsm", "sum_trl_x")
SEQ_I = ("n_tokens", "n_k3", "n_k3_is", "n_flagged", "n_nonfinite", "n_adv")
STEP_F = ("sum_k1", "sum_k2", "sum_w", "sum_w_is", "sum_w_flagged", "sum_rho", "sum_rho2", "sum_drift",
          "max_rho", "min_rho", "sum_mismatch", "sum_k3", "sum_k3_is", "max_w", "max_w_is")
STEP_I = ("n_d", "n_x", "n_w", "n_w_is", "n_rho", "n_clip", "n_mismatch", "n_theta", "n_blowup", "n_clamp",
          "n_nonfinite", "n_invalid", "n_flagged", "n_tokens", "n_k3", "n_k3_is", "n_placeholder")
# Accumulators of chunk_sums, in this order. The first 17 counts are STEP_I's.
ACC_F = ("sum_d", "sum_d2", "sum_w", "sum_w_is", "sum_wf", "sum_rho", "sum_rho2", "sum_drift", "sum_mm",
         "sum_k3", "sum_k3_is", "sum_adv", "sum_opsm", "sum_x")
ACC_I = (*STEP_I, "n_bad", "n_adv")
ACC_B = ("max_rho", "min_rho", "max_w", "max_w_is")  # bits of values >= +0.0
FIELD = 10  # bits per histogram bin in chunk_sums' packed words
COUNT_BITS = 9  # bits per count packed in a word: a chunk holds at most CHUNK = 256 rows
if not (CHUNK < 1 << COUNT_BITS and 7 * COUNT_BITS < 64):
    raise ImportError("fused.CHUNK rows must fit COUNT_BITS, and 7 counts one int64")


def make_chunk_sums(WITH_EST: bool):  # noqa: N803 - a compile-time constant
    """chunk_sums, or with WITH_EST fused_ride.chunk_sums_est: one source, compiled as two functions.

    WITH_EST is a closure constant: numba prunes the branches on it before typing (dead branch pruning,
    numba/core/untyped_passes.py DeadBranchPrune, numba 0.68, also run on an inlined callee), so
    chunk_sums' loop holds none of the estimators' extras and stays what LLVM vectorises."""

    @njit(inline="always", **SUMS)
    def chunk_sums(s, o, r, m, adv, mask, bad, has, params, abs_grid, d_grid, packed, packed_e, w_k3, code, rho_k):
        """(ACC_F, ACC_I as three packed words, ACC_B) of one chunk's rows (column slices), and
        packed[i] = row i's four histogram bins (FIELD bits each; n_edges + 1: not binned). With WITH_EST,
        (that tuple, the extras, their maxima) and packed_e, w_k3, code, rho_k (row i's rho) filled:
        fused_ride.chunk_sums_est.

        One branch-free loop, so that LLVM vectorises it: conditions are combined with & and |,
        finite values are masked by multiplying with 0/1, values that may be inf by a select.
        It runs over range(len) of slices: with range(c0, c1) numba cannot prove i >= 0, every
        load pays for negative-index wraparound, and that version ran 4x slower and its sums
        rounded differently at some array addresses (tests/test_analysis_kernel.py checks that
        they no longer do). The loop is long on purpose: it is the unit LLVM vectorises.
        """
        has_o, has_m, has_adv = has[0] != 0, has[2] != 0, has[3] != 0
        auto = 0 if has[4] != 0 else BAD_NONFINITE | BAD_INVALID  # has_bad: take bad[], else compute
        r_nan = 0.0 if has[1] != 0 else np.nan  # d = NaN for every token without a reference
        log_tau, limit, clamp, clip_lo, clip_hi = params[0], params[1], params[2], params[3], params[4]
        m1, k0, n_abs = abs_grid[0], abs_grid[1], abs_grid[2]
        # Loaded here, not in the loop: there, under a condition, they became three gathers (10% slower).
        inv_step, d_offset, n_d = d_grid[0], d_grid[1], d_grid[2]
        n_dbin = np.int64(n_d) + 1
        sum_d = sum_d2 = sum_w = sum_w_is = sum_wf = sum_rho = sum_rho2 = sum_drift = sum_mm = 0.0
        sum_k3 = sum_k3_is = sum_adv = sum_opsm = sum_x = 0.0
        cnt0 = cnt1 = cnt2 = 0  # the 18 counts, COUNT_BITS each (see unpack_counts)
        max_r = max_w = max_w_is = NONE_BITS
        min_r = MIN_NONE_BITS
        if WITH_EST:
            v4 = a1 = a4 = f1 = f3 = f4 = lost = 0.0
            x1 = x4 = hi_f = NONE_BITS
        for i in range(len(s)):
            sv, ov, rv, mv = np.float64(s[i]), np.float64(o[i]), np.float64(r[i]), np.float64(m[i])
            mk = mask[i]
            own, ph_o, ph_m = bad_code(sv, ov, rv, mv, mk)
            code_ = np.int64(bad[i]) | (own & auto)  # no branch: bad[] is 0 unless has_bad
            av = np.float64(adv[i])
            aok = has_adv & finite(av)
            sum_adv += av if aok else 0.0
            d, vd, x, vx, rho, k3, w, k3_is, w_is = token(sv, ov, rv + r_nan)
            vd, vx = vd & mk, vx & mk
            both = vd & vx
            theta, blow, clamped = vd & (d > log_tau), mk & (w > limit), mk & (k3 > clamp)
            flag = theta | blow | clamped | (mk & (code_ != 0))
            max_w = max(max_w, bits(w) if mk else NONE_BITS)  # w >= +0.0: its bits order like it
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
            # one add per word instead of 18: fewer live registers, so the loop vectorises well
            cnt0 += pack7(vd, vx, wok, wiok, rok, clip, zok)
            cnt1 += pack7(theta, blow, clamped, code_ & BAD_NONFINITE != 0, code_ >> 1 != 0, flag, mk)
            cnt2 += pack7(kok, kiok, (has_o & ph_o) | (has_m & ph_m), code_ != 0, aok, False, False)
            b_d = d_bin(d, inv_step, d_offset, n_d) if vd else n_dbin
            b_w = abs_bin(w, m1, k0, n_abs) if vd else n_abs + 1
            b_wi = abs_bin(w_is, m1, k0, n_abs) if both else n_abs + 1
            b_r = abs_bin(rho if vx else 1.0, m1, k0, n_abs) if vx else n_abs + 1
            packed[i] = b_d | (b_w << FIELD) | (b_wi << (2 * FIELD)) | (b_r << (3 * FIELD))
            if WITH_EST:  # the estimators' extras (fused_ride.chunk_sums_est)
                # on a normal chunk a token in the loss has vd (estimator_kernel.chunk_sums: k3_clamped =
                # min(k3, clamp), +inf's too; K2's |weight| |d|; K3_clamped's K3's, 0 once saturated)
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
                packed_e[i] = abs_bin(ad, m1, k0, n_abs) if vd else n_abs + 1
                w_k3[i] = w
                rho_k[i] = rho
                code[i] = np.uint8(mk) | (np.uint8(flag) << 1) | (np.uint8(clamped) << 2)
                hi_f = max(hi_f, bits(w) if flag else NONE_BITS)
        sums = ((sum_d, sum_d2, sum_w, sum_w_is, sum_wf, sum_rho, sum_rho2, sum_drift, sum_mm, sum_k3, sum_k3_is,
                 sum_adv, sum_opsm, sum_x), (cnt0, cnt1, cnt2), (max_r, min_r, max_w, max_w_is))
        if WITH_EST:
            return sums, (v4, a1, a4, f1, f3, f4, lost), (x1, x4, hi_f)
        return sums

    return chunk_sums


chunk_sums = make_chunk_sums(False)


@njit(inline="always", **JIT)
def pack7(a, b, c, d, e, f, g):
    """Seven 0/1 flags as COUNT_BITS-bit fields of one int64: summing words sums each field."""
    return (np.int64(a) | (np.int64(b) << COUNT_BITS) | (np.int64(c) << 2 * COUNT_BITS)
            | (np.int64(d) << 3 * COUNT_BITS) | (np.int64(e) << 4 * COUNT_BITS) | (np.int64(f) << 5 * COUNT_BITS)
            | (np.int64(g) << 6 * COUNT_BITS))


@njit(inline="always", **JIT)
def unpack_counts(words, out):
    """Add the fields of chunk_sums' count words into `out`, in ACC_I order."""
    low = (1 << COUNT_BITS) - 1
    w0, w1, w2 = words
    # w0: n_d, n_x, n_w, n_w_is, n_rho, n_clip, n_mm; w1: n_theta, n_blowup, n_clamp, n_nonfinite,
    # n_invalid, n_flagged, n_tokens; w2: n_k3, n_k3_is, n_placeholder, n_bad, n_adv (ACC_I's order, by design)
    for q in range(7):
        out[q] += (w0 >> (q * COUNT_BITS)) & low
        out[7 + q] += (w1 >> (q * COUNT_BITS)) & low
    for q in range(5):
        out[14 + q] += (w2 >> (q * COUNT_BITS)) & low


@njit(inline="always", **JIT)
def bad_rows_of(c0, c1, s, o, r, m, mask, bad, auto, out, n_out):
    """Append rows c0..c1 with a bad code to out[n_out:]; the new n_out."""
    for i in range(c0, c1):
        code = np.int64(bad[i]) | (bad_code(np.float64(s[i]), np.float64(o[i]), np.float64(r[i]),
                                            np.float64(m[i]), mask[i])[0] & auto)
        if code:
            out[n_out] = i
            n_out += 1
    return n_out


@njit(inline="always", **JIT)
def count_bins(packed, rows, h_d, h_w, h_w_is, h_rho):
    """Add the packed bins of `rows` rows into one step's histograms [BIN_COPIES, bins].

    Row t counts into copy t % BIN_COPIES: consecutive tokens often share a bin, and
    increments of one counter would wait on each other's store (measured 1.7 against
    1.0 ns a token). The last bin counts tokens not binned.
    """
    low = (1 << FIELD) - 1
    whole = rows - rows % BIN_COPIES
    for t0 in range(0, whole, BIN_COPIES):
        for c in range(BIN_COPIES):
            p = packed[t0 + c]
            h_d[c, p & low] += 1
            h_w[c, (p >> FIELD) & low] += 1
            h_w_is[c, (p >> (2 * FIELD)) & low] += 1
            h_rho[c, (p >> (3 * FIELD)) & low] += 1
    for t in range(whole, rows):
        p = packed[t]
        h_d[0, p & low] += 1
        h_w[0, (p >> FIELD) & low] += 1
        h_w_is[0, (p >> (2 * FIELD)) & low] += 1
        h_rho[0, (p >> (3 * FIELD)) & low] += 1


@njit(**SUMS)
def fused_pass(starts, sidx, n_steps, s, o, r, m, adv, mask, bad, has, params, abs_grid, d_grid):
    """Every per-sequence and per-step partial of one batch, in one pass over its rows.

    starts: seq_starts; sidx: step_of_seqs. s, o, r, m, adv: float32 [n] logp, logp_old,
    logp_ref, logp_sampler, advantage; an absent column is passed as s with its has[] entry
    0 (has = [has_o, has_r, has_m, has_adv, has_bad]); a null logp_old row holds s
    (on-policy). mask: bool [n]. bad: uint8 [n] codes of bad rows, used when has_bad (nulls
    make NaN ambiguous), else zeros and the codes are computed here. params: log(tau),
    weight_limit, clamp, 1 - clip_low, 1 + clip_high. abs_grid: bins.ABS_MANTISSAS[0], ABS_K0,
    number of |weight| edges; d_grid: 1 / step, offset, number of d edges. Returns
    seq_f [n_seq, SEQ_F], seq_i [n_seq, SEQ_I], step_f, step_i, the four histograms
    [n_steps, bins] and the rows with a bad code.
    """
    n_seq, auto = len(starts) - 1, 0 if has[4] != 0 else BAD_NONFINITE | BAD_INVALID
    out, acc = pass_arrays(len(s), n_seq, n_steps, abs_grid, d_grid)
    seq_f, seq_i, step_f, step_i, step_b, h_d, h_w, h_w_is, h_rho, bad_rows = out
    acc_f, acc_i, acc_b = acc
    packed, no_e, no_w, no_c = np.empty(CHUNK, np.int64), np.empty(0, np.int64), np.empty(0), np.empty(0, np.uint8)
    n_bad_rows = 0
    for j in range(n_seq):
        k = start_sequence(sidx, j, acc)
        for c0 in range(starts[j], starts[j + 1], CHUNK):
            c1 = min(c0 + CHUNK, starts[j + 1])
            sums = chunk_sums(s[c0:c1], o[c0:c1], r[c0:c1], m[c0:c1], adv[c0:c1], mask[c0:c1], bad[c0:c1], has,
                              params, abs_grid, d_grid, packed, no_e, no_w, no_c, no_w)
            if add_chunk(sums, acc, packed, c1 - c0, h_d[k], h_w[k], h_w_is[k], h_rho[k]):  # bad rows: note them
                n_bad_rows = bad_rows_of(c0, c1, s, o, r, m, mask, bad, auto, bad_rows, n_bad_rows)
        add_sequence(acc_f, acc_i, acc_b, seq_f[j], seq_i[j], step_f[k], step_i[k], step_b[k])
    return pass_result(out, n_bad_rows, abs_grid, d_grid)


@njit(inline="always", **JIT)
def pass_arrays(n, n_seq, n_steps, abs_grid, d_grid):
    """fused_pass's arrays for a batch of n rows: (seq_f, seq_i, step_f, step_i, step_b (bits of max_rho,
    min_rho, max_w, max_w_is), h_d, h_w, h_w_is, h_rho [n_steps, BIN_COPIES, bins + 1] (the last bin is for
    tokens not binned), bad_rows [n]), and one sequence's accumulators (acc_f, acc_i, acc_b)."""
    n_abs, n_d_edges = abs_grid[2], np.int64(d_grid[2])
    step_b = np.empty((n_steps, 4), np.int64)
    step_b[:, 0], step_b[:, 1], step_b[:, 2], step_b[:, 3] = NONE_BITS, MIN_NONE_BITS, NONE_BITS, NONE_BITS
    out = (np.zeros((n_seq, len(SEQ_F))), np.zeros((n_seq, len(SEQ_I)), np.int64), np.zeros((n_steps, len(STEP_F))),
           np.zeros((n_steps, len(STEP_I)), np.int64), step_b, np.zeros((n_steps, BIN_COPIES, n_d_edges + 2), np.int64),
           np.zeros((n_steps, BIN_COPIES, n_abs + 2), np.int64), np.zeros((n_steps, BIN_COPIES, n_abs + 2), np.int64),
           np.zeros((n_steps, BIN_COPIES, n_abs + 2), np.int64), np.empty(n, np.int64))
    return out, (np.empty(len(ACC_F)), np.empty(len(ACC_I), np.int64), np.empty(4, np.int64))


@njit(inline="always", **JIT)
def start_sequence(sidx, j, acc):
    """Reset the accumulators for sequence j; its step."""
    acc_f, acc_i, acc_b = acc
    acc_f[:], acc_i[:] = 0.0, 0
    acc_b[0], acc_b[1], acc_b[2], acc_b[3] = NONE_BITS, MIN_NONE_BITS, NONE_BITS, NONE_BITS
    return sidx[j]


@njit(inline="always", **JIT)
def add_chunk(sums, acc, packed, rows, h_d, h_w, h_w_is, h_rho):
    """Add chunk_sums' tuple and packed bins of a chunk into its sequence's accumulators and its step's
    histograms; whether the chunk has a row with a bad code (n_bad)."""
    cf, ci, cb = sums
    acc_f, acc_i, acc_b = acc
    for q in range(len(ACC_F)):
        acc_f[q] += cf[q]
    unpack_counts(ci, acc_i)
    acc_b[0], acc_b[1] = max(acc_b[0], cb[0]), min(acc_b[1], cb[1])
    acc_b[2], acc_b[3] = max(acc_b[2], cb[2]), max(acc_b[3], cb[3])
    count_bins(packed, rows, h_d, h_w, h_w_is, h_rho)
    return (ci[2] >> (3 * COUNT_BITS)) & ((1 << COUNT_BITS) - 1) != 0


@njit(inline="always", **JIT)
def pass_result(out, n_bad_rows, abs_grid, d_grid):
    """fused_pass's nine outputs from pass_arrays' once every sequence is added."""
    seq_f, seq_i, step_f, step_i, step_b, h_d, h_w, h_w_is, h_rho, bad_rows = out
    n_abs, n_d_edges = abs_grid[2], np.int64(d_grid[2])
    for k in range(len(step_f)):
        step_f[k, 8], step_f[k, 9] = from_bits(step_b[k, 0], NONE_BITS), from_bits(step_b[k, 1], MIN_NONE_BITS)
        step_f[k, 13], step_f[k, 14] = from_bits(step_b[k, 2], NONE_BITS), from_bits(step_b[k, 3], NONE_BITS)
    return (seq_f, seq_i, step_f, step_i, h_d.sum(axis=1)[:, :n_d_edges + 1], h_w.sum(axis=1)[:, :n_abs + 1],
            h_w_is.sum(axis=1)[:, :n_abs + 1], h_rho.sum(axis=1)[:, :n_abs + 1], bad_rows[:n_bad_rows])


@njit(inline="always", **JIT)
def add_sequence(acc_f, acc_i, acc_b, seq_f, seq_i, step_f, step_i, step_b):
    """Write one sequence's row (SEQ_F, SEQ_I) and add it into its step's (STEP_F, STEP_I)."""
    seq_f[0], seq_f[1] = acc_f[9], acc_f[10]  # sum_k3, sum_k3_is
    seq_f[2], seq_f[3] = from_bits(acc_b[2], NONE_BITS), from_bits(acc_b[3], NONE_BITS)
    seq_f[4], seq_f[5], seq_f[6] = acc_f[11], acc_f[12], acc_f[13]  # sum_adv, sum_opsm, sum_x
    for c, q in enumerate((13, 14, 15, 12, 17, 18)):  # n_tokens, n_k3, n_k3_is, n_flagged, n_bad, n_adv
        seq_i[c] = acc_i[q]
    step_f[0] -= acc_f[0]  # sum_k1 = -sum_d
    step_f[1] += 0.5 * acc_f[1]  # sum_k2
    for c in range(2, 8):  # sum_w .. sum_drift
        step_f[c] += acc_f[c]
    step_f[10] += acc_f[8]  # sum_mismatch
    step_f[11] += acc_f[9]
    step_f[12] += acc_f[10]
    for q in range(len(STEP_I)):
        step_i[q] += acc_i[q]
    step_b[0], step_b[1] = max(step_b[0], acc_b[0]), min(step_b[1], acc_b[1])
    step_b[2], step_b[3] = max(step_b[2], acc_b[2]), max(step_b[3], acc_b[3])
