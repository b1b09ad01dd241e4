"""Row scans around the kernel: runs of (step, seq), top-k candidates, TRL's own sums.

Compiled with fused.JIT (cached on disk, GIL released); none of these is on the per-token
hot path of fused.fused_pass.
"""

from __future__ import annotations

import math

import numpy as np

from kldiag.analysis.kernels.fused import JIT
from kldiag.jit import njit


@njit(**JIT)
def seq_starts(step, seq):
    """(start row of each run of equal (step, seq) and n last, int64 [n_seq + 1]; whether step
    never decreases).

    A plain loop: runs are hundreds of rows long, so its branch is predicted and it reads
    the two columns at memory speed (0.66 ns a token, against 1.13 for a vectorised
    change mask and np.flatnonzero).
    """
    n = len(step)
    if n == 0:
        return np.zeros(1, np.int64), True
    out = np.empty(n + 1, np.int64)
    out[0] = 0
    k = 1
    ordered = True
    for i in range(n - 1):
        ordered &= step[i + 1] >= step[i]
        if (step[i + 1] != step[i]) | (seq[i + 1] != seq[i]):
            out[k] = i + 1
            k += 1
    out[k] = n
    return out[:k + 1].copy(), ordered


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
def top_candidates(s, r, mask, d_hi, d_lo):
    """Rows (int64, ascending) masked with d = r - s >= d_hi or <= d_lo: where |k3 weight| may reach a threshold.

    A branch-free loop (it vectorises) marks the rows; the marks are then read 8 at a time as one uint64, and
    only a nonzero word is looked into: some 1% of a batch's rows are candidates at its histogram threshold,
    so this second walk is over a fraction of the rows (np.flatnonzero on the marks took 0.4 ns a row).
    """
    n = len(s)
    hit = np.empty((n + 7) // 8 * 8, np.bool_)
    for i in range(n):
        d = np.float64(r[i]) - np.float64(s[i])
        hit[i] = mask[i] & ((d >= d_hi) | (d <= d_lo))
    for i in range(n, len(hit)):
        hit[i] = False
    words = hit.view(np.uint64)
    out = np.empty(n, np.int64)  # pages past the candidates are never touched
    k = 0
    for q in range(len(words)):
        if words[q]:
            for i in range(8 * q, 8 * q + 8):
                if hit[i]:
                    out[k] = i
                    k += 1
    return out[:k].copy()


@njit(**JIT)
def trl_pass(starts, s, r, o, o_null, mask):
    """Per-sequence sums over every row of kl * mask, kl * exp(x) * mask and x * mask, [n_seq, 3].

    TRL's formula with IEEE semantics (GRPOTrainer: kl = exp(r - s) - (r - s) - 1, x = s - o,
    0 where logp_old is null, r NaN where logp_ref is absent): a non-finite kl outside the
    mask still makes the sum NaN (0 * inf), as it does in the trainer. x is 0 outside the mask:
    logp_old there may be a dump's placeholder (NaN), not the trainer's value.
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
            if has_o and mask[i] and not (has_onull and o_null[i]):
                x = sv - np.float64(o[i])
            mf = 1.0 if mask[i] else 0.0
            kl = math.exp(dd) - dd - 1.0
            a += kl * mf
            b += kl * math.exp(x) * mf
            c += x * mf
        out[j, 0], out[j, 1], out[j, 2] = a, b, c
    return out

