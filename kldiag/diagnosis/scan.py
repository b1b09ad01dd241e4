"""Per-step figures the analysis tables do not carry, for the entropy and mismatch causes.

One extra pass over four columns (step, mask, logp, entropy, plus logp_old/logp_sampler), one
part at a time, each part's sums kept in a cache keyed by PartInfo.key (parts are immutable),
so `kldiag watch` reads only the new parts. Per step, over tokens in the loss (mask true):

  entropy_mean           mean of the recorded entropy (NaN when none is recorded)
  confident_share        share of tokens with p = exp(logp) > confident_p (0.99)
  token_mult_prob_error  mean of exp(|logp_old - logp_sampler|) over tokens with a sampler
                         log-prob (NeMo-RL's metric, nemo_rl/algorithms/loss/loss_functions.py)
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

COLUMNS = ["step", "mask", "logp", "logp_old", "logp_sampler", "entropy"]
SUMS = ("n", "n_entropy", "sum_entropy", "n_confident", "n_sampler", "sum_tmpe")


def _f64(batch: pa.RecordBatch, name: str) -> np.ndarray:
    return batch.column(name).to_numpy(zero_copy_only=False).astype(np.float64)


def batch_sums(batch: pa.RecordBatch, confident_p: float = 0.99) -> dict[int, np.ndarray]:
    """{step: SUMS vector} of one record batch (float64 inside)."""
    step = batch.column("step").to_numpy()
    keep = pc.fill_null(batch.column("mask"), False).to_numpy(zero_copy_only=False).astype(bool)
    logp, ent = _f64(batch, "logp"), _f64(batch, "entropy")
    old, smp = _f64(batch, "logp_old"), _f64(batch, "logp_sampler")
    old = np.where(np.isnan(old), logp, old)  # on-policy: pi_old is pi_theta
    with np.errstate(invalid="ignore", over="ignore"):
        tmpe = np.exp(np.abs(old - smp))
        confident = logp > math.log(confident_p)
    has_ent, has_smp = keep & np.isfinite(ent), keep & np.isfinite(tmpe)
    uniq, inv = np.unique(step, return_inverse=True)
    k = len(uniq)
    cols = [np.bincount(inv, weights=w, minlength=k) for w in (
        keep, has_ent, np.where(has_ent, ent, 0.0), keep & confident, has_smp, np.where(has_smp, tmpe, 0.0))]
    stacked = np.stack(cols, axis=1)
    return {int(s): stacked[i] for i, s in enumerate(uniq)}


def _merge(into: dict[int, np.ndarray], more: dict[int, np.ndarray]) -> None:
    for s, v in more.items():
        into[s] = into[s] + v if s in into else v.copy()


class StepScan:
    """Incremental per-step sums of a run; `update(run)` reads only parts it has not seen."""

    def __init__(self, confident_p: float = 0.99):
        self.confident_p = confident_p
        self.by_part: dict[str, dict[int, np.ndarray]] = {}

    def update(self, run, parts=None) -> int:
        """Scan the new parts of `run` (a kldiag.format Run); returns how many were read."""
        parts = run.parts() if parts is None else parts
        new = [p for p in parts if p.key not in self.by_part]
        for p in new:
            sums: dict[int, np.ndarray] = {}
            try:
                for b in run.iter_batches(COLUMNS, parts=[p]):
                    _merge(sums, batch_sums(b, self.confident_p))
            except Exception as e:  # a part that vanished or broke: diagnosis goes on without it
                warnings.warn(f"kldiag: diagnosis scan skipped {p.path}: {e}", stacklevel=2)
            self.by_part[p.key] = sums
        live = {p.key for p in parts}
        self.by_part = {k: v for k, v in self.by_part.items() if k in live}
        return len(new)

    def table(self) -> dict[str, np.ndarray]:
        """{"step", "entropy_mean", "confident_share", "token_mult_prob_error"}: arrays by step."""
        total: dict[int, np.ndarray] = {}
        for sums in self.by_part.values():
            _merge(total, sums)
        steps = np.array(sorted(total), dtype=np.int64)
        m = np.array([total[s] for s in steps]).reshape(len(steps), len(SUMS))
        with np.errstate(invalid="ignore", divide="ignore"):
            return {"step": steps, "entropy_mean": m[:, 2] / m[:, 1], "confident_share": m[:, 3] / m[:, 0],
                    "token_mult_prob_error": m[:, 5] / m[:, 4]}
