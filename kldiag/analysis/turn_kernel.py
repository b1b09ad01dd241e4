"""The per-turn pass compiled (numba, float64 inside): every sum of kldiag.analysis.turns in one loop.

Rows come sorted by sequence then pos; a token's turn follows turns.turn_index's rule (the recorded
turn where present, else the contiguous spans of the loss mask). The per-token maths are those of
kldiag.estimators (Schulman 2020's K3 and its weight); tests/test_turns.py checks the pass against a
numpy reference.
"""

from __future__ import annotations

import numpy as np

from kldiag.analysis import fastexp
from kldiag.jit import njit

MAX_TURN = 16  # turn buckets 0..15, then one overflow bucket for turn 16 and later
N_TURN = MAX_TURN + 1
# Sums per (turn bucket, position bin), in this order; the maximum of |m - o| is kept apart.
SUMS = ("tokens", "n_mismatch", "mismatch_abs", "mismatch", "n_drift", "drift_abs", "drift_k3",
        "n_weight", "weight_k3_abs", "flagged")
G_TOKENS, G_NM, G_MABS, G_M, G_ND, G_DABS, G_DK3, G_NW, G_W, G_FLAG = range(len(SUMS))  # SUMS' order


JIT = dict(cache=True, nogil=True, error_model="numpy")
CHUNK = 256  # rows whose per-token figures are computed in one vectorised loop


@njit(inline="always", **JIT)
def _bad(v, ok, zero, ninf):  # pragma: no cover - compiled
    """A present log-prob that is non-finite or above 0 (a probability above one). zero, ninf: 0.0 and -inf
    from the caller, values the compiler cannot see: against literals, LLVM turns the two compares into a
    floating-point class test that it does not vectorise (_tokens' second loop ran 1.5x slower)."""
    return ok & (not ((v <= zero) & (v > ninf)))


@njit(inline="always", **JIT)
def _tokens(s, o, o_ok, r, r_ok, m, m_ok, log_tau, limit, clamp, zero, ninf, mm, x, k3x, w, bad):  # pragma: no cover
    """Each row's figures of a chunk (column slices) into mm, x, k3x, w, bad: m - o or NaN, x = s - o, K3
    of pi_theta vs pi_old, |k3 weight| or NaN, flagged; estimators.py's maths per present column, with
    fastexp's expm1 (within 2 ulp of numpy's). Two branch-free loops over range(len) of slices, which
    LLVM vectorises; one loop with five outputs was not (too many arrays to check for overlap): 3x slower."""
    for i in range(len(s)):
        sv, rv, mv = np.float64(s[i]), np.float64(r[i]), np.float64(m[i])  # float64 inside
        ov = np.float64(o[i]) if o_ok[i] else sv
        mm[i] = mv - ov if m_ok[i] else np.nan
        xv = sv - ov
        x[i] = xv
        k3x[i] = fastexp.expm1(-xv) + xv
        w[i] = abs(fastexp.expm1(rv - sv))
    for i in range(len(s)):
        sv, rv, mv = np.float64(s[i]), np.float64(r[i]), np.float64(m[i])
        ov = np.float64(o[i]) if o_ok[i] else sv
        d, wv = rv - sv, w[i]
        k3d = (-wv if d < 0 else wv) - d  # expm1(d) - d: expm1 keeps d's sign
        bad[i] = (_bad(sv, True, zero, ninf) | _bad(ov, o_ok[i], zero, ninf) | _bad(mv, m_ok[i], zero, ninf)
                  | (r_ok[i] & (_bad(rv, True, zero, ninf) | (d > log_tau) | (wv > limit) | (k3d > clamp))))
        w[i] = wv if r_ok[i] else np.nan


@njit(inline="always", **JIT)
def _flush(grid, gmax, steps, b, pb, si, acc, amax):  # pragma: no cover - compiled
    """Add the sums acc (SUMS' order) of a run of tokens of one (step, turn bucket, position bin) to grid,
    gmax and steps."""
    for q in range(len(acc)):
        grid[b, pb, q] += acc[q]
    gmax[b, pb] = max(gmax[b, pb], amax)
    steps[si, b, 0] += acc[G_MABS]
    steps[si, b, 1] += acc[G_NM]
    if pb == 0:  # the turn's first token
        steps[si, b, 2] += acc[G_MABS]
        steps[si, b, 3] += acc[G_NM]


@njit(inline="always", **JIT)
def _acc(mm, x, kx, w, bad, acc):  # pragma: no cover - compiled
    """One token's figures added to the cell's register-held SUMS, the cell's max |m - o| and its
    sequence's |m - o| sum and count (acc: SUMS, amax, seq_abs, seq_n); non-finite values are left out."""
    n_tok, n_m, s_mabs, s_m, n_d, s_dabs, s_dk3, n_w, s_w, n_flag, amax, seq_abs, seq_n = acc
    a = abs(mm)
    if np.isfinite(mm):
        n_m, s_mabs, s_m = n_m + 1.0, s_mabs + a, s_m + mm
        amax = max(amax, a)
        seq_abs, seq_n = seq_abs + a, seq_n + 1.0
    if np.isfinite(x) and np.isfinite(kx):
        n_d, s_dabs, s_dk3 = n_d + 1.0, s_dabs + abs(x), s_dk3 + kx
    if np.isfinite(w):
        n_w, s_w = n_w + 1.0, s_w + w
    return (n_tok + 1.0, n_m, s_mabs, s_m, n_d, s_dabs, s_dk3, n_w, s_w, n_flag + bad, amax, seq_abs, seq_n)


@njit(**JIT)
def fold(new_seq, mask, rec, step, lo, s, o, o_ok, r, r_ok, m, m_ok, log_tau, limit, clamp, zero, ninf,
         grid, gmax, steps, seqs, spans):  # pragma: no cover - compiled
    """One pass over rows sorted by sequence then pos: each token's turn (turn_index's rule; rec [n], or
    [0] when no turn is recorded), then grid [N_TURN, N_POS, SUMS] and gmax (max |m - o|), steps
    [n_steps, N_TURN, 4] (|m - o| sum and count, and at turns' first tokens; a row's step index is
    step[i] - lo), seqs [4] (single-turn sequences, multi-turn ones, single-turn |m - o| count and sum),
    spans [:, 5] (row, |m - o| at the first token, body sum and count, turn) of turns >= 1.
    Returns the number of spans written. zero, ninf: 0.0 and -inf (_bad says why they are arguments).

    Rows go in chunks of CHUNK: their figures in a vectorised loop (_tokens), then the turn walk, whose
    sums stay in registers while tokens fall in the same cell (_flush when it changes): sums held in
    memory would chain every token."""
    n, n_spans, seen, base, pit, prev_in, prev_rec, seq_max, seq_abs, seq_n, cur = (
        len(mask), 0, 0, 0, -1, False, -1, -1, 0.0, 0.0, -1)
    has_rec = len(rec) > 0
    mm_, x_, k_, w_ = np.empty(CHUNK), np.empty(CHUNK), np.empty(CHUNK), np.empty(CHUNK)
    bad_ = np.empty(CHUNK, np.bool_)
    amax = -np.inf
    n_tok = n_m = s_mabs = s_m = n_d = s_dabs = s_dk3 = n_w = s_w = n_flag = 0.0  # the cell's SUMS
    cb, cpb, csi = -1, -1, -1  # the cell whose sums acc holds
    sp_abs, sp_n = 0.0, 0.0  # the current span's body sums
    for c0 in range(0, n, CHUNK):
        c1 = min(c0 + CHUNK, n)
        _tokens(s[c0:c1], o[c0:c1], o_ok[c0:c1], r[c0:c1], r_ok[c0:c1], m[c0:c1], m_ok[c0:c1], log_tau, limit,
                clamp, zero, ninf, mm_, x_, k_, w_, bad_)
        i = c0
        while i < c1:
            if i == 0 or new_seq[i]:
                if seq_max == 0:  # close the sequence before: single-turn ...
                    seqs[0], seqs[2], seqs[3] = seqs[0] + 1.0, seqs[2] + seq_n, seqs[3] + seq_abs
                elif seq_max > 0:  # ... or multi-turn
                    seqs[1] += 1.0
                if cur >= 0:
                    spans[cur, 2], spans[cur, 3] = sp_abs, sp_n
                base, prev_in, prev_rec, seq_max, seq_abs, seq_n, cur = seen, False, -1, -1, 0.0, 0.0, -1
            if not mask[i]:
                prev_in = False
                i += 1
                continue
            rc = rec[i] if has_rec else -1
            if not prev_in or rc != prev_rec:  # a turn starts
                seen, pit = seen + 1, 0
            else:
                pit += 1
            turn = rc if rc >= 0 else seen - base - 1
            prev_in, prev_rec, seq_max = True, rc, max(seq_max, turn)
            b, pb = min(turn, MAX_TURN), (pit if pit < 3 else (3 if pit < 8 else (4 if pit < 32 else 5)))
            si = step[i] - lo
            if b != cb or pb != cpb or si != csi:
                if cb >= 0:
                    _flush(grid, gmax, steps, cb, cpb, csi,
                           (n_tok, n_m, s_mabs, s_m, n_d, s_dabs, s_dk3, n_w, s_w, n_flag), amax)
                cb, cpb, csi, amax = b, pb, si, -np.inf
                n_tok = n_m = s_mabs = s_m = n_d = s_dabs = s_dk3 = n_w = s_w = n_flag = 0.0
            k = i - c0
            mm = mm_[k]
            a = abs(mm)
            n_tok, n_m, s_mabs, s_m, n_d, s_dabs, s_dk3, n_w, s_w, n_flag, amax, seq_abs, seq_n = _acc(
                mm, x_[k], k_[k], w_[k], bad_[k],
                (n_tok, n_m, s_mabs, s_m, n_d, s_dabs, s_dk3, n_w, s_w, n_flag, amax, seq_abs, seq_n))
            if turn >= 1 and pit == 0:
                if cur >= 0:
                    spans[cur, 2], spans[cur, 3] = sp_abs, sp_n
                cur = n_spans if n_spans < spans.shape[0] else -1  # the caller sizes spans: never -1
                sp_abs, sp_n = 0.0, 0.0
                if cur >= 0:
                    spans[cur, 0], spans[cur, 1], spans[cur, 4] = i, a, turn
                    n_spans += 1
            elif turn >= 1 and np.isfinite(mm) and cur >= 0:
                sp_abs, sp_n = sp_abs + a, sp_n + 1.0
            # the rows after it in the same cell (same sequence, turn and position bin): only their sums
            end = 8 if pb == 3 else (32 if pb == 4 else (1 << 62 if pb == 5 else 0))
            body = turn >= 1 and cur >= 0
            while (pit + 1 < end and i + 1 < c1 and mask[i + 1] and not new_seq[i + 1]
                   and (not has_rec or rec[i + 1] == prev_rec)):
                i, pit = i + 1, pit + 1
                k = i - c0
                mm = mm_[k]
                n_tok, n_m, s_mabs, s_m, n_d, s_dabs, s_dk3, n_w, s_w, n_flag, amax, seq_abs, seq_n = _acc(
                    mm, x_[k], k_[k], w_[k], bad_[k],
                    (n_tok, n_m, s_mabs, s_m, n_d, s_dabs, s_dk3, n_w, s_w, n_flag, amax, seq_abs, seq_n))
                if body and np.isfinite(mm):
                    sp_abs, sp_n = sp_abs + abs(mm), sp_n + 1.0
            i += 1
    if cb >= 0:
        _flush(grid, gmax, steps, cb, cpb, csi, (n_tok, n_m, s_mabs, s_m, n_d, s_dabs, s_dk3, n_w, s_w, n_flag), amax)
    if seq_max == 0:  # close the last sequence
        seqs[0], seqs[2], seqs[3] = seqs[0] + 1.0, seqs[2] + seq_n, seqs[3] + seq_abs
    elif seq_max > 0:
        seqs[1] += 1.0
    if cur >= 0:
        spans[cur, 2], spans[cur, 3] = sp_abs, sp_n
    return n_spans


@njit(**JIT)
def seq_starts(step, iteration, seq, out):  # pragma: no cover - compiled
    """out[i] (bool [n]): row i's (step, iteration, seq) differs from row i - 1's (True at row 0)."""
    for i in range(len(seq)):
        out[i] = i == 0 or step[i] != step[i - 1] or iteration[i] != iteration[i - 1] or seq[i] != seq[i - 1]


@njit(**JIT)
def in_order(new, step, iteration, seq, pos):  # pragma: no cover - compiled
    """True when rows are grouped by sequence (new [n]: their starts) with pos rising inside one and the
    sequences' (step, iteration, seq) strictly rising (the recorder's order: each sequence once).
    False says only that this quick test cannot tell."""
    head = -1
    for i in range(len(new)):
        if new[i]:
            if head >= 0:
                a, b = (step[head], iteration[head], seq[head]), (step[i], iteration[i], seq[i])
                if not (a[0] < b[0] or (a[0] == b[0] and (a[1] < b[1] or (a[1] == b[1] and a[2] < b[2])))):
                    return False
            head = i
        elif pos[i] <= pos[i - 1]:
            return False
    return True


@njit(**JIT)
def turn_starts(new, mask, rec):  # pragma: no cover - compiled
    """An upper bound on the turn starts of the rows (fold's spans buffer): every sequence start, every
    rise of the mask, and with a recorded turn (rec [n], else [0]) every change of it."""
    count = 0
    for i in range(len(new)):
        count += new[i]
        if i:
            count += mask[i] and not mask[i - 1]
            if len(rec):
                count += rec[i] != rec[i - 1]
    return count


@njit(**JIT)
def starts_in_order(step, iteration, seq, pos, out):  # pragma: no cover - compiled
    """seq_starts and in_order in one pass: fills out (bool [n]), returns in_order's answer.

    The rows' pass is branch-free (LLVM vectorises it): each start and, inside a sequence, whether pos
    rises; only the starts' keys are compared in order, in a second loop over the few starts."""
    n = len(seq)
    if n == 0:
        return True
    out[0] = True
    fall = 0
    for i in range(1, n):
        new = (step[i] != step[i - 1]) | (iteration[i] != iteration[i - 1]) | (seq[i] != seq[i - 1])
        out[i] = new
        fall += np.int64((not new) & (pos[i] <= pos[i - 1]))
    if fall:
        return False
    head = 0
    for i in range(1, n):
        if out[i]:
            a0, a1, a2, b0, b1, b2 = step[head], iteration[head], seq[head], step[i], iteration[i], seq[i]
            if not (a0 < b0 or (a0 == b0 and (a1 < b1 or (a1 == b1 and a2 < b2)))):
                return False
            head = i
    return True
