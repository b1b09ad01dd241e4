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


@njit(inline="always", **SUMS_JIT)
def _chunk(mask, logp, old, smp, ent, log_confident):  # pragma: no cover - compiled
    """SUMS over one chunk's rows (column slices): a branch-free loop over range(len) that LLVM vectorises,
    fastexp's exp (within 1 ulp of numpy's); float64 inside. Counts are integers: counted as floats
    (1.0 if c else 0.0) the loop did not vectorise, 10x slower."""
    n = n_ent = n_conf = n_smp = 0
    sum_ent = sum_tmpe = 0.0
    for i in range(len(mask)):
        mk = mask[i]
        s, o = np.float64(logp[i]), np.float64(old[i])  # widened: float32 in, float64 inside
        m, e = np.float64(smp[i]), np.float64(ent[i])
        o = s if o != o else o  # null logp_old: on-policy, pi_old is pi_theta
        tmpe = fastexp.exp(abs(o - m))
        e_ok, t_ok = mk & finite(e), mk & finite(tmpe)
        n += np.int64(mk)
        n_ent += np.int64(e_ok)
        sum_ent += e if e_ok else 0.0
        n_conf += np.int64(mk & (s > log_confident))
        n_smp += np.int64(t_ok)
        sum_tmpe += tmpe if t_ok else 0.0
    return float(n), float(n_ent), sum_ent, float(n_conf), float(n_smp), sum_tmpe


@njit(**SUMS_JIT)
def run_sums(step, mask, logp, old, smp, ent, log_confident):  # pragma: no cover - compiled
    """SUMS of each run of equal consecutive steps: (run steps [R], sums [R, 6]); float64 inside."""
    n = len(step)
    runs = 1 if n else 0
    for i in range(1, n):
        if step[i] != step[i - 1]:
            runs += 1
    steps = np.empty(runs, np.int64)
    sums = np.zeros((runs, 6))
    r, a = -1, 0
    for i in range(n + 1):
        if i == n or (i > 0 and step[i] != step[i - 1]):  # rows a..i - 1 are run r
            for c0 in range(a, i, CHUNK):
                c1 = min(c0 + CHUNK, i)
                got = _chunk(mask[c0:c1], logp[c0:c1], old[c0:c1], smp[c0:c1], ent[c0:c1], log_confident)
                for q in range(6):
                    sums[r, q] += got[q]
            a = i
        if i < n and (i == 0 or step[i] != step[i - 1]):
            r += 1
            steps[r] = step[i]
    return steps, sums
