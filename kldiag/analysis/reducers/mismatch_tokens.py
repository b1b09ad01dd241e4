"""The tokens with the largest engine mismatch, and those the engine routed to other experts than the trainer.

What the Tokens page lists on a run whose flags cannot be computed (no logp_ref: the flags and the |k3
weight| ranking need pi_ref) or beside them: per token in the loss, with o = logp_old (logp where null:
on-policy) and m = logp_sampler (the engine's log mu),

    mismatch   log(pi_old / mu) = o - m, where both are finite (the per-token term of KL(mu || pi_old)),
               in the stored float32 and kept as float64

`MismatchTokensReducer` (the reducer protocol, reduce.py) keeps the `keep` tokens with the largest
|mismatch| (`w_` arrays) and the `keep` tokens routed differently (route_differ > 0: format v1.3, both
sides' routes recorded; `r_` arrays), the largest |mismatch| first, then by (step, seq, pos) so that a
merge of cached or parallel partials selects the same rows as a serial pass. A batch's rows are cut to
the candidates at or above the running keep-th |mismatch| by one compiled pass (kernels/mismatch_top.py,
about 1.5 ns a row), from the part's selection so far: `select` then ranks those few. A batch without
logp_sampler or route_differ values (absent or all null) is skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kldiag.analysis.core.batch import bools
from kldiag.analysis.kernels.mismatch_top import INF32, top_candidates
from kldiag.format import ROUTE_DIFFER, ROUTE_LAYERS

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


def _float(batch: pa.RecordBatch, name: str) -> np.ndarray:
    """A log-prob column as stored (float32), NaN where null: no fill or widening pass over the batch."""
    i = batch.schema.get_field_index(name)
    if i < 0:
        return np.full(batch.num_rows, np.nan, np.float32)
    return batch.column(i).to_numpy(zero_copy_only=False)


def _present(batch: pa.RecordBatch, name: str) -> bool:
    """Whether the batch has a non-null value of column `name` (from the schema and the null count)."""
    i = batch.schema.get_field_index(name)
    return i >= 0 and batch.column(i).null_count < batch.num_rows


def floors(state: dict, keep: int) -> tuple[float, float]:
    """The sizes a row must reach to enter the selections `state` holds ("w_", "r_"): the keep-th |mismatch|
    of a full selection (ranked as `select` ranks: NaN -1, inf first), else 0 and -1 (any row)."""
    out = []
    for p, none in (("w_", 0.0), ("r_", -1.0)):
        m = state[p]["mismatch"] if p in state else ()
        out.append(float(np.nan_to_num(np.abs(m), nan=-1.0, posinf=np.inf).min()) if len(m) >= keep else none)
    return out[0], out[1]


def batch_rows(batch: pa.RecordBatch, keep: int,
               floor: tuple[float, float] = (0.0, -1.0)) -> dict[str, dict[str, np.ndarray]]:
    """The batch's candidates (FIELDS) for the largest |mismatch| ("w_") and the routed-differently tokens
    ("r_"), at or above `floor` (floors' of the selection so far): the per-token work is one compiled pass
    (kernels/mismatch_top.py); the other columns are gathered at the few candidate rows only."""
    has_mu, has_routes = _present(batch, "logp_sampler"), _present(batch, ROUTE_DIFFER)
    if keep < 1 or not (has_mu or has_routes):
        return {}
    mask = bools(batch, "mask") if "mask" in batch.schema.names else np.zeros(batch.num_rows, bool)
    logp, o, mu = _float(batch, "logp"), _float(batch, "logp_old"), _float(batch, "logp_sampler")
    differ = _int(batch, ROUTE_DIFFER) if has_routes else np.zeros(0, np.int16)
    rows_w, rows_r = top_candidates(mask, logp, o, mu, differ, has_routes, keep, *floor, INF32)
    out = {}
    for p, rows in (("w_", rows_w), ("r_", rows_r)):
        if not len(rows):
            continue
        taken = batch.select([c for c in (*KEYS, ROUTE_LAYERS) if c in batch.schema.names]).take(pa.array(rows))
        o_r, mu_r = o[rows], mu[rows]
        old = np.where(np.isnan(o_r), logp[rows], o_r)
        with np.errstate(invalid="ignore", over="ignore"):
            mism = old - mu_r  # float32, as stored; NaN where either is null or inf - inf
        row = {k: _num(taken, k, -1, np.int64) for k in KEYS}
        row.update(logp_old=old.astype(np.float64), logp_sampler=mu_r.astype(np.float64),
                   mismatch=mism.astype(np.float64),
                   route_differ=differ[rows].astype(np.int64) if has_routes else np.zeros(len(rows), np.int64),
                   route_layers=_num(taken, ROUTE_LAYERS, 0, np.int64))
        out[p] = row
    return out


def _int(batch: pa.RecordBatch, name: str) -> np.ndarray:
    """An integer column as stored, 0 where null."""
    col = batch.column(batch.schema.get_field_index(name))
    return (pc.fill_null(col, 0) if col.null_count else col).to_numpy(zero_copy_only=False)


@dataclass(frozen=True)
class MismatchTokensReducer:
    """The largest-mismatch and the routed-differently tokens of a run (module docstring)."""

    keep: int = 100
    name: str = "mismatch_tokens"
    version: int = 2  # 2: a routed token of infinite |mismatch| always ranked first (the batch cut dropped it)
    columns: tuple[str, ...] = ("step", "iteration", "seq", "pos", "token_id", "mask", "logp", "logp_old",
                                "logp_sampler", "route_differ", "route_layers")

    def settings(self) -> dict:
        return {"keep": self.keep}

    def start(self, part) -> dict:
        return {"w_": _empty(), "r_": _empty()}

    def add(self, state: dict, batch: pa.RecordBatch) -> None:
        if not batch.num_rows:
            return
        for p, rows in batch_rows(batch, self.keep, floors(state, self.keep)).items():
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
