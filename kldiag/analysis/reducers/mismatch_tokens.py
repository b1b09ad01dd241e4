"""The tokens with the largest engine mismatch, and those the engine routed to other experts than the trainer.

What the Tokens page lists on a run whose flags cannot be computed (no logp_ref: the flags and the |k3
weight| ranking need pi_ref) or beside them: per token in the loss, with o = logp_old (logp where null:
on-policy) and m = logp_sampler (the engine's log mu),

    mismatch   log(pi_old / mu) = o - m, where both are finite (the per-token term of KL(mu || pi_old)),
               in the stored float32 and kept as float64

`MismatchTokensReducer` (the reducer protocol, reduce.py) keeps the `keep` tokens with the largest
|mismatch| (`w_` arrays) and the `keep` tokens routed differently (route_differ > 0: format v1.3, both
sides' routes recorded; `r_` arrays), the largest |mismatch| first, then by (step, seq, pos) so that a
merge of cached or parallel partials selects the same rows as a serial pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

KEYS = ("step", "iteration", "seq", "pos", "token_id")
FIELDS = (*KEYS, "logp_old", "logp_sampler", "mismatch", "route_differ", "route_layers")
PREFIXES = ("w_", "r_")  # largest |mismatch|; routed differently


def _num(batch: pa.RecordBatch, name: str, fill: Any, dtype: Any) -> np.ndarray:
    i = batch.schema.get_field_index(name)
    if i < 0:
        return np.full(batch.num_rows, fill, dtype)
    col = batch.column(i)
    return (pc.fill_null(col, fill) if col.null_count else col).to_numpy(zero_copy_only=False).astype(dtype)


def _empty() -> dict[str, np.ndarray]:
    return {k: np.zeros(0, np.float64 if k in ("logp_old", "logp_sampler", "mismatch") else np.int64) for k in FIELDS}


def select(rows: list[dict[str, np.ndarray]], keep: int) -> dict[str, np.ndarray]:
    """The `keep` rows of the concatenated `rows` with the largest |mismatch| (NaN last), ties by step, seq, pos."""
    rows = [r for r in rows if len(r["step"])]
    if not rows:
        return _empty()
    cat = {k: np.concatenate([r[k] for r in rows]) for k in FIELDS}
    size = np.nan_to_num(np.abs(cat["mismatch"]), nan=-1.0)
    order = np.lexsort((cat["pos"], cat["seq"], cat["iteration"], cat["step"], -size))[:keep]
    return {k: v[order] for k, v in cat.items()}


def _top(size: np.ndarray, rows: np.ndarray, keep: int) -> np.ndarray:
    """Of `rows`, those that can be among the `keep` largest `size`: every row at or above the keep-th largest
    (ties all kept, so `select` breaks them by key as a serial pass would); a cheap cut before the sort."""
    if len(rows) <= 4 * keep:
        return rows
    s = size[rows]
    cut = np.partition(s, len(s) - keep)[len(s) - keep]
    return rows[s >= cut]


def _float(batch: pa.RecordBatch, name: str) -> np.ndarray:
    """A log-prob column as stored (float32), NaN where null: no fill or widening pass over the batch."""
    i = batch.schema.get_field_index(name)
    if i < 0:
        return np.full(batch.num_rows, np.nan, np.float32)
    return batch.column(i).to_numpy(zero_copy_only=False)


def batch_rows(batch: pa.RecordBatch, keep: int) -> dict[str, dict[str, np.ndarray]]:
    """The batch's candidates (FIELDS) for the largest |mismatch| ("w_") and the routed-differently tokens
    ("r_"): the per-token work is the mismatch and a partition; the other columns are gathered at the few
    candidate rows only."""
    mask = _num(batch, "mask", False, bool)
    i = batch.schema.get_field_index("logp_sampler")
    has_mu = i >= 0 and batch.column(i).null_count < batch.num_rows
    j = batch.schema.get_field_index("route_differ")
    has_routes = j >= 0 and batch.column(j).null_count < batch.num_rows
    if not (has_mu or has_routes):
        return {}
    logp, o = _float(batch, "logp"), _float(batch, "logp_old")
    old = np.where(np.isnan(o), logp, o)
    mu = _float(batch, "logp_sampler")
    with np.errstate(invalid="ignore", over="ignore"):
        mism = old - mu  # NaN where either is null or not finite (inf - inf, and inf - x, left out below)
        size = np.abs(mism)
    size = np.where(np.isfinite(size), size, -1.0)
    differ = _num(batch, "route_differ", 0, np.int64) if has_routes else np.zeros(batch.num_rows, np.int64)
    picks = {"w_": _top(size, np.flatnonzero(mask & (size >= 0)), keep),
             "r_": _top(size, np.flatnonzero(mask & (differ > 0)), keep)}
    out = {}
    for p, rows in picks.items():
        if not len(rows):
            continue
        taken = batch.select([c for c in (*KEYS, "route_layers") if c in batch.schema.names]).take(pa.array(rows))
        row = {k: _num(taken, k, -1, np.int64) for k in KEYS}
        row.update(logp_old=old[rows].astype(np.float64), logp_sampler=mu[rows].astype(np.float64),
                   mismatch=mism[rows].astype(np.float64), route_differ=differ[rows],
                   route_layers=_num(taken, "route_layers", 0, np.int64))
        out[p] = row
    return out


@dataclass(frozen=True)
class MismatchTokensReducer:
    """The largest-mismatch and the routed-differently tokens of a run (module docstring)."""

    keep: int = 100
    name: str = "mismatch_tokens"
    version: int = 1
    columns: tuple[str, ...] = ("step", "iteration", "seq", "pos", "token_id", "mask", "logp", "logp_old",
                                "logp_sampler", "route_differ", "route_layers")

    def settings(self) -> dict:
        return {"keep": self.keep}

    def start(self, part) -> dict:
        return {"w_": _empty(), "r_": _empty()}

    def add(self, state: dict, batch: pa.RecordBatch) -> None:
        if not batch.num_rows:
            return
        for p, rows in batch_rows(batch, self.keep).items():
            state[p] = select([state[p], rows], self.keep)

    def finish(self, state: dict, dropped: int) -> dict[str, np.ndarray]:
        return {f"{p}{k}": v for p in PREFIXES for k, v in state[p].items()}

    def merge(self, partials) -> dict[str, np.ndarray]:
        partials = list(partials)
        out = {}
        for p in PREFIXES:
            sel = select([{k: q[f"{p}{k}"] for k in FIELDS} for q in partials], self.keep)
            out.update({f"{p}{k}": v for k, v in sel.items()})
        return out

    def result(self, merged: dict[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
        """{"largest": rows, "routed": rows}: FIELDS arrays each."""
        return {name: {k: merged[f"{p}{k}"] for k in FIELDS} for name, p in (("largest", "w_"), ("routed", "r_"))}
