"""A run opened for reading (`open_run`), its manifest, vocab sidecar and writer statistics."""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from kldiag.errors import CorruptPartError, NotARunError, RunFormatError
from kldiag.format.parts import PartInfo, list_parts, open_part, rank_rel, superseded_mask
from kldiag.format.schema import (
    FORMAT_VERSION,
    MANIFEST,
    PARQUET_WRITE_OPTIONS,
    RANK_RE_V1,
    TOKEN_SCHEMA,
    TOKENS_DIR,
    VOCAB,
    VOCAB_SCHEMA,
    WRITERS_DIR,
    Manifest,
    column_field,
    columns_schema,
    part_name,
)
from kldiag.format.storage import Store, resolve

WRITER_STATS = "writer.json"  # v1: RUN/tokens/rank=R/writer.json (read only)
MANIFEST_READS = 4  # remote: tries to read a run.json that a live writer is replacing
ROWS_BATCH = 1 << 16  # rows decoded at a time by Run.read_rows: what it holds is the rows it keeps


def run_path(store: Store) -> Path | str:
    """What a run is called in results and messages: a Path locally, the URI otherwise."""
    return Path(store.root) if store.local else store.uri


def write_manifest(run_dir: str | os.PathLike | Store, manifest: Manifest) -> str:
    """Write run.json atomically (temp file + rename, or one PUT); returns where."""
    store = resolve(run_dir)
    if store.local:
        Path(store.root).mkdir(parents=True, exist_ok=True)
    data = json.dumps(manifest.to_dict(), indent=2, sort_keys=True, default=str).encode()
    store.write_bytes(MANIFEST, data)
    return store.display(MANIFEST)


def read_manifest(run_dir: str | os.PathLike | Store) -> Manifest:
    """Read and validate run.json; NotARunError names the path when there is none."""
    store = resolve(run_dir)
    for attempt in range(1 if store.local else MANIFEST_READS):
        data = store.read_bytes(MANIFEST)
        if data is None:
            store.check()  # a missing bucket says so, rather than "not a kldiag run"
            raise NotARunError(f"{store.display()} is not a kldiag run: it has no {MANIFEST}; pass the directory "
                               "given to kldiag.Recorder (or kldiag.integrations.trl.attach)")
        try:
            d = json.loads(data)
            break
        except ValueError as e:
            # An object store reads an object in ranged GETs: a manifest replaced between two
            # of them reads torn. Parts are immutable; only run.json is ever replaced.
            if attempt + 1 < (1 if store.local else MANIFEST_READS):
                time.sleep(0.05 * (attempt + 1))
                continue
            raise RunFormatError(f"{store.display(MANIFEST)} is not valid JSON ({e}); restore it or re-create it "
                                 "with kldiag.format.write_manifest") from e
    return Manifest.from_dict(d, source=store.display(MANIFEST))


def resume_manifest(run_dir: str | os.PathLike | Store, manifest: Manifest, attempt: int) -> Manifest:
    """Add `attempt` to `manifest.attempts`, keeping what an earlier attempt wrote in the
    run's run.json (first start time, attempts, tags): a restart never erases the history."""
    old = None
    if attempt > 0:
        try:
            old = read_manifest(run_dir)
        except Exception:  # noqa: BLE001 - a foreign or broken run.json is replaced, as before
            old = None
    entry = {"attempt": attempt, "started": manifest.started, "kldiag_version": manifest.kldiag_version,
             "trainer": dict(manifest.trainer), "world_size": manifest.world_size}
    if old is not None:
        manifest.started = old.started
        manifest.attempts = [a for a in old.attempts if a.get("attempt") != attempt]
        manifest.tags = {**old.tags, **manifest.tags}
    manifest.attempts.append(entry)
    return manifest


class Run:
    """A run opened for reading: `open_run(path_or_uri)`."""

    def __init__(self, path: str | os.PathLike | Store, manifest: Manifest):
        self.store = resolve(path)
        self.path = run_path(self.store)
        self.manifest = manifest

    @property
    def uri(self) -> str:
        return self.store.uri

    def parts(self) -> list[PartInfo]:
        """The published parts now in the run (re-lists each call: a live run grows)."""
        return list_parts(self.store)

    def cache_dir(self) -> Path:
        """Local directory for derived results (RUN/.kldiag, or a per-URI user cache)."""
        return self.store.cache_dir()

    def iter_batches(self, columns: Sequence[str] | None = None, batch_size: int = 1 << 20,
                     strict: bool = False, parts: Sequence[PartInfo] | None = None,
                     include_superseded: bool = False, steps: Sequence[int] | None = None) -> Iterator[pa.RecordBatch]:
        """Record batches of every published part, only `columns` (default: TOKEN_SCHEMA, the columns
        every part has; name v1.2's optional ones, or pass RUN_SCHEMA.names, to get them too).

        Rows superseded by a later attempt are left out unless include_superseded. A corrupt
        part is skipped with a warning that names it, or raises in strict mode. `steps`: only the row
        groups whose `step` statistics may hold one of them (their other rows too: filter them).
        """
        columns = list(columns) if columns is not None else TOKEN_SCHEMA.names
        for part in self.parts() if parts is None else parts:
            try:
                yield from part_batches(part, columns, batch_size, include_superseded, steps)
            except (RunFormatError, OSError, pa.ArrowException) as e:
                if strict:
                    raise e if isinstance(e, RunFormatError) else CorruptPartError(
                        f"part file {part.path} is unreadable ({e}); restore it from a copy if one exists, "
                        "or move it out of the run directory to read the rest (its rows are lost)") from e
                warnings.warn(f"kldiag: skipping {part.path}: {e}", stacklevel=2)

    def read(self, columns: Sequence[str] | None = None, strict: bool = False,
             include_superseded: bool = False) -> pa.Table:
        """All published rows as one table (small runs and tests; analysis streams instead)."""
        return self.read_parts(None, columns, strict, include_superseded)

    def read_parts(self, parts: Sequence[PartInfo] | None, columns: Sequence[str] | None = None,
                   strict: bool = False, include_superseded: bool = False) -> pa.Table:
        """The rows of `parts` (None: every published part) as one table, corrupt parts skipped."""
        columns = list(columns) if columns is not None else TOKEN_SCHEMA.names
        batches = list(self.iter_batches(columns, strict=strict, parts=parts, include_superseded=include_superseded))
        schema = columns_schema(columns)
        return pa.Table.from_batches(batches, schema=schema) if batches else schema.empty_table()

    def read_rows(self, parts: Sequence[PartInfo], steps: Sequence[int], where=None,
                  columns: Sequence[str] | None = None) -> pa.Table:
        """The rows of `parts` at `steps` for which where(batch) (a boolean array; None: all) holds, as one
        table: only the row groups that may hold the steps are read, and each batch is filtered as it is
        read, so one sequence costs its row groups' decode, not its parts' whole tables."""
        columns = list(columns) if columns is not None else TOKEN_SCHEMA.names
        if "step" not in columns:
            raise ValueError("read_rows filters on `step`: include it in columns")
        want = pa.array(sorted({int(x) for x in steps}), pa.int64())
        kept = []
        for b in self.iter_batches(columns, ROWS_BATCH, parts=parts, steps=want.to_pylist()):
            keep = pc.is_in(b.column("step"), want)
            kept.append(b.filter(keep if where is None else pc.and_(keep, where(b))))
        return pa.Table.from_batches(kept, schema=columns_schema(columns))

    def vocab(self) -> dict[int, str] | None:
        """token_id -> piece from vocab.parquet, or None when the run has no vocab."""
        data = self.store.read_bytes(VOCAB)
        if data is None:
            return None
        t = pq.read_table(pa.BufferReader(data))
        return dict(zip(t.column("token_id").to_pylist(), t.column("piece").to_pylist(), strict=True))

    def __repr__(self) -> str:
        return f"Run({str(self.path)!r}, trainer={self.manifest.trainer.get('name')!r})"


def part_batches(part: PartInfo, columns: list[str], batch_size: int,
                 include_superseded: bool = False, steps: Sequence[int] | None = None) -> Iterator[pa.RecordBatch]:
    """One part's batches of `columns`: v1 parts get their attempt column from the name, a part
    without one of v1.2's optional columns (every v1.1 part) reads as null there, and rows
    superseded by a later attempt are dropped unless include_superseded. `steps`: only the row groups
    whose `step` statistics (written for every part: PARQUET_WRITE_OPTIONS) may hold one of them."""
    pf = open_part(part, columns)
    groups = None if steps is None else step_groups(pf, steps)
    present = set(pf.schema_arrow.names)
    drop = bool(part.exclude) and not include_superseded
    read = [c for c in columns if c in present]
    if drop and "step" not in read:
        read.append("step")
    schema = columns_schema(columns)
    # A part whose footer reads is whole (parts are published atomically), so errors after
    # this point mean a disk or network fault, not a half-written file.
    if groups == []:
        return
    batches = (pf.iter_batches(batch_size=batch_size, columns=read, row_groups=groups) if steps is None
               else step_batches(pf, groups, steps, batch_size, read))
    for batch in batches:
        if drop:
            step = batch.column("step").to_numpy()
            batch = batch.filter(pa.array(~superseded_mask(step, part.exclude)))
        arrays = [batch.column(c) if c in present else absent_column(c, batch.num_rows, part.attempt)
                  for c in columns]
        yield pa.RecordBatch.from_arrays(arrays, schema=schema)


def step_batches(pf: pq.ParquetFile, groups: list[int], steps: Sequence[int], batch_size: int,
                 columns: list[str]) -> Iterator[pa.RecordBatch]:
    """The batches of `columns` of those of `groups` that hold one of `steps`, up to the last row at one
    of them (each group's `step` column read first: about 2 ms a 1M-row group). Decoding stops there: one
    step of the seven in a 300M-row run's 1M-row group decodes the rows up to it, not the whole group (a
    batch's pages are decoded as it is read; the rows before it are decoded too and left to the caller's
    filter: pyarrow reads no row range of a group)."""
    if pf.schema_arrow.get_field_index("step") < 0:
        yield from pf.iter_batches(batch_size=batch_size, columns=columns, row_groups=groups)
        return
    want = pa.array(sorted({int(s) for s in steps}), pa.int64())
    keep, end = [], 0  # the groups that hold a step; rows of theirs up to the last row at one
    for g in groups:
        at = pc.is_in(pf.read_row_group(g, columns=["step"]).column("step"), value_set=want)
        hit = np.flatnonzero(at.to_numpy(zero_copy_only=False))
        if len(hit):
            end = sum(pf.metadata.row_group(k).num_rows for k in keep) + int(hit[-1]) + 1
            keep.append(g)
    done = 0
    for batch in pf.iter_batches(batch_size=batch_size, columns=columns, row_groups=keep) if keep else ():
        yield batch.slice(0, end - done) if done + batch.num_rows > end else batch
        done += batch.num_rows
        if done >= end:
            break


def step_groups(pf: pq.ParquetFile, steps: Sequence[int]) -> list[int]:
    """The row groups of a part that may hold one of `steps` (a group without `step` statistics may)."""
    col = pf.schema_arrow.get_field_index("step")
    meta = pf.metadata
    out = []
    for g in range(meta.num_row_groups):
        st = meta.row_group(g).column(col).statistics if col >= 0 else None
        if st is None or not st.has_min_max or any(st.min <= s <= st.max for s in steps):
            out.append(g)
    return out


def absent_column(name: str, n: int, attempt: int) -> pa.Array:
    """What a part without column `name` reads as: v1's attempt from the part's name, else nulls."""
    if name == "attempt":
        return pa.array(np.full(n, attempt, np.int16))
    return pa.nulls(n, column_field(name).type)


def open_run(path: str | os.PathLike | Store) -> Run:
    """Open a run (a directory or a URI): validates run.json and lists parts lazily."""
    store = resolve(path)
    return Run(store, read_manifest(store))


# ---- vocab sidecar -------------------------------------------------------------------


def vocab_pieces(tokenizer: Any) -> list[str]:
    """Text of every token id, from a transformers tokenizer, a `tokenizers.Tokenizer`,
    a {piece: id} mapping, or a list of pieces indexed by id."""
    if isinstance(tokenizer, (list, tuple)):
        return [str(p) for p in tokenizer]
    if isinstance(tokenizer, dict):
        pieces = [""] * (max(tokenizer.values()) + 1)
        for piece, i in tokenizer.items():
            pieces[i] = str(piece)
        return pieces
    if hasattr(tokenizer, "get_vocab_size"):  # tokenizers.Tokenizer
        n = tokenizer.get_vocab_size(with_added_tokens=True)
        return [tokenizer.decode([i], skip_special_tokens=False) for i in range(n)]
    if hasattr(tokenizer, "decode") and hasattr(tokenizer, "__len__"):  # transformers
        return [tokenizer.decode([i], skip_special_tokens=False) for i in range(len(tokenizer))]
    raise TypeError(f"cannot read a vocabulary from {type(tokenizer).__name__}; pass a transformers "
                    "tokenizer, a tokenizers.Tokenizer, a {piece: id} dict or a list of pieces")


def vocab_stamp(run_dir: str | os.PathLike | Store) -> int:
    """mtime_ns of RUN/vocab.parquet (0 when absent): a cache key that changes with the file."""
    store = resolve(run_dir)
    found = [e.mtime_ns for e in store.list_files("") if e.name == VOCAB]
    return found[0] if found else 0


def write_vocab(run_dir: str | os.PathLike | Store, tokenizer: Any) -> str:
    """Write RUN/vocab.parquet (token_id int32, piece string) atomically."""
    pieces = vocab_pieces(tokenizer)
    table = pa.table({"token_id": pa.array(range(len(pieces)), pa.int32()), "piece": pa.array(pieces, pa.string())},
                     schema=VOCAB_SCHEMA)
    store = resolve(run_dir)
    store.write_parquet(VOCAB, table, compression="zstd", compression_level=1)
    return store.display(VOCAB)


# ---- per-rank writer statistics ------------------------------------------------------


def rank_stats_rel(rank: int, attempt: int) -> str:
    return f"{WRITERS_DIR}/rank-{rank}-a{attempt:04d}.json"


def write_rank_stats(run_dir: str | os.PathLike | Store, rank: int, stats: dict[str, Any], attempt: int = 0) -> str:
    """Write one rank's (one attempt's) writer statistics atomically: RUN/writers/rank-R-aA.json."""
    store = resolve(run_dir)
    rel = rank_stats_rel(rank, attempt)
    store.write_bytes(rel, json.dumps(stats, indent=2, sort_keys=True).encode())
    return store.display(rel)


def read_rank_stats(run_dir: str | os.PathLike | Store) -> dict[tuple[int, int], dict[str, Any]]:
    """(rank, attempt) -> writer statistics, for every readable stats file (v1 ones: attempt 0)."""
    store = resolve(run_dir)
    out: dict[tuple[int, int], dict[str, Any]] = {}
    files = [(e.rel, e.name) for e in store.list_files(WRITERS_DIR)]
    if store.local:  # v1 runs were local only; a remote listing of every part every 10 s would cost
        files += [(e.rel, e.name) for e in store.list_files(TOKENS_DIR, recursive=True) if e.name == WRITER_STATS]
    for rel, name in files:
        key = _stats_key(rel, name)
        if key is None:
            continue
        try:
            out[key] = json.loads(store.read_bytes(rel) or b"")
        except (OSError, ValueError):
            continue  # a rank that has not published yet, or a foreign file: nothing to add
    return out


def _stats_key(rel: str, name: str) -> tuple[int, int] | None:
    if name == WRITER_STATS:  # v1: tokens/rank=R/writer.json
        m = RANK_RE_V1.match(rel.split("/")[-2]) if rel.count("/") == 2 else None
        return (int(m.group(1)), 0) if m else None
    bits = name.removesuffix(".json").split("-")
    if len(bits) == 3 and bits[0] == "rank" and bits[1].isdigit() and bits[2][:1] == "a" and bits[2][1:].isdigit():
        return int(bits[1]), int(bits[2][1:])
    return None


def upgrade_v1(run_dir: str | os.PathLike) -> int:
    """Rewrite a local v1 run as v1.1 in place: tokens/rank=R/part-S0-S1-N.parquet becomes
    tokens/rank-R/part-S0-S1-a0000-N.parquet with an `attempt` column (0), writer.json moves
    to writers/, run.json says 1.1. Each new part is published before its old file is removed,
    so a crash leaves every row readable. Returns the number of parts rewritten."""
    store = resolve(run_dir)
    manifest = read_manifest(store)
    done = 0
    for part in list_parts(store):
        if not RANK_RE_V1.match(part.rel.split("/")[1]):
            continue
        t = pq.read_table(part.path)
        if "attempt" not in t.column_names:
            t = t.append_column(TOKEN_SCHEMA.field("attempt"), pa.array(np.zeros(t.num_rows, np.int16)))
        name = part_name(part.step_min, part.step_max, part.index, 0)
        store.write_parquet(f"{rank_rel(part.rank)}/{name}", t.select(TOKEN_SCHEMA.names), **PARQUET_WRITE_OPTIONS)
        os.unlink(part.path)
        done += 1
    for (rank, attempt), stats in read_rank_stats(store).items():
        write_rank_stats(store, rank, stats, attempt)
    for old in Path(store.root, TOKENS_DIR).glob(f"rank=*/{WRITER_STATS}"):
        old.unlink()
        if not any(old.parent.iterdir()):
            old.parent.rmdir()
    manifest.format_version = FORMAT_VERSION
    write_manifest(store, manifest)
    return done

