"""The tokens with the largest engine mismatch, and those the engine routed to other experts than the trainer.

What the Tokens page lists on a run whose flags cannot be computed (no logp_ref: the flags and the |k3
weight| ranking need pi_ref) or beside them: per token in the loss, with o = logp_old (logp where null:
on-policy) and m = logp_sampler (the engine's log mu),

    mismatch   log(pi_old / mu) = o - m, where both are finite (the per-token term of KL(mu || pi_old))

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


def _candidates(rows: dict[str, np.ndarray], keep: int) -> dict[str, np.ndarray]:
    """The rows that can be among the `keep` largest |mismatch|: every row at or above the keep-th largest
    (ties all kept, so `select` breaks them by key as a serial pass would); a cheap cut before the sort."""
    n = len(rows["step"])
    size = np.nan_to_num(np.abs(rows["mismatch"]), nan=-1.0)
    if n <= 4 * keep:
        return rows
    cut = np.partition(size, n - keep)[n - keep]
    sel = size >= cut
    return {k: v[sel] for k, v in rows.items()}


def batch_rows(batch: pa.RecordBatch) -> dict[str, np.ndarray]:
    """Every loss token of the batch with its mismatch and route counts (FIELDS)."""
    mask = _num(batch, "mask", False, bool)
    out = {k: _num(batch, k, -1, np.int64)[mask] for k in KEYS}
    logp = _num(batch, "logp", np.nan, np.float64)
    old = np.where(np.isnan(o := _num(batch, "logp_old", np.nan, np.float64)), logp, o)
    mu = _num(batch, "logp_sampler", np.nan, np.float64)
    with np.errstate(invalid="ignore"):
        mism = np.where(np.isfinite(old) & np.isfinite(mu), old - mu, np.nan)
    out.update(logp_old=old[mask], logp_sampler=mu[mask], mismatch=mism[mask],
               route_differ=_num(batch, "route_differ", 0, np.int64)[mask],
               route_layers=_num(batch, "route_layers", 0, np.int64)[mask])
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
        rows = batch_rows(batch)
        finite = np.isfinite(rows["mismatch"])
        for p, sel in (("w_", finite), ("r_", rows["route_differ"] > 0)):
            if sel.any():
                state[p] = select([state[p], _candidates({k: v[sel] for k, v in rows.items()}, self.keep)], self.keep)

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
