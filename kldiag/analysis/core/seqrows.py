"""The per-sequence table kept on disk: written chunk by chunk as the merge hands rows over, queried.

A run of 10B tokens has about 20M sequences: their table (SEQUENCE_COLUMNS, about 120 bytes a row)
is more than a driver or a dashboard should hold. `build(chunks, ...)` turns the merged per-(step,
seq) partial rows, handed over as step-ordered chunks (prefix.Stream, prefix.combine), into the
sequence table one chunk at a time; past SPILL_ROWS rows the table goes to unnamed temporary
Parquet files, "pieces" (in RUN/.kldiag/sequences when the cache is writable, else the system's
temporary directory; a file disappears with the last reference to it), each chunk's rows freed once
written. The piece of a chunk file the merged prefix lists (spill.py) is written once per process and
shared by the analyses of a growing run. `Analysis.sequences` reads the whole table only when a face
asks for it (types.py);
`SequenceRows.worst`, `.sequence` and `.steps` read only what they show, filtering row groups on
their statistics (pyarrow.dataset predicate pushdown; bench/sequence_query.py compares DuckDB);
`worst` ranks a named piece once (its top rows kept beside it), so a grown run's ranks its new rows only;
`first_largest` (`worst(1)`'s row) reads only the row groups whose footer statistics hold the largest value.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from kldiag.analysis.core import keyed, spill

SPILL_ROWS = 100_000  # sequence rows above which the table goes to disk (about 12 MB in memory)
ROW_GROUP = 65_536  # rows a Parquet row group: a query reads only the groups whose statistics match


class Piece:
    """A part of the sequence table in a Parquet file: its rows in steps first..last. `path`: the named
    file beside a chunk file (immutable), None for an unnamed temporary one."""

    def __init__(self, f, num_rows: int, first: int, last: int, schema: pa.Schema, path: Path | None = None):
        self.f, self.num_rows, self.first, self.last, self.schema = f, num_rows, first, last, schema
        self.path = path
        self.lock = threading.Lock()  # one file position: one reader at a time
        self.tops: dict[tuple[int, str], pa.Table] = {}  # (n, by) -> `top_rows`: a named piece's never change
        self.meta = None  # its Parquet footer, once read (a piece is written once)

    def read(self, fn: Callable):
        """fn(the piece as a Parquet source): natively, its path in /proc/self/fd where there is one
        (pyarrow opens its own descriptor), else the file object, one reader at a time."""
        native = f"/proc/self/fd/{self.f.fileno()}"
        if os.path.exists(native):
            return fn(native)
        with self.lock:
            self.f.seek(0)
            return fn(self.f)

    def top(self, n: int, by: str) -> pa.Table:
        """`top_rows(self, n, by)`: of a named piece, remembered and kept in a file beside it (`stored_top`),
        so that a grown run's worst rows read only its new pieces' rows."""
        got = self.tops.get((n, by))
        if got is None:
            got = stored_top(self, n, by) if self.path is not None else top_rows(self, n, by)
            if self.path is not None:
                self.tops[(n, by)] = got
        return got


class SequenceRows:
    """The sequence table of one analysis: Parquet pieces in step order (those of the prefix's chunk
    files are shared by the analyses of a growing run). Thread-safe reads."""

    def __init__(self, pieces: list[Piece], schema: pa.Schema):
        self.pieces, self.schema = pieces, schema
        self.num_rows = sum(p.num_rows for p in pieces)

    def table(self, columns: list[str] | None = None, filter: Any = None, steps: tuple[int, int] | None = None
              ) -> pa.Table:
        """The rows matching `filter` (a pyarrow.compute expression; None: every row), `columns` only:
        row groups whose statistics exclude the filter are not read (pyarrow.dataset's pushdown), nor
        pieces outside `steps` (first, last)."""
        import pyarrow.parquet as pq

        out = []
        for p in self.pieces:
            if steps is not None and (p.last < steps[0] or p.first > steps[1]):
                continue
            out.append(p.read(lambda src: pq.read_table(src, columns=columns, filters=filter)))
        schema = self.schema if columns is None else pa.schema([self.schema.field(c) for c in columns])
        return pa.concat_tables(out) if out else schema.empty_table()

    def steps(self, first: int, last: int) -> pa.Table:
        """Every sequence of steps first..last (inclusive): only their row groups are read."""
        import pyarrow.compute as pc

        return self.table(filter=(pc.field("step") >= first) & (pc.field("step") <= last), steps=(first, last))

    def sequence(self, step: int, seq: int) -> pa.Table:
        """One sequence's row (empty when absent)."""
        import pyarrow.compute as pc

        return self.table(filter=(pc.field("step") == step) & (pc.field("seq") == seq), steps=(step, step))

    def worst(self, n: int, by: str = "weight_k3_abs_max") -> pa.Table:
        """The n rows with the largest `by` (nulls last, ties in table order): the n first of each piece's
        own n first (`Piece.top`, in table order), so a piece that never changes is ranked once."""
        tops = [t for t in (p.top(n, by) for p in self.pieces) if t.num_rows]
        if not tops:
            return self.schema.empty_table()
        t = pa.concat_tables(tops)
        v = _key(t.column(by))
        return t.take(pa.array(np.lexsort((np.arange(len(v)), -v))[:n]))  # by value, then by row: table order

    def group_maxima(self, column: str) -> list[tuple[Piece, int, Any]]:
        """(piece, row group, the group's largest `column` from its footer's statistics, or None without
        them: an all-null group's, or a column without statistics) of every row group, in table order."""
        import pyarrow.parquet as pq

        out = []
        for p in self.pieces:
            if p.meta is None:
                p.meta = p.read(lambda src: pq.ParquetFile(src).metadata)
            meta = p.meta
            col = meta.schema.to_arrow_schema().get_field_index(column)
            for g in range(meta.num_row_groups):
                st = meta.row_group(g).column(col).statistics if col >= 0 else None
                out.append((p, g, st.max if st is not None and st.has_min_max else None))
        return out

    def first_largest(self, by: str, columns: list[str]) -> pa.Table:
        """`worst(1, by)`'s row, `columns` only: the first row in table order with the largest `by` (NaN and
        null last). Each row group's largest `by` is in its piece's footer: only the groups that hold the
        run's largest (and any without statistics) are read, where `worst` reads every piece's `by` column
        and keeps its top rows (300M rows: 17 pieces, 0.17 s of CPU; this, a few ms). `worst(1, by)` when
        no group has statistics or the largest is -inf (the rank NaN and null share)."""
        import pyarrow.parquet as pq

        groups = self.group_maxima(by)
        known = [float(m) for _, _, m in groups if m is not None and m == m]
        if not known or max(known) == -np.inf:
            return self.worst(1, by).select(columns)
        top, best = max(known), None
        read = list(dict.fromkeys([by, *columns]))
        for p, g, m in groups:
            if m is not None and m < top:
                continue
            t = p.read(lambda src, g=g: pq.ParquetFile(src).read_row_group(g, columns=read))
            v = _key(t.column(by))
            i = int(np.argmax(v))  # the first of the largest: ties in table order
            if len(v) and (best is None or v[i] > best[0]):
                best = (v[i], t.slice(i, 1))
        return best[1].select(columns)


TOP_KEPT = 10_000  # a named piece's top rows kept in a file up to this many (the Overview shows 1,000)
TOP_VERSION = 1  # bump when top_rows' meaning changes


def top_rows(piece: Piece, n: int, by: str) -> pa.Table:
    """The piece's n rows that come first by `by` descending (nulls last), ties by row: in table order.
    Reads its `by` column, then only the row groups that hold those rows."""
    import pyarrow.parquet as pq

    v = piece.read(lambda src: _key(pq.read_table(src, columns=[by]).column(by)))
    cand = _top(v, n)
    rows = np.sort(cand[np.lexsort((cand, -v[cand]))][:n])
    sizes = piece.read(lambda src: [g.num_rows for g in _groups(pq.ParquetFile(src).metadata)])
    starts = np.concatenate([[0], np.cumsum(sizes)])
    at = np.searchsorted(starts, rows, side="right") - 1  # each row's group
    tables = []
    for g in np.unique(at):  # a group's rows taken as it is read: one decoded group held at a time
        t = piece.read(lambda src, g=int(g): pq.ParquetFile(src).read_row_group(g))
        tables.append(t.take(pa.array(rows[at == g] - starts[g])))
    return pa.concat_tables(tables) if tables else piece.schema.empty_table()


def stored_top(piece: Piece, n: int, by: str) -> pa.Table:
    """`top_rows` of a named piece, from NAME.seqs.<digest>.top<version>-<by>-<n>.parquet beside it (removed
    with its chunk file: spill.remove_unlisted), written once, atomically; computed and not kept when n is
    above TOP_KEPT, the folder is read-only or the file unreadable."""
    import pyarrow.parquet as pq

    if n > TOP_KEPT or not by.isidentifier():
        return top_rows(piece, n, by)
    path = piece.path.with_name(f"{piece.path.stem}.top{TOP_VERSION}-{by}-{n}.parquet")
    try:
        return pq.read_table(path)
    except (OSError, pa.ArrowException):
        pass
    t = top_rows(piece, n, by)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        pq.write_table(t, tmp, compression="lz4", use_dictionary=False)
        os.replace(tmp, path)
    except OSError:
        Path(tmp).unlink(missing_ok=True)
    return t


def _top(v: np.ndarray, n: int) -> np.ndarray:
    """Indices of the n largest of v, every tie with the n-th included, in index order."""
    if len(v) <= n:
        return np.arange(len(v))
    nth = np.partition(v, len(v) - n)[len(v) - n]
    return np.flatnonzero(v >= nth)


def _groups(meta) -> list:
    return [meta.row_group(g) for g in range(meta.num_row_groups)]


def _key(col) -> np.ndarray:
    return np.nan_to_num(col.to_numpy(zero_copy_only=False).astype(np.float64), nan=-np.inf)


def build(seq_chunks: list[spill.Chunk], to_table: Callable[[keyed.Keyed], pa.Table], spill_dir: Path | None,
          whole: Callable[[keyed.Keyed], pa.Table], tag: tuple = ()) -> pa.Table | SequenceRows:
    """The sequence table of the chunks (step-ordered, step-disjoint, consumed: the list is emptied
    as they are written): in memory up to SPILL_ROWS rows (`whole` of their concatenation, the
    exact in-memory table), else a SequenceRows of to_table(chunk) for each chunk in order. A named
    chunk file's piece is written once and shared (spill.derived, under `tag`: what to_table depends on);
    the other chunks go to one piece, each written as it comes."""
    total = sum(spill.rows(c) for c in seq_chunks)
    if total <= SPILL_ROWS:
        return whole(keyed.concat(list(spill.loaded(seq_chunks))))
    pieces: list[Piece] = []
    out = _Writer(spill_dir)
    while seq_chunks:
        chunk = seq_chunks.pop(0)
        if not spill.rows(chunk):
            continue
        if isinstance(chunk, spill.Spilled) and chunk.name is not None:
            pieces += out.close()
            pieces.append(spill.derived(chunk, ("table", *tag), lambda c: named_piece(c, tag, to_table, spill_dir),
                                        handle=True))
        else:
            out.add(to_table(spill.materialize(chunk)))
        del chunk
    pieces += out.close()
    return SequenceRows(pieces, pieces[0].schema)


PIECE_VERSION = 1  # bump when the sequence table's columns or their meaning change (tables.sequence_table)


def named_piece(chunk: spill.Spilled, tag: tuple, to_table: Callable[[keyed.Keyed], pa.Table],
                spill_dir: Path | None) -> Piece:
    """The piece of a named chunk file, kept beside it for every later process (NAME.seqs.<digest of
    tag>.parquet, written once, atomically): a warm analysis in a fresh process opens it instead of
    building and writing its rows again. An unnamed piece when the folder is read-only."""
    import pyarrow.parquet as pq

    digest = hashlib.sha1(repr((PIECE_VERSION, tag)).encode()).hexdigest()[:16]
    path = Path(chunk.f.name).with_name(f"{chunk.name}.{digest}.parquet")
    piece = _open_piece(path)
    if piece is not None:
        return piece
    table = to_table(chunk.load())
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        pq.write_table(table, tmp, row_group_size=ROW_GROUP, compression="lz4", use_dictionary=False,
                       write_statistics=True)
        os.replace(tmp, path)
    except OSError:
        Path(tmp).unlink(missing_ok=True)
        return _Writer(spill_dir).add(table).close()[0]
    return _open_piece(path) or _Writer(spill_dir).add(table).close()[0]


def _open_piece(path: Path) -> Piece | None:
    """A Piece of a named Parquet file (held open: a later removal of its name does not cut a reader
    off), or None when it is absent or unreadable."""
    import pyarrow.parquet as pq

    try:
        f = open(path, "rb")
    except OSError:
        return None
    try:
        pf = pq.ParquetFile(f)
        meta = pf.metadata
        steps = pf.read_row_groups([0, meta.num_row_groups - 1], columns=["step"]).column("step")
        piece = Piece(f, meta.num_rows, steps[0].as_py(), steps[-1].as_py(), meta.schema.to_arrow_schema(), path)
    except (OSError, ValueError, IndexError, pa.ArrowException):
        f.close()
        return None
    return piece if piece.num_rows else None


class _Writer:
    """Tables (one schema, step order) written to one unnamed Parquet file as they come: a Piece."""

    def __init__(self, spill_dir: Path | None):
        self.spill_dir, self.f, self.writer = spill_dir, None, None
        self.rows, self.first, self.last, self.schema = 0, 0, 0, None

    def add(self, t: pa.Table) -> _Writer:
        import pyarrow.parquet as pq

        if self.writer is None:
            self.f, self.schema = _temp_file(self.spill_dir), t.schema
            self.writer = pq.ParquetWriter(self.f, t.schema, compression="lz4", use_dictionary=False,  # half the time
                                             write_statistics=True)
            self.first = t.column("step")[0].as_py()
        self.writer.write_table(t, row_group_size=ROW_GROUP)
        self.rows, self.last = self.rows + t.num_rows, t.column("step")[-1].as_py()
        return self

    def close(self) -> list[Piece]:
        """[the piece written] (none when nothing was), and a fresh start."""
        if self.writer is None:
            return []
        self.writer.close()
        self.f.flush()
        piece = Piece(self.f, self.rows, self.first, self.last, self.schema)
        self.__init__(self.spill_dir)
        return [piece]


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
