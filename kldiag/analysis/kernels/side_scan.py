"""The side scan's compiled loop (kldiag.analysis.reducers.scan): per step, over tokens in the loss, the
sums behind the entropy and engine-mismatch causes. Numba only; float64 inside.

SUMS columns, in order: n, n_entropy, sum_entropy, n_confident, n_sampler, sum_tmpe (tmpe = exp|logp_old -
logp_sampler|, NeMo-RL's token_mult_prob_error, nemo_rl/algorithms/loss/loss_functions.py).
"""

from __future__ import annotations

import numpy as np

from kldiag.analysis.kernels import fastexp
from kldiag.analysis.kernels.fused import finite
from kldiag.jit import njit

JIT = dict(cache=True, nogil=True, error_model="numpy")
SUMS_JIT = dict(JIT, fastmath={"reassoc", "contract", "nsz"})  # vectorised sums; NaN and inf kept (fused.py)
CHUNK = 1024  # rows per vectorised chunk
N_SUMS = 6


@njit(inline="always", **JIT)
def _kept(v, ok):  # pragma: no cover - compiled
    """v where ok (0 or 1), else +0.0, by masking its bits: `v if ok else 0.0` in the loop kept LLVM from
    vectorising it (4x slower)."""
    return np.int64(np.float64(v).view(np.int64) & -np.int64(ok)).view(np.float64)


@njit(inline="always", **SUMS_JIT)
def _chunk(step, mask, logp, old, smp, ent, log_confident, s0, has_m):  # pragma: no cover - compiled
    """(SUMS over one chunk's rows (column slices), the count of rows whose step is not s0): a branch-free
    loop over range(len) that LLVM vectorises, fastexp's exp (within 1 ulp of numpy's); float64 inside.
    Conditions are 0/1 integers and values are kept by masking their bits (_kept): a select on a bool
    load, or counts kept as floats, kept the loop from vectorising. The step compare rides in the same
    loop, so that the step column is read once and a run's end found without a scalar pass over rows.
    has_m: a constant (_chunk_of), False where no row has logp_sampler: tmpe is NaN there (exp of NaN), and the
    compiler drops the exp."""
    n = n_ent = n_conf = n_smp = off = 0
    sum_ent = sum_tmpe = 0.0
    for i in range(len(mask)):
        off += np.int64(step[i] != s0)
        mk = np.int64(mask[i])
        s, o = np.float64(logp[i]), np.float64(old[i])  # widened: float32 in, float64 inside
        m, e = np.float64(smp[i]), np.float64(ent[i])
        o = s if o != o else o  # null logp_old: on-policy, pi_old is pi_theta
        tmpe = fastexp.exp(abs(o - m)) if has_m else m
        e_ok, t_ok = mk & np.int64(finite(e)), mk & np.int64(finite(tmpe))
        n += mk
        n_ent += e_ok
        sum_ent += _kept(e, e_ok)
        n_conf += mk & np.int64(s > log_confident)
        n_smp += t_ok
        sum_tmpe += _kept(tmpe, t_ok)
    return (float(n), float(n_ent), sum_ent, float(n_conf), float(n_smp), sum_tmpe), off


@njit(**SUMS_JIT)
def run_sums(step, mask, logp, old, smp, ent, log_confident, has_m=True):  # pragma: no cover - compiled
    """SUMS of each run of equal consecutive steps: (run steps [R], sums [R, 6]); float64 inside.

    A run is summed in chunks of CHUNK rows from its first row. Each chunk is summed on the guess that its
    rows are all of the run's step (_chunk counts those that are not); where one is not, the rows up to it
    are summed again and a new run starts there: one vectorised pass, a scalar look only at runs' ends.
    has_m False: no row has logp_sampler (smp all NaN), and no exp is taken."""
    n = len(step)
    steps, sums = np.empty(16, np.int64), np.zeros((16, N_SUMS))
    r, a = -1, 0
    while a < n:
        s0 = step[a]
        if r < 0 or s0 != steps[r]:  # a run starts
            r += 1
            if r == len(steps):
                steps, sums = _grown(steps, sums, r)
            steps[r] = s0
        c1 = min(a + CHUNK, n)
        got, off = _chunk_of(step[a:c1], mask[a:c1], logp[a:c1], old[a:c1], smp[a:c1], ent[a:c1], log_confident, s0,
                             has_m)
        if off:  # the run ends inside the chunk: its rows up to there
            c1 = a + 1
            while step[c1] == s0:
                c1 += 1
            got, off = _chunk_of(step[a:c1], mask[a:c1], logp[a:c1], old[a:c1], smp[a:c1], ent[a:c1], log_confident,
                                 s0, has_m)
        for q in range(N_SUMS):
            sums[r, q] += got[q]
        a = c1
    return steps[:r + 1].copy(), sums[:r + 1].copy()


@njit(inline="always", **SUMS_JIT)
def _chunk_of(step, mask, logp, old, smp, ent, log_confident, s0, has_m):  # pragma: no cover - compiled
    """_chunk with has_m as a constant: one loop each way."""
    if has_m:
        return _chunk(step, mask, logp, old, smp, ent, log_confident, s0, True)
    return _chunk(step, mask, logp, old, smp, ent, log_confident, s0, False)


@njit(**JIT)
def _grown(steps, sums, r):  # pragma: no cover - compiled
    """steps and sums with twice the rows, the first r kept."""
    s2, m2 = np.empty(2 * len(steps), np.int64), np.zeros((2 * len(steps), N_SUMS))
    s2[:r], m2[:r] = steps[:r], sums[:r]
    return s2, m2
