"""Per-step figures the analysis tables do not carry, for the entropy and mismatch causes.

A reducer (`ScanReducer`) over six columns (step, mask, logp, logp_old, logp_sampler, entropy)
that the faces hand to `analyze` so it rides along in the analysis's one read of each part; its
per-part sums are cached like every reducer's, so `kldiag watch` reads only the new parts.
Per step, over tokens in the loss (mask true):

  entropy_mean           mean of the recorded entropy (NaN when none is recorded)
  confident_share        share of tokens with p = exp(logp) > confident_p (0.99)
  token_mult_prob_error  mean of exp(|logp_old - logp_sampler|) over tokens with a sampler
                         log-prob (NeMo-RL's metric, nemo_rl/algorithms/loss/loss_functions.py)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from kldiag.analysis import fastexp, runner
from kldiag.analysis.fused import finite
from kldiag.analysis.kernel import bools
from kldiag.jit import njit

COLUMNS = ["step", "mask", "logp", "logp_old", "logp_sampler", "entropy"]
SUMS = ("n", "n_entropy", "sum_entropy", "n_confident", "n_sampler", "sum_tmpe")


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
def _run_sums(step, mask, logp, old, smp, ent, log_confident):  # pragma: no cover - compiled
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


def batch_sums(batch: pa.RecordBatch, confident_p: float = 0.99) -> dict[int, np.ndarray]:
    """{step: SUMS vector} of one record batch: one compiled pass over the columns as stored."""
    def col(name: str) -> np.ndarray:
        return batch.column(name).to_numpy(zero_copy_only=False)  # float32, NaN where null

    mask = bools(batch, "mask")
    steps, sums = _run_sums(col("step"), mask, col("logp"), col("logp_old"), col("logp_sampler"), col("entropy"),
                            math.log(confident_p))
    out: dict[int, np.ndarray] = {}
    for s, v in zip(steps.tolist(), sums, strict=True):  # a step split in runs: its runs summed in row order
        out[s] = out[s] + v if s in out else v
    return out


@dataclass(frozen=True)
class ScanReducer:
    """The side scan as a reducer (kldiag.analysis.reduce): per step, the SUMS over tokens in the loss."""

    confident_p: float = 0.99
    name: str = "scan"
    version: int = 2
    columns: tuple[str, ...] = tuple(COLUMNS)

    def settings(self) -> dict:
        return {"confident_p": self.confident_p}

    def start(self, part) -> dict[int, np.ndarray]:
        return {}

    def add(self, state: dict[int, np.ndarray], batch: pa.RecordBatch) -> None:
        for s, v in batch_sums(batch, self.confident_p).items():
            state[s] = state[s] + v if s in state else v

    def finish(self, state: dict[int, np.ndarray], dropped: int) -> dict[str, np.ndarray]:
        steps = np.array(sorted(state), np.int64)
        return {"step": steps, "sums": np.array([state[s] for s in steps]).reshape(len(steps), len(SUMS))}

    def merge(self, partials) -> dict[str, np.ndarray]:
        partials = list(partials)
        step = np.concatenate([p["step"] for p in partials]) if partials else np.zeros(0, np.int64)
        sums = np.concatenate([p["sums"] for p in partials]) if partials else np.zeros((0, len(SUMS)))
        uniq, inv = np.unique(step, return_inverse=True)
        out = np.zeros((len(uniq), len(SUMS)))
        np.add.at(out, inv, sums)  # in part order: the same sums whatever was cached
        return {"step": uniq, "sums": out}


def table(merged: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """{"step", "entropy_mean", "confident_share", "token_mult_prob_error"}: arrays by step."""
    m = merged["sums"]
    with np.errstate(invalid="ignore", divide="ignore"):
        return {"step": merged["step"], "entropy_mean": m[:, 2] / m[:, 1], "confident_share": m[:, 3] / m[:, 0],
                "token_mult_prob_error": m[:, 5] / m[:, 4]}


def scan_of(analysis, reducer: ScanReducer | None = None) -> dict[str, np.ndarray]:
    """The side scan of an analysed run: the one its analysis read along, else one more read of the
    parts whose scan partial is not cached."""
    return table(runner.reduced(analysis, reducer or ScanReducer()))
