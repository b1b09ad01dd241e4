"""What the side reducers share (the reducer protocol: kldiag.analysis.protocol).

`ClippedListReducer`, the body of the staleness and per-task reducers: the run's PPO clip range, bound by
the runner from the analysis's thresholds (runner.bound), one partial per record batch kept in a list, and
one merge at the end. `column`, `ratio` and `num`: reading a column with its nulls, a mean as a ratio of
merged sums (NaN where the count is 0, never 0), and a figure as JSON (None where not finite).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

DEFAULT_CLIP = (0.2, 0.2)  # PPO's epsilon (Schulman et al. 2017) when no range is bound
_SHARED: dict[tuple, np.ndarray] = {}  # (value, dtype) -> a read-only array of it, grown on demand


def shared_full(n: int, value: Any, dtype: Any) -> np.ndarray:
    """A read-only [n] array of `value`: a view of one array kept per (value, dtype) for every batch (a fresh
    np.full of a 1M-row batch costs 0.3 ms of page faults, as much as a compiled pass over it). Two threads
    growing it at once each make one: either serves."""
    key = (repr(value), np.dtype(dtype).str)
    a = _SHARED.get(key)
    if a is None or len(a) < n:
        a = np.full(max(n, 2 * len(a) if a is not None else n, 1 << 16), value, dtype)
        a.flags.writeable = False
        _SHARED[key] = a
    return a[:n]


def all_valid(n: int) -> np.ndarray:
    """A read-only all-true mask [n] (shared_full)."""
    return shared_full(n, True, bool)


def column(batch: pa.RecordBatch, name: str, fill: Any, dtype: Any,
           copy: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(values [N] with nulls filled, valid mask [N]) of a column; all invalid when the batch lacks it. copy=False
    hands Arrow's own buffer over where the dtype already matches, and a shared all-true mask (both read-only: for a
    kernel that only reads)."""
    n = batch.num_rows
    i = batch.schema.get_field_index(name)
    if i < 0:
        return np.full(n, fill, dtype), np.zeros(n, bool)
    col = batch.column(i)
    if not col.null_count:
        valid = np.ones(n, bool) if copy else all_valid(n)
    else:
        valid = col.is_valid().to_numpy(zero_copy_only=False)
    values = (pc.fill_null(col, fill) if col.null_count else col).to_numpy(zero_copy_only=False)
    return values.astype(dtype, copy=copy), valid


NUMERIC = (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64, np.float32, np.float64)


def raw(batch: pa.RecordBatch, name: str) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(values [N], valid [N] bool, None where the column holds no null) of a numeric or bool column, read from
    Arrow's buffers without a copy (bools unpacked from their bits; other types cast to float64): the values at
    nulls are whatever the writer left there, to be read with `valid` (read-only: for a kernel that only reads).
    (None, None) when the batch lacks the column or it holds nulls only."""
    i = batch.schema.get_field_index(name)
    if i < 0 or batch.column(i).null_count == batch.num_rows:
        return None, None
    col = batch.column(i)
    if pa.types.is_boolean(col.type):
        dtype = None
    else:
        dtype = col.type.to_pandas_dtype() if pa.types.is_integer(col.type) or pa.types.is_floating(col.type) else None
        if dtype not in NUMERIC:
            col, dtype = col.cast(pa.float64()), np.float64
    bufs, off, n = col.buffers(), col.offset, len(col)
    if dtype is None:
        return bits(bufs[1], off, n), validity(col)
    return readonly(np.frombuffer(bufs[1], dtype, count=off + n)[off:]), validity(col)


def readonly(a: np.ndarray) -> np.ndarray:
    """A read-only view of `a`: the arrays a kernel reads all read-only, whether Arrow's buffer was mutable or not
    (numba compiles one variant of a kernel per writeable flag)."""
    v = a.view()
    v.flags.writeable = False
    return v


def validity(col: pa.Array) -> np.ndarray | None:
    """[N] bool, a column's non-null rows, from its validity bitmap; None when it holds no null."""
    if not col.null_count:
        return None
    buf = col.buffers()[0]
    return col.is_valid().to_numpy(zero_copy_only=False) if buf is None else bits(buf, col.offset, len(col))


def filled(batch: pa.RecordBatch, name: str, fill: Any) -> np.ndarray:
    """[N] values of a numeric or bool column as stored (raw: no copy where it holds no null), `fill` at nulls and
    everywhere when the batch lacks it."""
    values, valid = raw(batch, name)
    if values is None:
        return readonly(np.full(batch.num_rows, fill, np.asarray(fill).dtype))
    return values if valid is None else readonly(np.where(valid, values, fill))


def bits(buf: pa.Buffer, offset: int, n: int) -> np.ndarray:
    """[n] bool of an Arrow bitmap (validity or bool values) from bit `offset` (LSB first)."""
    start = offset // 8
    packed = np.frombuffer(buf, np.uint8, count=(offset + n + 7) // 8 - start, offset=start)
    return readonly(np.unpackbits(packed, bitorder="little")[offset % 8:offset % 8 + n].view(bool))


def ratio(a: Any, n: Any) -> np.ndarray:
    """a / n elementwise, float64; NaN where n is 0 (a mean of nothing is unknown, not 0)."""
    a, n = np.asarray(a, np.float64), np.asarray(n, np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, a / np.where(n > 0, n, 1), np.nan)


def num(v: Any) -> float | None:
    """A figure for JSON: a float, or None when it is missing or not finite."""
    if v is None:
        return None
    v = float(v)
    return v if np.isfinite(v) else None


class ListReducer:
    """Mixin of a frozen dataclass reducer: one `partial(batch)` per record batch (None: nothing in it), kept in a
    list, and one `merge(partials)` at the end (in part order)."""

    def partial(self, batch: pa.RecordBatch) -> Any:
        raise NotImplementedError

    def merge(self, partials: list) -> Any:
        raise NotImplementedError

    def start(self, part) -> list:
        return []

    def add(self, state: list, batch: pa.RecordBatch) -> None:
        p = self.partial(batch) if batch.num_rows else None
        if p is not None:
            state.append(p)

    def finish(self, state: list, dropped: int) -> Any:
        return self.merge(state)


class ClippedListReducer:
    """Mixin of a frozen dataclass reducer with a `clip` field, `partial(batch, clip)` and `merge(partials)`."""

    clip: tuple[float, float] | None

    def partial(self, batch: pa.RecordBatch, clip: tuple[float, float]) -> Any:
        raise NotImplementedError

    def merge(self, partials: list) -> Any:
        raise NotImplementedError

    def with_clip(self, clip: tuple[float, float]):
        return self if self.clip is not None else replace(self, clip=(float(clip[0]), float(clip[1])))

    def bound_clip(self) -> tuple[float, float]:
        return self.clip or DEFAULT_CLIP

    def start(self, part) -> list:
        return []

    def add(self, state: list, batch: pa.RecordBatch) -> None:
        p = self.partial(batch, self.bound_clip()) if batch.num_rows else None
        if p is not None:
            state.append(p)

    def finish(self, state: list, dropped: int) -> Any:
        return self.merge(state)
