"""The per-turn pass compiled (numba, float64 inside): every sum of kldiag.analysis.reducers.turns in one loop.

Rows come sorted by sequence then pos; a token's turn follows turns.turn_index's rule (the recorded
turn where present, else the contiguous spans of the loss mask). The per-token maths are those of
kldiag.estimators (Schulman 2020's K3 and its weight); tests/test_turns.py checks the pass against a
numpy reference.
"""

from __future__ import annotations

import numpy as np

from kldiag.analysis.kernels import fastexp
from kldiag.jit import njit

MAX_TURN = 16  # turn buckets 0..15, then one overflow bucket for turn 16 and later
N_TURN = MAX_TURN + 1
N_POS = 6  # position-in-turn bins: 0, 1, 2, 3-7, 8-31, 32+ (_piece; turns.POS_EDGES)
# Sums per (turn bucket, position bin), in this order; the maximum of |m - o| is kept apart.
SUMS = ("tokens", "n_mismatch", "mismatch_abs", "mismatch", "n_drift", "drift_abs", "drift_k3",
        "n_weight", "weight_k3_abs", "flagged")
G_TOKENS, G_NM, G_MABS, G_M, G_ND, G_DABS, G_DK3, G_NW, G_W, G_FLAG = range(len(SUMS))  # SUMS' order


JIT = dict(cache=True, nogil=True, error_model="numpy")
SUMS_JIT = dict(JIT, fastmath={"reassoc", "contract", "nsz"})  # vectorised sums; NaN and inf kept (fused.py)
CHUNK = 256  # rows whose per-token figures are computed in one vectorised loop


@njit(inline="always", **JIT)
def _bad(v, ok, zero, ninf):  # pragma: no cover - compiled
    """A present log-prob that is non-finite or above 0 (a probability above one). zero, ninf: 0.0 and -inf
    from the caller, values the compiler cannot see: against literals, LLVM turns the two compares into a
    floating-point class test that it does not vectorise (_tokens' second loop ran 1.5x slower)."""
    return ok & (not ((v <= zero) & (v > ninf)))


@njit(inline="always", **JIT)
def _tokens(s, o, o_ok, r, r_ok, m, m_ok, log_tau, limit, clamp, zero, ninf, mm, x, k3x, w, counts,
            has_o, has_r):  # pragma: no cover
    """Each row's figures of a chunk (column slices), ready to sum: mm = m - o, x = |s - o|, k3x = K3 of pi_theta
    vs pi_old, w = |k3 weight|, each +0.0 where not finite (or its column null); counts = _pack(m - o finite,
    x and k3x finite, w finite, flagged). estimators.py's maths per present column, with fastexp's expm1
    (within 2 ulp of numpy's). One branch-free loop over range(len) of slices, which LLVM vectorises; its
    two expm1 per row are most of its time (about 3.6 ns a row on one core). has_o, has_r: constants (fold's
    _tokens_of passes literals), False where no row has logp_old (then o = s, x = 0: K3 is x itself, +0.0 or
    NaN as expm1(-x) + x gives) or no row has logp_ref (its expm1 is never read): the compiler drops that expm1."""
    for i in range(len(s)):
        sv, rv, mv = np.float64(s[i]), np.float64(r[i]), np.float64(m[i])  # float64 inside
        ov = np.float64(o[i]) if o_ok[i] else sv
        v, xv, d = mv - ov, sv - ov, rv - sv
        kv = fastexp.expm1(-xv) + xv if has_o else xv
        e = fastexp.expm1(d) if has_r else zero
        wv = abs(e)
        ok_m, ok_d, ok_w = m_ok[i] & finite(v), finite(xv) & finite(kv), r_ok[i] & finite(wv)
        bad = (_bad(sv, True, zero, ninf) | _bad(ov, o_ok[i], zero, ninf) | _bad(mv, m_ok[i], zero, ninf)
               | (r_ok[i] & (_bad(rv, True, zero, ninf) | (d > log_tau) | (wv > limit) | (e - d > clamp))))
        mm[i], x[i], k3x[i], w[i] = _kept(v, ok_m), _kept(abs(xv), ok_d), _kept(kv, ok_d), _kept(wv, ok_w)
        counts[i] = _pack(ok_m, ok_d, ok_w, bad)


@njit(inline="always", **SUMS_JIT)
def _tokens_of(s, o, o_ok, r, r_ok, m, m_ok, log_tau, limit, clamp, zero, ninf, mm, x, k3x, w, counts, has_o,
               has_r):  # pragma: no cover - compiled
    """_tokens with has_o and has_r as constants: one loop per case, each without the expm1 it does not need
    (a run with no reference model or on-policy saves about 1.5 ns a row for each)."""
    if has_o and has_r:
        _tokens(s, o, o_ok, r, r_ok, m, m_ok, log_tau, limit, clamp, zero, ninf, mm, x, k3x, w, counts, True, True)
    elif has_r:
        _tokens(s, o, o_ok, r, r_ok, m, m_ok, log_tau, limit, clamp, zero, ninf, mm, x, k3x, w, counts, False, True)
    elif has_o:
        _tokens(s, o, o_ok, r, r_ok, m, m_ok, log_tau, limit, clamp, zero, ninf, mm, x, k3x, w, counts, True, False)
    else:
        _tokens(s, o, o_ok, r, r_ok, m, m_ok, log_tau, limit, clamp, zero, ninf, mm, x, k3x, w, counts, False, False)


@njit(inline="always", **JIT)
def finite(v):  # pragma: no cover - compiled
    """math.isfinite, safe under fastmath "reassoc" (fused.finite says why)."""
    return abs(v) < np.inf


@njit(inline="always", **JIT)
def _kept(v, ok):  # pragma: no cover - compiled
    """v where ok, else +0.0, by masking its bits: a select LLVM vectorises (two `a if ok else b` on one
    condition in a loop kept it from vectorising the loop at all: 4x slower)."""
    return np.int64(np.float64(v).view(np.int64) & -np.int64(ok)).view(np.float64)


@njit(inline="always", **SUMS_JIT)
def _cell_sums(mm, x, kx, w, counts):  # pragma: no cover - compiled
    """SUMS of a run of rows of one cell (chunk buffer slices from _tokens) and the bits of their max |m - o|
    (valid where their count of finite m - o is not 0). Branch-free over range(len): LLVM vectorises it."""
    s_mabs = s_m = s_dabs = s_dk3 = s_w = 0.0
    cnt, amax = 0, np.int64(0)
    for q in range(len(mm)):
        v = mm[q]
        s_mabs += abs(v)
        s_m += v
        amax = max(amax, np.float64(abs(v)).view(np.int64))  # |.|'s bits order like it
        s_dabs += x[q]
        s_dk3 += kx[q]
        s_w += w[q]
        cnt += counts[q]
    return _unpacked(len(mm), cnt, s_mabs, s_m, s_dabs, s_dk3, s_w), amax


COUNT_BITS = 16  # bits per count packed in a word: a run of one cell is at most CHUNK rows
if not CHUNK < 1 << (COUNT_BITS - 1):
    raise ImportError("turn_kernel.CHUNK rows must fit COUNT_BITS")


@njit(inline="always", **JIT)
def _pack(a, b, c, d):  # pragma: no cover - compiled
    """Four 0/1 flags as COUNT_BITS-bit fields of one int64: summing words sums each field."""
    return np.int64(a) | (np.int64(b) << COUNT_BITS) | (np.int64(c) << 2 * COUNT_BITS) | (np.int64(d) << 3 * COUNT_BITS)


@njit(inline="always", **JIT)
def _unpacked(n, counts, s_mabs, s_m, s_dabs, s_dk3, s_w):  # pragma: no cover - compiled
    """SUMS (their order) of a run of n rows from its packed counts (n_m, n_d, n_w, flagged) and sums."""
    low = (1 << COUNT_BITS) - 1
    return (np.float64(n), np.float64(counts & low), s_mabs, s_m, np.float64((counts >> COUNT_BITS) & low), s_dabs,
            s_dk3, np.float64((counts >> 2 * COUNT_BITS) & low), s_w, np.float64(counts >> 3 * COUNT_BITS))


@njit(**SUMS_JIT)
def fold(key_step, iteration, seq, pos, step, lo, mask, rec, s, o, o_ok, r, r_ok, m, m_ok, has, params, check,
         grid, gmax, steps, seqs, keep):  # pragma: no cover - compiled
    """One pass over rows grouped by sequence and ordered by pos inside one: sequence starts (a change of
    (key_step, iteration, seq)), each token's turn (turn_index's rule; rec [n], or [0] when no turn is
    recorded), then grid [N_TURN, N_POS, SUMS] and gmax (max |m - o|), steps [n_steps, N_TURN, 4] (|m - o|
    sum and count, and at turns' first tokens; a row's step index is step[i] - lo), seqs [4] (single-turn
    sequences, multi-turn ones, single-turn |m - o| count and sum). params: log(tau), weight_limit, clamp,
    0.0, -inf (_bad says why the last two are arguments). Returns (spans [k, 5]: row, |m - o| at the first
    token, body sum and count, turn; of turns >= 1 whose first |m - o| is finite and can be among the `keep`
    largest (tied with or above the keep-th: _compact), their count k), or count -1
    when `check` and the rows are not in the recorder's order (each sequence once, their (step, iteration,
    seq) rising, pos rising inside one; a step outside steps' rows counts as out of order): the sums are then
    incomplete, and the caller orders the rows and folds them again.

    Rows go in chunks of CHUNK: their figures in vectorised loops (_tokens), their events (a sequence
    start, a rise or fall of the mask, a change of the recorded turn) in another, then a walk over the
    events only: rows between two events are one piece of a turn (or of rows outside the loss), cut at
    the position bins' edges into runs of one cell, whose sums _cell_sums takes in one loop."""
    n, has_rec, n_steps = len(mask), len(rec) > 0, steps.shape[0]
    has_o, has_r = has[0] != 0, has[1] != 0
    log_tau, limit, clamp, zero, ninf = params[0], params[1], params[2], params[3], params[4]
    mm_, x_, k_, w_ = np.empty(CHUNK), np.empty(CHUNK), np.empty(CHUNK), np.empty(CHUNK)
    cnt_, new_, ev_ = np.empty(CHUNK, np.int64), np.empty(CHUNK, np.bool_), np.empty(CHUNK, np.bool_)
    at_ = np.empty(CHUNK + 1, np.int64)
    grid, gmax, steps = grid.reshape(-1), gmax.reshape(-1), steps.reshape(-1)  # _piece says why flat
    spans = np.empty((max(16, min(8 * keep, n >> 6)), 5))  # _compact keeps it small
    floor = -np.inf if keep > 0 else np.inf  # a turn whose first |m - o| is below it is no example
    n_spans, seen, base, pit, head = 0, 0, 0, 0, -1
    in_turn, seq_max, seq_abs, seq_n, cur, b, st = False, -1, 0.0, 0.0, -1, 0, np.uint64(0)
    for c0 in range(0, n, CHUNK):
        c1 = min(c0 + CHUNK, n)
        _tokens_of(s[c0:c1], o[c0:c1], o_ok[c0:c1], r[c0:c1], r_ok[c0:c1], m[c0:c1], m_ok[c0:c1], log_tau, limit,
                   clamp, zero, ninf, mm_, x_, k_, w_, cnt_, has_o, has_r)
        p0 = max(c0, 1)  # rows compared with the row before
        if c0 == 0:
            new_[0], ev_[0] = True, True
        fall = _changes(key_step[p0:c1], key_step[p0 - 1:c1 - 1], iteration[p0:c1], iteration[p0 - 1:c1 - 1],
                        seq[p0:c1], seq[p0 - 1:c1 - 1], pos[p0:c1], pos[p0 - 1:c1 - 1], mask[p0:c1],
                        mask[p0 - 1:c1 - 1], new_[p0 - c0:], ev_[p0 - c0:])
        if has_rec:
            _rec_changes(rec[p0:c1], rec[p0 - 1:c1 - 1], ev_[p0 - c0:])
        if check and fall:
            return spans, -1
        n_ev = _where(ev_[:c1 - c0], at_)
        at_[n_ev] = c1 - c0
        if in_turn and at_[0] > 0:  # the chunk goes on with the turn of the chunk before
            pit, p_abs, p_n, f_abs, f_n = _piece(0, at_[0], pit, b, mm_, x_, k_, w_, cnt_, grid, gmax)
            _add_piece(steps, st, spans, cur, p_abs, p_n, f_abs, f_n)
            seq_abs, seq_n = seq_abs + p_abs + f_abs, seq_n + p_n + f_n
        for j in range(n_ev):
            k, i = at_[j], c0 + at_[j]
            if new_[k]:
                if check and ((head >= 0 and not _rising(key_step, iteration, seq, head, i))
                              or not 0 <= step[i] - lo < n_steps):
                    return spans, -1
                _close(seq_max, seq_abs, seq_n, seqs)
                head, base, seq_max, seq_abs, seq_n = i, seen, -1, 0.0, 0.0
            in_turn = mask[i]
            if not in_turn:
                continue
            rc = rec[i] if has_rec else -1
            seen += 1
            turn = rc if rc >= 0 else seen - base - 1
            seq_max, b, cur = max(seq_max, turn), min(turn, MAX_TURN), -1
            st = np.uint64(((step[i] - lo) * N_TURN + b) * 4)  # the turn's row of steps (flat)
            pit, p_abs, p_n, f_abs, f_n = _piece(k, at_[j + 1], 0, b, mm_, x_, k_, w_, cnt_, grid, gmax)
            if turn >= 1 and f_n > 0 and f_abs >= floor:  # an example candidate: row, first |m - o|, body, turn
                if n_spans == len(spans):  # full: only those that can still be kept stay (no span is open)
                    n_spans, floor = _compact(spans, n_spans, keep, floor)
                    if n_spans == len(spans):
                        spans = _grown(spans, n_spans)
                if f_abs >= floor:  # still, against the floor _compact may have raised
                    cur, n_spans = n_spans, n_spans + 1
                    spans[cur, 0], spans[cur, 1], spans[cur, 2], spans[cur, 3], spans[cur, 4] = (i, f_abs, p_abs,
                                                                                                 p_n, turn)
            _add_piece(steps, st, spans, -1, p_abs, p_n, f_abs, f_n)  # the span's body is in it already
            seq_abs, seq_n = seq_abs + p_abs + f_abs, seq_n + p_n + f_n
    _close(seq_max, seq_abs, seq_n, seqs)
    return spans, n_spans


@njit(inline="always", **JIT)
def _close(seq_max, seq_abs, seq_n, seqs):  # pragma: no cover - compiled
    """Count the sequence just ended: single-turn (with its |m - o| sum and count), multi-turn, or neither."""
    if seq_max == 0:
        seqs[0], seqs[2], seqs[3] = seqs[0] + 1.0, seqs[2] + seq_n, seqs[3] + seq_abs
    elif seq_max > 0:
        seqs[1] += 1.0


@njit(**JIT)
def _compact(spans, n_spans, keep, floor):  # pragma: no cover - compiled
    """Keep the spans whose first |m - o| is tied with or above the keep-th largest (the only ones that can be
    among the keep largest once more spans come: the keep-th largest only rises), in order, at the front of
    spans; returns (their count, the new floor). Called between turns: no span is open."""
    kth = np.sort(spans[:n_spans, 1])[n_spans - keep] if n_spans >= keep else floor
    j = 0
    for i in range(n_spans):
        if spans[i, 1] >= kth:
            spans[j] = spans[i]
            j += 1
    return j, max(floor, kth)


@njit(**JIT)
def _grown(spans, n_spans):  # pragma: no cover - compiled
    out = np.empty((2 * len(spans), spans.shape[1]))
    out[:n_spans] = spans[:n_spans]
    return out


@njit(inline="always", **JIT)
def _rising(key_step, iteration, seq, h, i):  # pragma: no cover - compiled
    """Row i's (step, iteration, seq) above row h's."""
    a0, a1, a2, b0, b1, b2 = key_step[h], iteration[h], seq[h], key_step[i], iteration[i], seq[i]
    return a0 < b0 or (a0 == b0 and (a1 < b1 or (a1 == b1 and a2 < b2)))


@njit(inline="always", **JIT)
def _changes(st, st0, it, it0, sq, sq0, ps, ps0, mk, mk0, new, ev):  # pragma: no cover - compiled
    """new and ev of rows (slices; *0: the rows before them): a sequence starts, an event (a sequence start or
    the mask changes); returns the count of rows whose pos does not rise inside a sequence. Branch-free."""
    fall = 0
    for q in range(len(st)):
        nw = (st[q] != st0[q]) | (it[q] != it0[q]) | (sq[q] != sq0[q])
        new[q] = nw
        ev[q] = nw | (mk[q] != mk0[q])
        fall += np.int64((not nw) & (ps[q] <= ps0[q]))
    return fall


@njit(inline="always", **JIT)
def _rec_changes(rc, rc0, ev):  # pragma: no cover - compiled
    for q in range(len(rc)):
        ev[q] |= rc[q] != rc0[q]


@njit(inline="always", **JIT)
def _where(flags, at):  # pragma: no cover - compiled
    """at[:k] = the indices of the True flags; returns k. Branch-free (a store at every row)."""
    k = 0
    for q in range(len(flags)):
        at[k] = q
        k += np.int64(flags[q])
    return k


@njit(inline="always", **JIT)
def _short_sums(mm, x, kx, w, counts, k0, k1):  # pragma: no cover - compiled
    """_cell_sums of rows k0..k1 of the chunk buffers in a plain loop: for runs of one or two rows, slicing five
    arrays and entering a vectorised loop cost more."""
    s_mabs = s_m = s_dabs = s_dk3 = s_w = 0.0
    cnt, amax = 0, np.int64(0)
    for j in range(k0, k1):
        q = np.uint64(j)  # unsigned: no wraparound check on each load
        v = mm[q]
        s_mabs += abs(v)
        s_m += v
        amax = max(amax, np.float64(abs(v)).view(np.int64))
        s_dabs += x[q]
        s_dk3 += kx[q]
        s_w += w[q]
        cnt += counts[q]
    return _unpacked(k1 - k0, cnt, s_mabs, s_m, s_dabs, s_dk3, s_w), amax


LONG = 3  # rows of a cell's run from which _cell_sums on slices beats _short_sums (2.5x at 8 rows)


@njit(inline="always", **JIT)
def _add_cell(grid, gmax, b, pb, acc, amax):  # pragma: no cover - compiled
    """Add a run's SUMS (acc) and max |m - o| (amax's bits, valid where acc's count of finite m - o is not 0) to
    cell (b, pb) of grid [N_TURN * N_POS * SUMS] and gmax [N_TURN * N_POS], flat and indexed by unsigned ints:
    numba checks every signed index of every axis for wraparound, and those checks cost more than the sums."""
    c = np.uint64(b * N_POS + pb)
    g = c * np.uint64(len(SUMS))
    grid[g], grid[g + 1], grid[g + 2], grid[g + 3], grid[g + 4] = (
        grid[g] + acc[0], grid[g + 1] + acc[1], grid[g + 2] + acc[2], grid[g + 3] + acc[3], grid[g + 4] + acc[4])
    grid[g + 5], grid[g + 6], grid[g + 7], grid[g + 8], grid[g + 9] = (
        grid[g + 5] + acc[5], grid[g + 6] + acc[6], grid[g + 7] + acc[7], grid[g + 8] + acc[8], grid[g + 9] + acc[9])
    gmax[c] = max(gmax[c], np.int64(amax).view(np.float64) if acc[G_NM] > 0 else -np.inf)


@njit(inline="always", **JIT)
def _piece(k0, k1, pit, b, mm_, x_, k_, w_, cnt_, grid, gmax):  # pragma: no cover - compiled
    """Add chunk rows k0..k1 of one turn (turn bucket b; pit: the position of row k0 in it) to their cells.
    Returns (pit past the rows, the |m - o| sum and count of the rows after the turn's first token, and those
    of its first token when row k0 is it: 0.0, 0.0 otherwise)."""
    p_abs, p_n, first_abs, first_n = 0.0, 0.0, 0.0, 0.0
    while pit < 3 and k0 < k1:  # positions 0, 1 and 2: a cell each
        v = mm_[k0]
        acc = _unpacked(1, cnt_[k0], abs(v), v, x_[k0], k_[k0], w_[k0])
        _add_cell(grid, gmax, b, pit, acc, np.float64(abs(v)).view(np.int64))
        if pit == 0:  # the turn's first token
            first_abs, first_n = acc[G_MABS], acc[G_NM]
        else:
            p_abs, p_n = p_abs + acc[G_MABS], p_n + acc[G_NM]
        pit, k0 = pit + 1, k0 + 1
    # The longer bins, in turn: a run of one cell each. A loop, not one over the bins' (pb, hi) tuple: numba
    # unrolls that, and the three copies of both sums (twice, fold inlines _piece twice) made fold 25% slower.
    while k0 < k1:
        pb = 3 if pit < 8 else (4 if pit < 32 else 5)
        hi = 8 if pit < 8 else (32 if pit < 32 else 1 << 62)  # the bin's end (POS_EDGES)
        k = min(k1, k0 + hi - pit)
        if k - k0 >= LONG:
            acc, amax = _cell_sums(mm_[k0:k], x_[k0:k], k_[k0:k], w_[k0:k], cnt_[k0:k])
        else:
            acc, amax = _short_sums(mm_, x_, k_, w_, cnt_, k0, k)
        _add_cell(grid, gmax, b, pb, acc, amax)
        p_abs, p_n = p_abs + acc[G_MABS], p_n + acc[G_NM]
        pit, k0 = pit + (k - k0), k
    return pit, p_abs, p_n, first_abs, first_n


@njit(inline="always", **JIT)
def _add_piece(steps, st, spans, cur, p_abs, p_n, first_abs, first_n):  # pragma: no cover - compiled
    """Add a turn piece's |m - o| sums (_piece's: after its first token, and at it) to its step's row of steps
    (flat, at st) and to the body of example span `cur` (-1: none)."""
    steps[st], steps[st + 1] = steps[st] + p_abs + first_abs, steps[st + 1] + p_n + first_n
    steps[st + 2], steps[st + 3] = steps[st + 2] + first_abs, steps[st + 3] + first_n
    if cur >= 0:
        spans[cur, 2] += p_abs
        spans[cur, 3] += p_n


@njit(**JIT)
def seq_starts(step, iteration, seq, out):  # pragma: no cover - compiled
    """out[i] (bool [n]): row i's (step, iteration, seq) differs from row i - 1's (True at row 0)."""
    for i in range(len(seq)):
        out[i] = i == 0 or step[i] != step[i - 1] or iteration[i] != iteration[i - 1] or seq[i] != seq[i - 1]


@njit(**JIT)
def seq_bounds(step, iteration, seq):  # pragma: no cover - compiled
    """(the second sequence's first row, the last sequence's first row) of rows grouped by sequence; (n, 0)
    for one sequence of n rows. Scans the first and the last sequence only."""
    n = len(seq)
    head = 1
    while head < n and step[head] == step[0] and iteration[head] == iteration[0] and seq[head] == seq[0]:
        head += 1
    cut = n - 1
    while cut > 0 and step[cut - 1] == step[n - 1] and iteration[cut - 1] == iteration[n - 1] and seq[cut - 1] == seq[n - 1]:
        cut -= 1
    return min(head, n), max(cut, 0)
