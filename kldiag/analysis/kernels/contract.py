"""The compiled pass of the parity-contract counts (kldiag.analysis.reducers.contract): one loop over a batch's tokens.

Per (check, step - lo) cell of a batch whose steps span lo..lo + S - 1: tokens compared, tokens off (|a - b| > tol),
max and sum of |a - b|, and the first token off as the lowest (seq, pos). float32 inputs as stored, compared in
float64 (exact: the difference of two float32 values is exact in float64 for values of one binade, and |a - b| > 0
holds exactly when a != b in any case).

Rows go in the blocks of kernels.blocks (at most BLOCK rows, all of one step: recorder files are step-ordered).
A block's sums come from one branch-free loop over column slices, which LLVM vectorises (fused.chunk_sums says
how: conditions combined with & and |, values kept by a select, maxima of values >= +0.0 as their int64 bits,
sums reordered by fastmath "reassoc"); the block's lowest sequence with a token off comes with them, and its
lowest position off is looked for in a second loop only when that sequence can be its cell's first (with
rows in sequence order: once a step). Optional inputs come as None (a column the batch lacks, or all null;
numba compiles a variant without their work). Nulls come as values that compare as a null does (NaN log-probs,
a weight version that is no step), but for pi_old's: a null there is not a NaN (pi_theta stands in for it).
"""

from __future__ import annotations

import numpy as np

from kldiag.jit import njit

NONE = np.iinfo(np.int64).max
JIT = dict(cache=True, nogil=True, error_model="numpy")
SUMS_JIT = dict(JIT, fastmath={"reassoc", "contract", "nsz"})  # sums reordered; NaN and inf kept


@njit(inline="always", **JIT)
def _kept(v, ok):  # pragma: no cover - compiled
    """v where ok, else +0.0, by masking its bits (a select LLVM vectorises: turns._kept)."""
    return np.int64(np.float64(v).view(np.int64) & -np.int64(ok)).view(np.float64)


@njit(inline="always", **JIT)
def _parity(mk, first, lp, ov, oo, mv):  # pragma: no cover - compiled
    """(compared, |mu - b|) of one token for the parity check: b = pi_old where present (oo), else pi_theta at
    iteration 0; compared when in the loss and both finite (|mu - b| < inf: float32 values converted)."""
    d = abs(mv - (ov if oo else lp))
    return mk & (oo | first) & (d < np.inf), d


@njit(inline="always", **JIT)
def _batch(mk, first, mc, lp, ov, oo):  # pragma: no cover - compiled
    """(compared, |pi_theta - pi_old|) of one token for the batch check: micro 0 of iteration 0, pi_old present."""
    d = abs(lp - ov)
    return mk & first & (mc == 0) & oo & (d < np.inf), d


@njit(**SUMS_JIT)
def block_sums(mask, it, micro, seq, logp, old, ok_o, mu, version, step, tol):  # pragma: no cover
    """Per check (parity, batch, batch_fresh) of one block's rows (column slices, all of `step`): tokens compared,
    tokens off, bits of the max |D|, sum |D|, lowest seq off (NONE: none); 15 values, check by check."""
    n0 = f0 = n1 = f1 = n2 = f2 = 0
    t0 = t1 = t2 = 0.0
    m0 = m1 = m2 = np.int64(0)
    q0 = q1 = q2 = NONE
    for j in range(len(mask)):
        mk, first, lp = mask[j], it[j] == 0, np.float64(logp[j])
        if old is None:
            ov, oo = lp, False
        else:
            ov = np.float64(old[j])
            oo = True if ok_o is None else ok_o[j]
        if mu is not None:
            v, d = _parity(mk, first, lp, ov, oo, np.float64(mu[j]))
            x = _kept(d, v)
            off = v & (x > tol)
            n0 += np.int64(v)
            t0 += x
            m0 = max(m0, np.float64(x).view(np.int64))  # x >= +0.0: its bits order like it
            f0 += np.int64(off)
            q0 = min(q0, np.int64(seq[j]) if off else NONE)
        if old is not None:
            v, d = _batch(mk, first, micro[j], lp, ov, oo)
            x = _kept(d, v)
            off = v & (x > tol)
            n1 += np.int64(v)
            t1 += x
            m1 = max(m1, np.float64(x).view(np.int64))
            f1 += np.int64(off)
            q1 = min(q1, np.int64(seq[j]) if off else NONE)
            if version is not None:
                fresh = version[j] == step
                v, x, off = v & fresh, _kept(x, fresh), off & fresh
                n2 += np.int64(v)
                t2 += x
                m2 = max(m2, np.float64(x).view(np.int64))
                f2 += np.int64(off)
                q2 = min(q2, np.int64(seq[j]) if off else NONE)
    return n0, f0, m0, t0, q0, n1, f1, m1, t1, q1, n2, f2, m2, t2, q2


@njit(inline="always", **JIT)
def _old_at(old, ok_o, j, lp):  # pragma: no cover - compiled
    """(log pi_old, whether recorded) of row j: lp and False without the column. For first_pos only: in
    block_sums' vectorised loop the branch on None stays in the loop itself, where numba prunes it (inlined
    from a helper it was not pruned, and that loop ran 9x slower)."""
    if old is None:
        return lp, False
    return np.float64(old[j]), True if ok_o is None else ok_o[j]


@njit(**JIT)
def first_pos(check, q, mask, it, micro, seq, pos, logp, old, ok_o, mu, version, step,
              tol):  # pragma: no cover - compiled
    """The lowest pos of the block's tokens off in `check` whose seq is q (NONE: none); block_sums' conditions.
    A scalar loop (one check a row): it runs on a step's first block, HEAD rows, about once a step."""
    best = NONE
    for j in range(len(mask)):
        if seq[j] != q:
            continue
        mk, first, lp = mask[j], it[j] == 0, np.float64(logp[j])
        ov, oo = _old_at(old, ok_o, j, lp)
        if check == 0:
            if mu is None:
                return NONE
            v, d = _parity(mk, first, lp, ov, oo, np.float64(mu[j]))
        else:
            v, d = _batch(mk, first, micro[j], lp, ov, oo)
            if check == 2 and version is not None:
                v = v & (version[j] == step)
        if v and d > tol:
            best = min(best, np.int64(pos[j]))
    return best


@njit(**JIT)
def contract_cells(starts, cells, keys, s, it, micro, seq, pos, mask, logp, old, ok_o, mu, version,
                   tol):  # pragma: no cover - compiled
    """([3, s] int64 n_tokens, [3, s] int64 n_off, [3, s] max |D|, [3, s] sum |D|, [3, s] first seq, [3, s] first
    pos); checks 0 parity (mu against pi_old, pi_theta at iteration 0 where pi_old is null), 1 batch (pi_theta against
    pi_old on micro 0 of iteration 0), 2 the tokens of 1 whose policy_version is their step. Rows come in the
    blocks of blocks.blocks (starts, keys: each block's step), block b in cell cells[b]. NONE marks a cell with no token
    off. Inputs: [n] arrays of any numeric dtype (mask and ok_o: bool); old, mu, version None where absent; ok_o
    (pi_old present) None where logp_old holds no null. logp and mu NaN at nulls, version no step of the batch."""
    n_tok = np.zeros((3, s), np.int64)
    n_off = np.zeros((3, s), np.int64)
    top = np.zeros((3, s), np.int64)  # bits of values >= +0.0
    tot = np.zeros((3, s))
    f_seq = np.full((3, s), NONE, np.int64)
    f_pos = np.full((3, s), NONE, np.int64)
    for b in range(len(keys)):
        i, j, g, st = starts[b], starts[b + 1], cells[b], keys[b]
        # the block's slices; the optional ones None where absent (numba prunes these branches on arguments)
        bm, bi, bmc, bs, bp, bl = mask[i:j], it[i:j], micro[i:j], seq[i:j], pos[i:j], logp[i:j]
        bo = None if old is None else old[i:j]
        bko = None if ok_o is None else ok_o[i:j]
        bmu = None if mu is None else mu[i:j]
        bv = None if version is None else version[i:j]
        r = block_sums(bm, bi, bmc, bs, bl, bo, bko, bmu, bv, st, tol)
        for c in range(3):
            cnt, off, mx, sm, q = (r[0], r[1], r[2], r[3], r[4]) if c == 0 else (
                (r[5], r[6], r[7], r[8], r[9]) if c == 1 else (r[10], r[11], r[12], r[13], r[14]))
            if not cnt:
                continue
            n_tok[c, g] += cnt
            n_off[c, g] += off
            top[c, g] = max(top[c, g], mx)
            tot[c, g] += sm
            if off and q <= f_seq[c, g]:
                p = first_pos(c, q, bm, bi, bmc, bs, bp, bl, bo, bko, bmu, bv, st, tol)
                f_pos[c, g] = p if q < f_seq[c, g] else min(f_pos[c, g], p)
                f_seq[c, g] = q
    return n_tok, n_off, top.view(np.float64), tot, f_seq, f_pos
