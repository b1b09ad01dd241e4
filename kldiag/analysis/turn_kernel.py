"""The per-turn pass compiled (numba, float64 inside): every sum of kldiag.analysis.turns in one loop.

Rows come sorted by sequence then pos; a token's turn follows turns.turn_index's rule (the recorded
turn where present, else the contiguous spans of the loss mask). The per-token maths are those of
kldiag.estimators (Schulman 2020's K3 and its weight); tests/test_turns.py checks the pass against a
numpy reference.
"""

from __future__ import annotations

import numpy as np
from numba import njit

MAX_TURN = 16  # turn buckets 0..15, then one overflow bucket for turn 16 and later
N_TURN = MAX_TURN + 1
# Sums per (turn bucket, position bin), in this order; the maximum of |m - o| is kept apart.
SUMS = ("tokens", "n_mismatch", "mismatch_abs", "mismatch", "n_drift", "drift_abs", "drift_k3",
        "n_weight", "weight_k3_abs", "flagged")
G_TOKENS, G_NM, G_MABS, G_M, G_ND, G_DABS, G_DK3, G_NW, G_W, G_FLAG = range(len(SUMS))  # SUMS' order


JIT = dict(cache=True, nogil=True, error_model="numpy")


@njit(inline="always", **JIT)
def _token(sv, ov, mv, m_ok, rv, r_ok, o_ok, log_tau, limit, clamp):  # pragma: no cover - compiled
    """One token's figures (float64): (m - o or NaN, x = s - o, K3 of pi_theta vs pi_old, |k3 weight| or NaN,
    flagged); estimators.py's maths, per present column."""
    mm = mv - ov if m_ok else np.nan
    x = sv - ov
    k = np.expm1(-x) + x
    bad = not np.isfinite(sv) or sv > 0 or (o_ok and (not np.isfinite(ov) or ov > 0)) or (
        m_ok and (not np.isfinite(mv) or mv > 0))
    w = np.nan
    if r_ok:
        d = rv - sv
        w = abs(np.expm1(d))
        bad = bad or not np.isfinite(rv) or rv > 0 or d > log_tau or w > limit or np.expm1(d) - d > clamp
    return mm, x, k, w, bad


@njit(inline="always", **JIT)
def _add(grid, gmax, b, pb, mm, x, k, w, bad):  # pragma: no cover - compiled
    """Add one token's figures to its (turn bucket, position bin) cell; non-finite values are left out."""
    grid[b, pb, G_TOKENS] += 1.0
    if np.isfinite(mm):
        grid[b, pb, G_NM] += 1.0
        grid[b, pb, G_MABS] += abs(mm)
        grid[b, pb, G_M] += mm
        gmax[b, pb] = max(gmax[b, pb], abs(mm))
    if np.isfinite(x) and np.isfinite(k):
        grid[b, pb, G_ND] += 1.0
        grid[b, pb, G_DABS] += abs(x)
        grid[b, pb, G_DK3] += k
    if np.isfinite(w):
        grid[b, pb, G_NW] += 1.0
        grid[b, pb, G_W] += w
    if bad:
        grid[b, pb, G_FLAG] += 1.0


@njit(**JIT)
def fold(new_seq, mask, rec, step_idx, s, o, o_ok, r, r_ok, m, m_ok, log_tau, limit, clamp,
          grid, gmax, steps, seqs, spans):  # pragma: no cover - compiled
    """One pass over rows sorted by sequence then pos: each token's turn (turn_index's rule), then grid
    [N_TURN, N_POS, SUMS] and gmax (max |m - o|), steps [n_steps, N_TURN, 4] (|m - o| sum and count, and at
    turns' first tokens), seqs [4] (single-turn sequences, multi-turn ones, single-turn |m - o| count and
    sum), spans [:, 5] (row, |m - o| at the first token, body sum and count, turn) of turns >= 1.
    Returns the number of spans written."""
    n, n_spans, seen, base, pit, prev_in, prev_rec, seq_max, seq_abs, seq_n, cur = (
        len(mask), 0, 0, 0, -1, False, -1, -1, 0.0, 0.0, -1)
    for i in range(n + 1):
        if i == n or i == 0 or new_seq[i]:
            if seq_max == 0:  # close the sequence before: single-turn ...
                seqs[0], seqs[2], seqs[3] = seqs[0] + 1.0, seqs[2] + seq_n, seqs[3] + seq_abs
            elif seq_max > 0:  # ... or multi-turn
                seqs[1] += 1.0
            if i == n:
                break
            base, prev_in, prev_rec, seq_max, seq_abs, seq_n, cur = seen, False, -1, -1, 0.0, 0.0, -1
        if not mask[i]:
            prev_in = False
            continue
        if not prev_in or rec[i] != prev_rec:  # a turn starts
            seen, pit = seen + 1, 0
        else:
            pit += 1
        turn = rec[i] if rec[i] >= 0 else seen - base - 1
        prev_in, prev_rec, seq_max = True, rec[i], max(seq_max, turn)
        b, pb = min(turn, MAX_TURN), (pit if pit < 3 else (3 if pit < 8 else (4 if pit < 32 else 5)))
        sv = np.float64(s[i])  # float64 inside (numba's float() of a float32 stays float32)
        mm, x, k, w, bad = _token(sv, np.float64(o[i]) if o_ok[i] else sv, np.float64(m[i]), m_ok[i],
                                  np.float64(r[i]), r_ok[i], o_ok[i], log_tau, limit, clamp)
        _add(grid, gmax, b, pb, mm, x, k, w, bad)
        a = abs(mm)
        if np.isfinite(mm):
            steps[step_idx[i], b, 0] += a
            steps[step_idx[i], b, 1] += 1.0
            if pit == 0:
                steps[step_idx[i], b, 2] += a
                steps[step_idx[i], b, 3] += 1.0
            seq_abs, seq_n = seq_abs + a, seq_n + 1.0
        if turn >= 1 and pit == 0:
            cur = n_spans if n_spans < spans.shape[0] else -1  # the caller sizes spans: never -1
            if cur >= 0:
                spans[cur, 0], spans[cur, 1], spans[cur, 2], spans[cur, 3], spans[cur, 4] = i, a, 0.0, 0.0, turn
                n_spans += 1
        elif turn >= 1 and np.isfinite(mm) and cur >= 0:
            spans[cur, 2], spans[cur, 3] = spans[cur, 2] + a, spans[cur, 3] + 1.0
    return n_spans
