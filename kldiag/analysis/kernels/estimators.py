"""The Estimators page's per-token pass compiled (numba, float64 inside): one loop over a record batch.

It gives, from the same float64 values, what numpy gives from `views.pages.derive`'s per-token columns
(tests/test_estimator_kernel.py keeps that numpy pass as its reference): per compared estimator (k1, k2,
k3, k3_is, k3_clamped) the sum and non-finite count of its value, the sum, flagged sum, maximum and
histogram of its |gradient weight|; the flag counts; the token sample's always-kept tokens (the
KEEP_TOP largest |k3 weight| and the KEEP_FLAGGED worst flagged ones, selected in the pass with a running
threshold: no per-token array leaves it). The per-token maths are kldiag.estimators' (Schulman 2020's k1, k2, k3;
DeepSeek-V3.2 eq. 7 and 9 for k3_is and its weight), with its convention that a 0 * inf product of
non-NaN factors is +-inf, never NaN. Counts, maxima, histograms and selections equal numpy's exactly; sums
are taken in row order, so they differ from numpy's pairwise sums by rounding only
(tests/test_estimator_kernel.py).

Only what differs per token is computed per token: k1's weight is 1 (its |weight| sums, maximum and
histogram follow from the counts), and k3_clamped's weight is K3's except on clamp-saturated tokens (its
histogram is K3's, corrected there).
"""

from __future__ import annotations

import numpy as np

from kldiag.analysis.kernels import fastexp
from kldiag.analysis.kernels.fused import (
    BIN_COPIES,
    COUNT_BITS,
    FIELD,
    NONE_BITS,
    abs_bin,
    bits,
    finite,
    from_bits,
    pack7,
)
from kldiag.jit import njit

JIT = dict(cache=True, nogil=True, error_model="numpy")
SUMS = dict(JIT, fastmath={"reassoc", "contract", "nsz"})  # as fused.py: vectorised sums, NaN and inf kept
CHUNK = 256  # rows per vectorised chunk (fused.COUNT_BITS holds a chunk's counts)
N_EST = 5  # COMPARED's order: k1, k2, k3, k3_is, k3_clamped
# Per-estimator float sums (rows of `fsum`) and counts (rows of `icount`).
F_VALUE, F_WABS, F_WFLAG, F_WMAX = range(4)
I_NONFINITE = 0
# Counts (`scal`): tokens, flagged, clamp_saturated, then the kept tokens of the two selections.
S_TOKENS, S_FLAGGED, S_CLAMP, S_TOP, S_WORST = range(5)
TOKEN, FLAGGED = 1, 2  # bits of a row's code in the chunk loop


@njit(inline="always", **JIT)
def product(a, b):  # pragma: no cover - compiled
    """a * b, with estimators._nan_to_inf_product's rule: NaN from non-NaN factors (0 * inf) is +-inf.
    Branch-free (selects), so that the chunk loop vectorises."""
    out = a * b
    sa = -1.0 if a < 0 else 1.0
    sb = -1.0 if b < 0 else 1.0
    return sa * sb * np.inf if (out != out) & (a == a) & (b == b) else out


@njit(inline="always", **JIT)
def bad(x, null, zero, ninf):  # pragma: no cover - compiled
    """A present log-prob that views.derive flags: non-finite (NaN, +-inf) or above 0. zero, ninf: 0.0 and -inf
    as values the compiler cannot see (params): against literals, LLVM turns the two compares into a
    floating-point class test that it does not vectorise (the chunk loop ran 1.2x slower)."""
    return (not null) & (not ((x <= zero) & (x > ninf)))


@njit(inline="always", **JIT)
def weight_bin(w, ok, m1, k0, n_abs):  # pragma: no cover - compiled
    """|weight| w's histogram bin, or the "not binned" one past the last (not a token, or NaN); m1, k0, n_abs:
    abs_grid's entries, read by the caller before its loop (read in it, under the condition, they were three
    gathers a row: the chunk loop ran 1.4x slower)."""
    return abs_bin(w, m1, k0, n_abs) if ok & (w == w) else n_abs + 1


@njit(inline="always", **SUMS)
def chunk_sums(s, o, r, m, s_null, o_null, r_null, m_null, mask, params, abs_grid, packed, w_k3, code):
    """(value sums [5], |weight| sums [4], flagged |weight| sums [4], |weight| maxima as bits [4], counts
    packed in two words, k3_weight_lost) of one chunk's rows (column slices), k2 .. k3_clamped for the
    weights; packed[i] = row i's four histogram bins (fused.FIELD bits each), w_k3[i] its K3 weight,
    code[i] its TOKEN and FLAGGED bits; then the bits of the largest |K3 weight| (NaN as +inf) of its tokens
    and of its flagged tokens (NONE_BITS: none), which tell `select` whether a token of the chunk can join a
    kept set. One branch-free loop over range(len) of slices, as fused.chunk_sums, so that LLVM vectorises it."""
    log_tau, limit, clamp, zero, ninf = params[0], params[1], params[2], params[3], params[4]
    m1, k0, n_abs = abs_grid[0], abs_grid[1], abs_grid[2]
    bin_zero = abs_bin(0.0, m1, k0, n_abs)
    v0 = v1 = v2 = v3 = v4 = a1 = a2 = a3 = a4 = f1 = f2 = f3 = f4 = lost = 0.0
    x1 = x2 = x3 = x4 = hi = hi_f = NONE_BITS
    c0 = c1 = 0
    for i in range(len(s)):
        mk = mask[i] & (not r_null[i])
        sv, rv, mv = np.float64(s[i]), np.float64(r[i]), np.float64(m[i])
        ov = sv if o_null[i] else np.float64(o[i])
        d = rv - sv
        em = fastexp.expm1(d)
        rho = fastexp.exp(sv - ov)
        k3 = np.inf if d == np.inf else em - d  # expm1(+inf) - inf is NaN; the limit is +inf
        w3 = abs(em)
        sat = mk & (k3 > clamp)
        fl = mk & ((d > log_tau) | (w3 > limit) | sat | bad(sv, s_null[i], zero, ninf) | bad(rv, False, zero, ninf)
                   | bad(ov, o_null[i], zero, ninf) | bad(mv, m_null[i], zero, ninf))
        # k1 = s - r (weight 1: counted by the caller), k2 = d^2 / 2 (s - r), k3 = expm1(d) - d (-expm1(d)),
        # k3_is = rho k3 (rho (s - r)), k3_clamped = min(k3, clamp) (K3's weight, 0 once k3 > clamp)
        k1, k2, k3is = -d, 0.5 * (d * d), product(rho, k3)
        k3c = k3 if (k3 != k3) | (k3 < clamp) else clamp  # np.minimum: NaN stays NaN
        ok0, ok1, ok2, ok3, ok4 = mk & finite(k1), mk & finite(k2), mk & finite(k3), mk & finite(k3is), mk & finite(k3c)
        v0 += k1 if ok0 else 0.0
        v1 += k2 if ok1 else 0.0
        v2 += k3 if ok2 else 0.0
        v3 += k3is if ok3 else 0.0
        v4 += k3c if ok4 else 0.0
        w1, wis = abs(d), abs(product(rho, k1))
        w4 = 0.0 if sat else w3
        q1, q2, q3, q4 = mk & finite(w1), mk & finite(w3), mk & finite(wis), mk & finite(w4)
        a1 += w1 if q1 else 0.0
        a2 += w3 if q2 else 0.0
        a3 += wis if q3 else 0.0
        a4 += w4 if q4 else 0.0
        f1 += w1 if q1 & fl else 0.0
        f2 += w3 if q2 & fl else 0.0
        f3 += wis if q3 & fl else 0.0
        f4 += w4 if q4 & fl else 0.0
        x1 = max(x1, bits(w1) if mk & (w1 == w1) else NONE_BITS)  # |weight| >= +0.0: its bits order like it
        x2 = max(x2, bits(w3) if mk & (w3 == w3) else NONE_BITS)
        x3 = max(x3, bits(wis) if mk & (wis == wis) else NONE_BITS)
        x4 = max(x4, bits(w4) if mk & (w4 == w4) else NONE_BITS)
        lost += w3 if sat & finite(w3) else 0.0
        c0 += pack7(mk, fl, sat, mk & (not ok0), mk & (not ok1), mk & (not ok2), mk & (not ok3))
        c1 += np.int64(mk & (not ok4))
        b3 = weight_bin(w3, mk, m1, k0, n_abs)
        b4 = bin_zero if sat else b3  # k3_clamped's |weight|: K3's, or 0 once saturated
        packed[i] = (weight_bin(w1, mk, m1, k0, n_abs) | (b3 << FIELD)
                     | (weight_bin(wis, mk, m1, k0, n_abs) << (2 * FIELD)) | (b4 << (3 * FIELD)))
        w_k3[i] = -em
        code[i] = np.uint8(mk) | (np.uint8(fl) << 1)
        kb = bits(np.inf if w3 != w3 else w3)  # select's rank: NaN first
        hi = max(hi, kb if mk else NONE_BITS)
        hi_f = max(hi_f, kb if fl else NONE_BITS)
    return (v0, v1, v2, v3, v4), (a1, a2, a3, a4), (f1, f2, f3, f4), (x1, x2, x3, x4), c0, c1, lost, hi, hi_f


@njit(inline="always", **JIT)
def count_bins(packed, rows, hist):  # pragma: no cover - compiled
    """Add the packed bins of `rows` rows into hist [BIN_COPIES, 4, bins] (k2 .. k3_clamped): row t into
    copy t % BIN_COPIES, so that increments of one counter do not wait on each other (fused.count_bins)."""
    low = (1 << FIELD) - 1
    for t in range(rows):
        p, c = packed[t], t % BIN_COPIES
        hist[c, 0, p & low] += 1
        hist[c, 1, (p >> FIELD) & low] += 1
        hist[c, 2, (p >> (2 * FIELD)) & low] += 1
        hist[c, 3, (p >> (3 * FIELD)) & low] += 1


@njit(inline="always", **JIT)
def keep(hw, hj, cnt, w, j):  # pragma: no cover - compiled
    """Put token j (|weight| w) in the min-heap hw, hj of the cnt best kept so far (the root: the one to
    drop next, the smallest w, of equal w the latest j); a full heap drops its root. The caller passes
    only tokens that beat the root of a full heap. Returns the new count."""
    size = len(hw)
    if cnt < size:  # sift up from the end
        k = cnt
        while k > 0:
            p = (k - 1) >> 1
            if not (w < hw[p] or (w == hw[p] and j > hj[p])):
                break
            hw[k], hj[k] = hw[p], hj[p]
            k = p
        hw[k], hj[k] = w, j
        return cnt + 1
    k = 0  # replace the root, sift down
    while True:
        c = 2 * k + 1
        if c >= size:
            break
        if c + 1 < size and (hw[c + 1] < hw[c] or (hw[c + 1] == hw[c] and hj[c + 1] > hj[c])):
            c += 1
        if not (hw[c] < w or (hw[c] == w and hj[c] > j)):
            break
        hw[k], hj[k] = hw[c], hj[c]
        k = c
    hw[k], hj[k] = w, j
    return cnt


@njit(inline="always", **JIT)
def select(w_k3, code, rows, c0, j, sel, w_out, fl_out, rows_out):  # pragma: no cover - compiled
    """Number the tokens of a chunk (rows c0 .. c0 + rows) from j on, write their rows to rows_out (unless
    empty) and offer each to the kept sets (sel: top_w, top_j, worst_w, worst_j, counts [2]); with a trace,
    write each token's K3 weight and flagged bit. Returns the next j. A token joins a full set only above
    its root: after the first chunks, a compare per token."""
    top_w, top_j, worst_w, worst_j, n = sel
    trace = len(w_out) > 0
    for t in range(rows):
        c = code[t]
        if c & TOKEN:
            w = abs(w_k3[t])
            w = np.inf if w != w else w  # the sample ranks NaN weights first
            if n[0] < len(top_w) or w > top_w[0]:
                n[0] = keep(top_w, top_j, n[0], w, j)
            if (c & FLAGGED) and (n[1] < len(worst_w) or w > worst_w[0]):
                n[1] = keep(worst_w, worst_j, n[1], w, j)
            if trace:
                w_out[j], fl_out[j] = w_k3[t], (c & FLAGGED) != 0
            if len(rows_out):
                rows_out[j] = c0 + t
            j += 1
    return j


@njit(**SUMS)
def token_pass(s, o, r, m, s_null, o_null, r_null, m_null, mask, log_tau, limit, clamp, abs_grid,
               fsum, icount, hist, scal, top_w, top_j, worst_w, worst_j, w_out, fl_out, rows_out,
               chunk_j):  # pragma: no cover
    """One pass over a batch's rows [n] (log-probs as stored, NaN at nulls; null masks bool [n]).

    Tokens are the rows in the loss (mask) with a reference log-prob, numbered j = 0, 1, ... in row
    order; an absent logp_old means on-policy (o = s). Adds into fsum [4, N_EST] (value sum, |weight| sum,
    flagged |weight| sum, |weight| max), icount [1, N_EST], hist [N_EST, len(ABS_EDGES) + 1]. Keeps in
    top_w, top_j [KEEP_TOP] the tokens of largest |k3 weight| (NaN as +inf, of equal ones the first) and
    in worst_w, worst_j [KEEP_FLAGGED] the same among flagged tokens (estimators.largest's sets). Writes
    (tokens, flagged, clamp_saturated, kept top, kept worst) to scal; with rows_out, w_out, fl_out of length n
    (else 0: not written) each token's row, K3 weight and flagged bit. Without them, a chunk none of whose
    tokens beats a full kept set's root (chunk_sums' maxima) is only counted, and chunk_j [chunks + 1] (unless
    empty) gets the number of the first token of each chunk and the tokens in all (token_rows reads it).
    Returns k3_weight_lost."""
    params = np.array([log_tau, limit, clamp, 0.0, -np.inf])  # chunk_sums' (bad's zero and ninf: see there)
    packed, w_k3, code = np.empty(CHUNK, np.int64), np.empty(CHUNK), np.empty(CHUNK, np.uint8)
    acc = accumulators(abs_grid, top_w, top_j, worst_w, worst_j)
    j = 0
    every = len(w_out) > 0 or len(rows_out) > 0  # a trace: every token goes through select
    for c0 in range(0, len(s), CHUNK):
        c1 = min(c0 + CHUNK, len(s))
        out = chunk_sums(s[c0:c1], o[c0:c1], r[c0:c1], m[c0:c1], s_null[c0:c1], o_null[c0:c1], r_null[c0:c1],
                         m_null[c0:c1], mask[c0:c1], params, abs_grid, packed, w_k3, code)
        if len(chunk_j):
            chunk_j[c0 // CHUNK] = j
        j = add_chunk(out, packed, w_k3, code, c1 - c0, c0, j, acc, every, w_out, fl_out, rows_out)
    if len(chunk_j):
        chunk_j[len(chunk_j) - 1] = j
    return totals(acc, abs_grid, fsum, icount, hist, scal)


@njit(inline="always", **JIT)
def accumulators(abs_grid, top_w, top_j, worst_w, worst_j):  # pragma: no cover - compiled
    """token_pass's running state: value sums [5], |weight| sums [4], flagged |weight| sums [4], |weight|
    maxima as bits [4], counts [8] (tokens, flagged, saturated, non-finite values of k1 .. k3_clamped),
    k3_weight_lost [1], histograms [BIN_COPIES, 4, bins] (the last bin: not binned), and the kept sets
    (top_w, top_j, worst_w, worst_j, their counts [2])."""
    h = np.zeros((BIN_COPIES, 4, abs_grid[2] + 2), np.int64)
    sel = (top_w, top_j, worst_w, worst_j, np.zeros(2, np.int64))
    return (np.zeros(5), np.zeros(4), np.zeros(4), np.full(4, NONE_BITS, np.int64), np.zeros(8, np.int64),
            np.zeros(1), h, sel)


@njit(inline="always", **JIT)
def add_chunk(out, packed, w_k3, code, rows, c0, j, acc, every, w_out, fl_out, rows_out,
              bins=True):  # pragma: no cover - compiled
    """Add chunk_sums' `out` for a chunk (rows c0 .. c0 + rows, its first token numbered j) into acc
    (`accumulators`) and offer its tokens to the kept sets when one of them can join (or `every`: a
    trace); bins: count the chunk's histogram bins (else the caller does). Returns the next token number."""
    v, a, f, x, w0, w1, lo, hi, hi_f = out
    vs, ws, fs, xs, cnt, lost, h, sel = acc
    low = (1 << COUNT_BITS) - 1
    for q in range(5):
        vs[q] += v[q]
    for q in range(4):
        ws[q] += a[q]
        fs[q] += f[q]
        xs[q] = max(xs[q], x[q])
    for q in range(7):
        cnt[q] += (w0 >> (q * COUNT_BITS)) & low
    cnt[7] += w1
    lost[0] += lo
    if bins:
        count_bins(packed, rows, h)
    if every or may_keep(hi, hi_f, w0 & low, (w0 >> COUNT_BITS) & low, sel):
        return select(w_k3, code, rows, c0, j, sel, w_out, fl_out, rows_out)
    return j + (w0 & low)  # the chunk's tokens


@njit(inline="always", **JIT)
def totals(acc, abs_grid, fsum, icount, hist, scal):  # pragma: no cover - compiled
    """Add the running state `acc` into token_pass's outputs; returns k3_weight_lost."""
    vs, ws, fs, xs, cnt, lost, h, sel = acc
    n_abs, n_kept = abs_grid[2], sel[4]
    fsum[F_VALUE] += vs
    icount[I_NONFINITE] += cnt[3:8]
    fsum[F_WABS, 0] += cnt[0]  # k1's |weight| is 1 on every token
    fsum[F_WFLAG, 0] += cnt[1]
    fsum[F_WMAX, 0] = max(fsum[F_WMAX, 0], 1.0) if cnt[0] else fsum[F_WMAX, 0]
    hist[0, abs_bin(1.0, abs_grid[0], abs_grid[1], abs_grid[2])] += cnt[0]
    for e in range(4):
        fsum[F_WABS, e + 1] += ws[e]
        fsum[F_WFLAG, e + 1] += fs[e]
        if xs[e] != NONE_BITS:
            fsum[F_WMAX, e + 1] = max(fsum[F_WMAX, e + 1], from_bits(xs[e], NONE_BITS))
        for k in range(n_abs + 1):
            hist[e + 1, k] += h[0, e, k] + h[1, e, k] + h[2, e, k] + h[3, e, k]
    scal[S_TOKENS], scal[S_FLAGGED], scal[S_CLAMP], scal[S_TOP], scal[S_WORST] = cnt[0], cnt[1], cnt[2], \
        n_kept[0], n_kept[1]
    return lost[0]

@njit(inline="always", **JIT)
def may_keep(hi, hi_f, tokens, flagged, sel):  # pragma: no cover - compiled
    """Whether a chunk (its largest |K3 weight| as bits over its tokens, hi, and over its flagged ones, hi_f;
    its counts) can add a token to a kept set: one not full yet, or one whose root it beats (keep's rule: a
    token joins a full set only above its root; weights >= +0.0, whose bits order like them)."""
    top_w, _, worst_w, _, n = sel
    if tokens == 0:
        return False
    if n[0] < len(top_w) or hi > bits(top_w[0]):
        return True
    return flagged > 0 and (n[1] < len(worst_w) or hi_f > bits(worst_w[0]))


@njit(**JIT)
def token_rows(mask, r_null, chunk_j, picks, out):  # pragma: no cover - compiled
    """out[q] = the row of token picks[q] (ascending token numbers; tokens: rows with mask and a reference,
    numbered in row order), from token_pass's chunk_j: a walk from the chunk of each pick, never back."""
    row, j = 0, 0
    for q in range(len(picks)):
        p, c = picks[q], row // CHUNK
        while chunk_j[c + 1] <= p:
            c += 1
        if c * CHUNK > row:
            row, j = c * CHUNK, chunk_j[c]
        row, j = walk_to(mask, r_null, row, j, p)
        out[q] = row


@njit(**JIT)
def token_rows_at(mask, r_null, chunk_r0, chunk_j, picks, out):  # pragma: no cover - compiled
    """token_rows for chunks of any length: chunk c starts at row chunk_r0[c] with token chunk_j[c] (chunk_j
    [chunks + 1]: its last entry the tokens in all), as the analysis's pass with this one riding in it
    (fused_ride.fused_pass_est) cuts them at sequence starts."""
    row, j, c = 0, 0, 0
    for q in range(len(picks)):
        p = picks[q]
        while chunk_j[c + 1] <= p:
            c += 1
        if chunk_r0[c] > row:
            row, j = chunk_r0[c], chunk_j[c]
        row, j = walk_to(mask, r_null, row, j, p)
        out[q] = row


@njit(inline="always", **JIT)
def walk_to(mask, r_null, row, j, p):  # pragma: no cover - compiled
    """(row, number) of token p, walking rows from `row`, whose token number (or the next token's) is j."""
    while True:
        tok = mask[row] and not r_null[row]
        if tok and j == p:
            return row, j
        j += np.int64(tok)
        row += 1
