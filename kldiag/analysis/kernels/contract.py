"""The compiled pass of the parity-contract counts (kldiag.analysis.reducers.contract): one loop over a batch's tokens.

Per (check, step - lo) cell of a batch whose steps span lo..lo + S - 1: tokens compared, tokens off (|a - b| > tol),
max and sum of |a - b|, and the first token off as the lowest (seq, pos). float32 inputs as stored, compared in
float64 (exact: the difference of two float32 values is exact in float64 for values of one binade, and |a - b| > 0
holds exactly when a != b in any case).
"""

from __future__ import annotations

import numpy as np

from kldiag.jit import njit

NONE = np.iinfo(np.int64).max


@njit(nogil=True, cache=True)
def contract_cells(sidx, s, it, micro, seq, pos, mask, logp, ok_s, old, ok_o, mu, ok_m, fresh, tol):  # pragma: no cover
    """([3, s] int64 n_tokens, [3, s] int64 n_off, [3, s] max |D|, [3, s] sum |D|, [3, s] first seq, [3, s] first
    pos); checks 0 parity (mu against pi_old, pi_theta at iteration 0 where pi_old is null), 1 batch (pi_theta against
    pi_old on micro 0 of iteration 0), 2 the tokens of 1 whose `fresh` is set. NONE marks a cell with no token off."""
    n_tok = np.zeros((3, s), np.int64)
    n_off = np.zeros((3, s), np.int64)
    top = np.zeros((3, s))
    tot = np.zeros((3, s))
    f_seq = np.full((3, s), NONE, np.int64)
    f_pos = np.full((3, s), NONE, np.int64)
    for i in range(len(sidx)):
        if not mask[i]:
            continue
        g = sidx[i]
        first = it[i] == 0
        if ok_o[i]:
            b = np.float64(old[i])
        elif first and ok_s[i]:
            b = np.float64(logp[i])
        else:
            continue
        if not np.isfinite(b):
            continue
        for c in range(3):
            if c == 0:
                if not ok_m[i] or not np.isfinite(mu[i]):
                    continue
                a = np.float64(mu[i])
            else:
                if not (first and micro[i] == 0 and ok_o[i] and ok_s[i] and np.isfinite(logp[i])):
                    continue
                if c == 2 and not fresh[i]:
                    continue
                a = np.float64(logp[i])
            d = abs(a - b)
            n_tok[c, g] += 1
            tot[c, g] += d
            if d > top[c, g]:
                top[c, g] = d
            if d > tol:
                n_off[c, g] += 1
                if seq[i] < f_seq[c, g] or (seq[i] == f_seq[c, g] and pos[i] < f_pos[c, g]):
                    f_seq[c, g] = seq[i]
                    f_pos[c, g] = pos[i]
    return n_tok, n_off, top, tot, f_seq, f_pos
