"""Per-step figures the analysis tables do not carry, for the entropy and mismatch causes.

One extra pass over four columns (step, mask, logp, entropy, plus logp_old/logp_sampler), one
part at a time, each part's sums kept in a cache keyed by PartInfo.key (parts are immutable),
so `kldiag watch` reads only the new parts; the sums are also kept in the run's cache
(RUN/.kldiag/diagnosis-scan-*, safe to delete), so a second `kldiag analyze` reads none.
Per step, over tokens in the loss (mask true):

  entropy_mean           mean of the recorded entropy (NaN when none is recorded)
  confident_share        share of tokens with p = exp(logp) > confident_p (0.99)
  token_mult_prob_error  mean of exp(|logp_old - logp_sampler|) over tokens with a sampler
                         log-prob (NeMo-RL's metric, nemo_rl/algorithms/loss/loss_functions.py)
"""

from __future__ import annotations

import hashlib
import math
import os
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

CACHE_VERSION = 1
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


def _cache_dir(run, confident_p: float) -> Path | None:
    """RUN/.kldiag/diagnosis-scan-vN-P (or the remote run's local cache); None when unusable."""
    try:
        return Path(run.cache_dir()) / f"diagnosis-scan-v{CACHE_VERSION}-{confident_p:g}"
    except Exception:
        return None


def _name(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:32] + ".npz"


def _load(cache: Path | None, key: str) -> dict[int, np.ndarray] | None:
    if cache is None:
        return None
    try:
        with np.load(cache / _name(key)) as z:
            return {int(s): v for s, v in zip(z["steps"], z["sums"], strict=True)}
    except (OSError, KeyError, ValueError):
        return None


def _save(cache: Path | None, key: str, sums: dict[int, np.ndarray]) -> None:
    """Per-part sums, written atomically (a .tmp renamed); a failure only costs a re-scan."""
    if cache is None:
        return
    try:
        cache.mkdir(parents=True, exist_ok=True)
        steps = np.array(sorted(sums), dtype=np.int64)
        tmp = cache / (_name(key) + f".{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            np.savez(f, steps=steps, sums=np.array([sums[s] for s in steps]).reshape(len(steps), len(SUMS)))
        os.replace(tmp, cache / _name(key))
    except OSError:
        pass


class StepScan:
    """Incremental per-step sums of a run; `update(run)` reads only parts it has not seen."""

    def __init__(self, confident_p: float = 0.99, use_cache: bool = True):
        self.confident_p, self.use_cache = confident_p, use_cache
        self.by_part: dict[str, dict[int, np.ndarray]] = {}

    def update(self, run, parts=None) -> int:
        """Scan the new parts of `run` (a kldiag.format Run); returns how many were read."""
        parts = run.parts() if parts is None else parts
        new = [p for p in parts if p.key not in self.by_part]
        cache = _cache_dir(run, self.confident_p) if self.use_cache else None
        for p in new:
            sums = _load(cache, p.key)
            if sums is None:
                sums = {}
                try:
                    for b in run.iter_batches(COLUMNS, parts=[p]):
                        _merge(sums, batch_sums(b, self.confident_p))
                    _save(cache, p.key, sums)
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
