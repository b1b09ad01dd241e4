"""Blocks of a record batch's rows, each of one step, for the side reducers' compiled passes (contract, coverage).

A block is at most BLOCK rows, all of one step: short enough that a block's columns stay in cache between the
loops that read them, long enough that its per-block work (a flush into its step's cell) costs nothing per row.
A step's first block is HEAD rows: the contract pass looks for a step's first token off in it again, and in
rows in sequence order that token is near the step's start. Recorder files are step-ordered, so a step is one
run of blocks; rows in any order are still blocked right (a step that changes at every row gives blocks of one
row).
"""

from __future__ import annotations

import numpy as np

from kldiag.jit import njit

BLOCK = 2048  # rows per block
HEAD = 256  # rows of a step's first block: where its first token off usually is, looked for again (contract)
JIT = dict(cache=True, nogil=True, error_model="numpy")


@njit(**JIT)
def run_end(step, i, n, size):  # pragma: no cover - compiled
    """The end of the block from row i: `size` rows, or fewer up to the first row of another step."""
    end = min(i + size, n)
    blk, s0 = step[i:end], step[i]
    same = 0
    for j in range(len(blk)):  # over a slice, branch-free: vectorised (range(i, end) pays index wraparound)
        same += blk[j] == s0
    if same == len(blk):
        return end
    j = 1
    while blk[j] == s0:
        j += 1
    return i + j


@njit(**JIT)
def _grown(a, cap):  # pragma: no cover - compiled
    out = np.empty(cap, a.dtype)
    out[:len(a)] = a
    return out


@njit(**JIT)
def blocks(step):  # pragma: no cover - compiled
    """(starts [r + 1] int64: the row each block starts at, then n; keys [r] int64: each block's step)."""
    n = len(step)
    cap = n // BLOCK + 16
    starts = np.empty(cap + 1, np.int64)
    keys = np.empty(cap, np.int64)
    r = i = 0
    while i < n:
        if r == cap:  # steps change more often than every BLOCK rows: room for more
            cap *= 2
            starts, keys = _grown(starts, cap + 1), _grown(keys, cap)
        starts[r], keys[r] = i, step[i]
        i = run_end(step, i, n, HEAD if r == 0 or keys[r - 1] != keys[r] else BLOCK)
        r += 1
    starts[r] = n
    return starts[:r + 1].copy(), keys[:r].copy()


@njit(**JIT)
def block_counts(starts, mask, valid):  # pragma: no cover - compiled
    """[r] int64: per block, the rows where mask (and valid, unless None) is set; mask, valid: [n] bool."""
    out = np.zeros(len(starts) - 1, np.int64)
    for b in range(len(out)):
        m = mask[starts[b]:starts[b + 1]]
        cnt = 0
        if valid is None:
            for j in range(len(m)):
                cnt += m[j]
        else:
            v = valid[starts[b]:starts[b + 1]]
            for j in range(len(m)):
                cnt += m[j] & v[j]
        out[b] = cnt
    return out
