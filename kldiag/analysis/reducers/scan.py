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

from kldiag.analysis.core.batch import bools
from kldiag.analysis.kernels.side_scan import run_sums
from kldiag.analysis.reducers.base import shared_full
from kldiag.analysis.runtime import runner

COLUMNS = ["step", "mask", "logp", "logp_old", "logp_sampler", "entropy"]
SUMS = ("n", "n_entropy", "sum_entropy", "n_confident", "n_sampler", "sum_tmpe")


def batch_sums(batch: pa.RecordBatch, confident_p: float = 0.99) -> dict[int, np.ndarray]:
    """{step: SUMS vector} of one record batch: one compiled pass over the columns as stored."""
    def col(name: str) -> np.ndarray:
        c = batch.column(name)
        if c.null_count == len(c) and c.null_count:
            return shared_full(len(c), np.nan, np.float32)  # a column the run lacks: no fill per batch
        return c.to_numpy(zero_copy_only=False)  # float32, NaN where null; Arrow's buffer where none is

    step, smp = batch.column("step").to_numpy(zero_copy_only=False), batch.column("logp_sampler")
    steps, sums = run_sums(step, bools(batch, "mask"), col("logp"), col("logp_old"), col("logp_sampler"),
                           col("entropy"), math.log(confident_p), smp.null_count < len(smp))
    out: dict[int, np.ndarray] = {}
    for s, v in zip(steps.tolist(), sums, strict=True):  # a step split in runs: its runs summed in row order
        out[s] = out[s] + v if s in out else v
    return out


@dataclass(frozen=True)
class ScanReducer:
    """The side scan as a reducer (kldiag.analysis.protocol): per step, the SUMS over tokens in the loss."""

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
