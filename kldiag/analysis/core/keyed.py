"""Keyed partial tables: rows of associative aggregates, merged by key.

A `Keyed` is a dict of numpy columns with the same first dimension: key columns, and
value columns whose reduction ("sum", "max", "min", "first") is given by the column
name's prefix. Concatenating two Keyed tables and reducing by key is the merge of
partials: sums add, maxima take the max, histograms (2-D sum columns) add bin by bin.
Reduction sorts by key with a stable sort, so "first" means first in concatenation
order and the result does not depend on how rows were split between files.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

# Column name prefix -> reduction. Columns without a known prefix are keys.
REDUCERS = {
    "sum_": np.add,
    "n_": np.add,
    "h_": np.add,
    "max_": np.fmax,  # fmax ignores NaN: a missing value never hides a real maximum
    "min_": np.fmin,
    "first_": None,
}


def reducer(name: str):
    for prefix, ufunc in REDUCERS.items():
        if name.startswith(prefix):
            return prefix, ufunc
    return None, None


Keyed = dict  # dict[str, np.ndarray]


def key_names(table: Mapping[str, np.ndarray]) -> list[str]:
    return [k for k in table if reducer(k)[0] is None]


def rows(table: Mapping[str, np.ndarray]) -> int:
    return len(next(iter(table.values()))) if table else 0


def concat(tables: Sequence[Mapping[str, np.ndarray]]) -> Keyed:
    """Row-wise concatenation of tables with the same columns (empty ones skipped)."""
    tables = [t for t in tables if t and rows(t)]
    if not tables:
        return {}
    return {k: np.concatenate([t[k] for t in tables]) for k in tables[0]}


def segment_starts(keys: Sequence[np.ndarray]) -> np.ndarray:
    """Start index of each run of equal consecutive keys (keys already grouped)."""
    n = len(keys[0])
    change = np.zeros(n, bool)
    change[0:1] = True
    for k in keys:
        change[1:] |= k[1:] != k[:-1]
    return np.flatnonzero(change)


def reduce_segments(table: Mapping[str, np.ndarray], starts: np.ndarray) -> Keyed:
    """Reduce each run of rows beginning at `starts` (keys take the run's first value)."""
    out = {}
    for name, col in table.items():
        prefix, ufunc = reducer(name)
        if prefix is None or ufunc is None:
            out[name] = col[starts]
        else:
            out[name] = ufunc.reduceat(col, starts, axis=0)
    return out


def reduce_by_key(table: Mapping[str, np.ndarray]) -> Keyed:
    """Merge rows with equal keys; rows come out sorted by key (lexicographic, first key first)."""
    if not table or rows(table) == 0:
        return dict(table)
    keys = [table[k] for k in key_names(table)]
    order = np.lexsort(keys[::-1])  # lexsort is stable: ties keep concatenation order
    if not np.array_equal(order, np.arange(len(order))):
        table = {k: v[order] for k, v in table.items()}
        keys = [table[k] for k in key_names(table)]
    starts = segment_starts(keys)
    if len(starts) == rows(table):
        return dict(table)
    return reduce_segments(table, starts)


def merge(tables: Sequence[Mapping[str, np.ndarray]]) -> Keyed:
    """The merge of partial tables: concatenate, then reduce by key."""
    return reduce_by_key(concat(tables))
