"""The per-sequence table kept on disk: written chunk by chunk as the merge hands rows over, queried.

A run of 10B tokens has about 20M sequences: their table (SEQUENCE_COLUMNS, about 120 bytes a row)
is more than a driver or a dashboard should hold. `build(chunks, cfg)` turns the merged per-(step,
seq) partial rows, handed over as step-ordered chunks (prefix.Stream, prefix.combine), into the
sequence table one chunk at a time; past SPILL_ROWS rows the table goes to an unnamed temporary
Parquet file (in RUN/.kldiag/sequences when the cache is writable, else the system's temporary
directory; the file disappears with the last reference to it) and each chunk's rows are freed once
written. `Analysis.sequences` reads the whole table only when a face asks for it (types.py);
`SequenceRows.worst`, `.sequence` and `.steps` read only what they show, filtering row groups on
their statistics (pyarrow.dataset predicate pushdown; bench/sequence_query.py compares DuckDB).
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from typing import Any

import numpy as np
import pyarrow as pa

from kldiag.analysis import keyed, spill

SPILL_ROWS = 100_000  # sequence rows above which the table goes to disk (about 12 MB in memory)
ROW_GROUP = 65_536  # rows a Parquet row group: a query reads only the groups whose statistics match


class SequenceRows:
    """The sequence table of one analysis, in an unnamed Parquet file. Thread-safe reads."""

    def __init__(self, f, num_rows: int, schema: pa.Schema):
        self._f, self.num_rows, self.schema = f, num_rows, schema
        self._lock = threading.Lock()

    def table(self, columns: list[str] | None = None, filter: Any = None) -> pa.Table:
        """The rows matching `filter` (a pyarrow.compute expression; None: every row), `columns` only:
        row groups whose statistics exclude the filter are not read (pyarrow.dataset's pushdown)."""
        import pyarrow.parquet as pq  # pyarrow's Parquet and dataset modules: about 40 MB, only once queried

        with self._lock:
            self._f.seek(0)
            return pq.read_table(self._f, columns=columns, filters=filter)

    def steps(self, first: int, last: int) -> pa.Table:
        """Every sequence of steps first..last (inclusive): only their row groups are read."""
        import pyarrow.compute as pc

        return self.table(filter=(pc.field("step") >= first) & (pc.field("step") <= last))

    def sequence(self, step: int, seq: int) -> pa.Table:
        """One sequence's row (empty when absent)."""
        import pyarrow.compute as pc

        return self.table(filter=(pc.field("step") == step) & (pc.field("seq") == seq))

    def worst(self, n: int, by: str = "weight_k3_abs_max") -> pa.Table:
        """The n rows with the largest `by` (nulls last, ties in table order): the `by` column read a
        row group at a time, then only the row groups that hold the n rows."""
        import pyarrow.parquet as pq

        with self._lock:
            self._f.seek(0)
            pf = pq.ParquetFile(self._f)
            best_v, best_i, start = np.zeros(0), np.zeros(0, np.int64), 0
            for g in range(pf.num_row_groups):
                v = _key(pf.read_row_group(g, columns=[by]).column(by))
                keep = np.argsort(-v, kind="stable")[:n]
                best_v, best_i = np.concatenate([best_v, v[keep]]), np.concatenate([best_i, keep + start])
                top = np.lexsort((best_i, -best_v))[:n]  # by value, then by row: table order among ties
                best_v, best_i, start = best_v[top], best_i[top], start + len(v)
            if not len(best_i):
                return self.schema.empty_table()
            bounds = np.cumsum([0] + [pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)])
            groups = sorted(set(np.searchsorted(bounds, best_i, side="right") - 1))
            t = pa.concat_tables([pf.read_row_group(int(g)) for g in groups])
            offsets = np.concatenate([np.arange(bounds[g], bounds[g + 1]) for g in groups])
        return t.take(pa.array(np.searchsorted(offsets, best_i)))


def _key(col) -> np.ndarray:
    return np.nan_to_num(col.to_numpy(zero_copy_only=False).astype(np.float64), nan=-np.inf)


def build(seq_chunks: list[spill.Chunk], to_table: Callable[[keyed.Keyed], pa.Table], spill_dir: Path | None,
          whole: Callable[[keyed.Keyed], pa.Table]) -> pa.Table | SequenceRows:
    """The sequence table of the chunks (step-ordered, step-disjoint, consumed: the list is emptied
    as they are written): in memory up to SPILL_ROWS rows (`whole` of their concatenation, the
    exact in-memory table), else a SequenceRows of to_table(chunk) for each chunk in order."""
    total = sum(spill.rows(c) for c in seq_chunks)
    if total <= SPILL_ROWS:
        return whole(keyed.concat(list(spill.loaded(seq_chunks))))
    import pyarrow.parquet as pq

    f = _temp_file(spill_dir)
    writer, schema = None, None
    while seq_chunks:
        chunk = seq_chunks.pop(0)
        if not spill.rows(chunk):
            continue
        t = to_table(spill.materialize(chunk))
        del chunk
        if writer is None:
            schema = t.schema
            writer = pq.ParquetWriter(f, schema, compression="lz4", write_statistics=True)
        writer.write_table(t, row_group_size=ROW_GROUP)
    writer.close()
    f.flush()
    return SequenceRows(f, total, schema)


def _temp_file(spill_dir: Path | None):
    """An unnamed temporary file (gone when closed), in spill_dir when it is writable."""
    if spill_dir is not None:
        try:
            Path(spill_dir).mkdir(parents=True, exist_ok=True)
            return tempfile.TemporaryFile(dir=spill_dir)
        except OSError:
            pass
    return tempfile.TemporaryFile()


def spill_dir(cache_dir) -> Path | None:
    return Path(cache_dir) / "sequences" if cache_dir is not None and os.access(cache_dir, os.W_OK) else None
