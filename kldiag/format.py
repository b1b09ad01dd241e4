"""Run format v1: manifest, token schema, vocab sidecar, atomic publish, and the reader.

Layout (docs/format.md is the public contract)::

    RUN/run.json                                  manifest (Manifest)
    RUN/vocab.parquet                             optional: token_id -> piece
    RUN/tokens/rank=R/part-S0-S1-N.parquet        rank R, steps S0..S1, N-th file of R
    RUN/.kldiag/                                  analysis cache (derived)

A part is written as a dot-temp file in its final directory, fsynced, then renamed, so a
reader never sees a half-written part. Readers skip dot-files, `.tmp` files and any
name that does not match the part pattern.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from kldiag.errors import (
    CorruptPartError,
    NotARunError,
    RunFormatError,
    SchemaError,
    UnsupportedFormatVersionError,
)

FORMAT_NAME = "kldiag-run"
FORMAT_VERSION = 1
MANIFEST = "run.json"
VOCAB = "vocab.parquet"
TOKENS_DIR = "tokens"
CACHE_DIR = ".kldiag"
PART_RE = re.compile(r"^part-(\d+)-(\d+)(?:-(\d+))?\.parquet$")
RANK_RE = re.compile(r"^rank=(\d+)$")

TOKEN_SCHEMA = pa.schema(
    [
        pa.field("step", pa.int64(), nullable=False),
        pa.field("micro", pa.int32(), nullable=False),
        pa.field("iteration", pa.int16(), nullable=False),
        pa.field("rank", pa.int16(), nullable=False),
        pa.field("seq", pa.int64(), nullable=False),
        pa.field("group", pa.int64()),
        pa.field("pos", pa.int32(), nullable=False),
        pa.field("token_id", pa.int32()),
        pa.field("logp", pa.float32(), nullable=False),
        pa.field("logp_old", pa.float32()),
        pa.field("logp_ref", pa.float32()),
        pa.field("logp_sampler", pa.float32()),
        pa.field("advantage", pa.float32()),
        pa.field("mask", pa.bool_(), nullable=False),
        pa.field("entropy", pa.float32()),
    ]
)
FLOAT_COLUMNS = ("logp", "logp_old", "logp_ref", "logp_sampler", "advantage", "entropy")
VOCAB_SCHEMA = pa.schema([pa.field("token_id", pa.int32(), nullable=False), pa.field("piece", pa.string())])


# ---- manifest ------------------------------------------------------------------------


@dataclass
class Manifest:
    """run.json. `config` holds what the trainer used (beta, estimator, clip range, ...)."""

    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION
    kldiag_version: str = ""
    trainer: dict[str, Any] = field(default_factory=dict)  # {"name": "trl", "version": "1.16.0"}
    config: dict[str, Any] = field(default_factory=dict)  # beta, estimator, clip_range, ...
    world_size: int = 1
    started: float = field(default_factory=time.time)  # unix seconds
    sampling: dict[str, Any] = field(default_factory=dict)  # every_n_steps, seq_fraction
    tags: dict[str, Any] = field(default_factory=dict)
    writer: dict[str, Any] = field(default_factory=dict)  # per-rank writer statistics
    extra: dict[str, Any] = field(default_factory=dict)  # keys from newer writers, kept as they are

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        extra = d.pop("extra")
        return {**extra, **d}

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "run.json") -> Manifest:
        if d.get("format") != FORMAT_NAME:
            raise RunFormatError(f"{source} is not a kldiag manifest (format={d.get('format')!r}); "
                                 "point kldiag at a directory written by kldiag.Recorder")
        version = d.get("format_version")
        if version != FORMAT_VERSION:
            raise UnsupportedFormatVersionError(
                f"{source} declares run format version {version!r}, but this kldiag reads version "
                f"{FORMAT_VERSION}; upgrade kldiag (pip install -U kldiag) to read it")
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in d.items() if k in names}
        return cls(**known, extra={k: v for k, v in d.items() if k not in names})


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a directory; the rename is still atomic
    finally:
        os.close(fd)


def write_manifest(run_dir: str | os.PathLike, manifest: Manifest) -> Path:
    """Write run.json atomically (temp file, fsync, rename); returns its path."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / MANIFEST
    data = json.dumps(manifest.to_dict(), indent=2, sort_keys=True, default=str).encode()
    _atomic_write_bytes(path, data)
    return path


def read_manifest(run_dir: str | os.PathLike) -> Manifest:
    """Read and validate run.json; NotARunError names the path when there is none."""
    run_dir = Path(run_dir)
    path = run_dir / MANIFEST
    if not path.is_file():
        raise NotARunError(f"{run_dir} is not a kldiag run: it has no {MANIFEST}; pass the directory "
                           "given to kldiag.Recorder (or kldiag.integrations.trl.attach)")
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise RunFormatError(f"{path} is not valid JSON ({e}); restore it or re-create it with "
                             "kldiag.format.write_manifest") from e
    return Manifest.from_dict(d, source=str(path))


# ---- parts ---------------------------------------------------------------------------


def part_name(step_min: int, step_max: int, index: int) -> str:
    """File name of the `index`-th part of a rank, holding steps step_min..step_max."""
    return f"part-{step_min:09d}-{step_max:09d}-{index:06d}.parquet"


def rank_dir(run_dir: str | os.PathLike, rank: int) -> Path:
    return Path(run_dir) / TOKENS_DIR / f"rank={rank}"


# Measured in bench/recorder.py: delta encoding stores the constant runs of step/micro/rank/
# seq/group and the +1 runs of pos in a few bits, faster than dictionaries; plain token ids
# are smaller than a dictionary of 100k+ pieces; byte-stream-split puts float bytes side by
# side, so the zero low bytes of bf16-valued log-probs compress away (17% smaller there).
INT_ID_COLUMNS = ("step", "micro", "iteration", "rank", "seq", "group", "pos")
PARQUET_WRITE_OPTIONS: dict[str, Any] = {
    "compression": "zstd",
    "compression_level": 1,
    "use_dictionary": False,
    "column_encoding": {**dict.fromkeys(INT_ID_COLUMNS, "DELTA_BINARY_PACKED"),
                     **dict.fromkeys(FLOAT_COLUMNS, "BYTE_STREAM_SPLIT")},
    "row_group_size": 1 << 20,
    "write_statistics": ["step"],
}


def publish_part(table: pa.Table, directory: str | os.PathLike, name: str, **options: Any) -> Path:
    """Write `table` as directory/name atomically: dot-temp file, fsync, rename, fsync dir.

    A crash at any point leaves either no file or a complete one under `name`.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / name
    tmp = directory / f".{name}.tmp"
    opts = {**PARQUET_WRITE_OPTIONS, **options}
    with open(tmp, "wb") as f:
        pq.write_table(table, f, **opts)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    _fsync_dir(directory)
    return final


@dataclass(frozen=True)
class PartInfo:
    """A published part file. (path, size, mtime_ns) is its identity for caches."""

    path: Path
    rank: int
    step_min: int
    step_max: int
    index: int
    size: int
    mtime_ns: int

    @property
    def key(self) -> str:
        return f"{self.rank}/{self.path.name}/{self.size}/{self.mtime_ns}"


def list_parts(run_dir: str | os.PathLike) -> list[PartInfo]:
    """Published parts, sorted by (step_min, rank, index). Temp, dot and foreign files are skipped."""
    parts = []
    root = Path(run_dir) / TOKENS_DIR
    if not root.is_dir():
        return parts
    for rdir in sorted(root.iterdir()):
        m = RANK_RE.match(rdir.name)
        if not m or not rdir.is_dir():
            continue
        for entry in os.scandir(rdir):
            pm = PART_RE.match(entry.name)
            if not pm or not entry.is_file():
                continue
            st = entry.stat()
            parts.append(PartInfo(Path(entry.path), int(m.group(1)), int(pm.group(1)), int(pm.group(2)),
                                  int(pm.group(3) or 0), st.st_size, st.st_mtime_ns))
    parts.sort(key=lambda p: (p.step_min, p.rank, p.index))
    return parts


def check_schema(schema: pa.Schema, source: str, columns: Sequence[str] | None = None) -> None:
    """Raise SchemaError when a needed column is missing or has another type."""
    for name in columns if columns is not None else TOKEN_SCHEMA.names:
        want = TOKEN_SCHEMA.field(name).type
        idx = schema.get_field_index(name)
        if idx < 0:
            raise SchemaError(f"{source}: column {name!r} is missing; format v1 requires it "
                              f"(see docs/format.md); re-write the part with kldiag.Recorder")
        got = schema.field(idx).type
        if got != want:
            raise SchemaError(f"{source}: column {name!r} is {got}, format v1 says {want}; "
                              "re-write the part with kldiag.Recorder")


def open_part(part: PartInfo | str | os.PathLike, columns: Sequence[str] | None = None) -> pq.ParquetFile:
    """Open a part, check its schema, raise CorruptPartError naming it when unreadable."""
    path = part.path if isinstance(part, PartInfo) else Path(part)
    try:
        pf = pq.ParquetFile(path)
    except (OSError, pa.ArrowInvalid) as e:
        raise CorruptPartError(f"part file {path} is unreadable ({e}); delete it or move it out of "
                               "the run directory (its rows are lost)") from e
    check_schema(pf.schema_arrow, str(path), columns)
    return pf


class Run:
    """A run directory opened for reading: `open_run(path)`."""

    def __init__(self, path: str | os.PathLike, manifest: Manifest):
        self.path = Path(path)
        self.manifest = manifest

    def parts(self) -> list[PartInfo]:
        """The published parts now on disk (re-lists each call: a live run grows)."""
        return list_parts(self.path)

    def iter_batches(self, columns: Sequence[str] | None = None, batch_size: int = 1 << 20,
                     strict: bool = False, parts: Sequence[PartInfo] | None = None) -> Iterator[pa.RecordBatch]:
        """Record batches of every published part, only `columns` (default: all of format v1).

        A corrupt part is skipped with a warning that names it, or raises in strict mode.
        """
        columns = list(columns) if columns is not None else TOKEN_SCHEMA.names
        for part in self.parts() if parts is None else parts:
            try:
                pf = open_part(part, columns)
                # A part whose footer reads is whole (parts are published by rename), so
                # errors after this point mean a disk fault, not a half-written file.
                yield from pf.iter_batches(batch_size=batch_size, columns=columns)
            except (RunFormatError, OSError, pa.ArrowException) as e:
                if strict:
                    raise e if isinstance(e, RunFormatError) else CorruptPartError(
                        f"part file {part.path} is unreadable ({e}); delete it or move it away") from e
                warnings.warn(f"kldiag: skipping {part.path}: {e}", stacklevel=2)

    def read(self, columns: Sequence[str] | None = None, strict: bool = False) -> pa.Table:
        """All published rows as one table (small runs and tests; analysis streams instead)."""
        return self.read_parts(None, columns, strict)

    def read_parts(self, parts: Sequence[PartInfo] | None, columns: Sequence[str] | None = None,
                   strict: bool = False) -> pa.Table:
        """The rows of `parts` (None: every published part) as one table, corrupt parts skipped."""
        columns = list(columns) if columns is not None else TOKEN_SCHEMA.names
        batches = list(self.iter_batches(columns, strict=strict, parts=parts))
        schema = pa.schema([TOKEN_SCHEMA.field(c) for c in columns])
        return pa.Table.from_batches(batches, schema=schema) if batches else schema.empty_table()

    def vocab(self) -> dict[int, str] | None:
        """token_id -> piece from vocab.parquet, or None when the run has no vocab."""
        path = self.path / VOCAB
        if not path.is_file():
            return None
        t = pq.read_table(path)
        return dict(zip(t.column("token_id").to_pylist(), t.column("piece").to_pylist(), strict=True))

    def __repr__(self) -> str:
        return f"Run({str(self.path)!r}, trainer={self.manifest.trainer.get('name')!r})"


def open_run(path: str | os.PathLike) -> Run:
    """Open a run directory: validates run.json (format name and version) and lists parts lazily."""
    return Run(path, read_manifest(path))


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


def write_vocab(run_dir: str | os.PathLike, tokenizer: Any) -> Path:
    """Write RUN/vocab.parquet (token_id int32, piece string) atomically."""
    pieces = vocab_pieces(tokenizer)
    table = pa.table({"token_id": pa.array(range(len(pieces)), pa.int32()), "piece": pa.array(pieces, pa.string())},
                     schema=VOCAB_SCHEMA)
    return publish_part(table, run_dir, VOCAB, column_encoding=None, write_statistics=False)


# ---- per-rank writer statistics ------------------------------------------------------

WRITER_STATS = "writer.json"  # RUN/tokens/rank=R/writer.json: not a part name, so readers skip it


def write_rank_stats(run_dir: str | os.PathLike, rank: int, stats: dict[str, Any]) -> Path:
    """Write one rank's writer statistics (rows, files, bytes, ...) atomically."""
    path = rank_dir(run_dir, rank) / WRITER_STATS
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write_bytes(path, json.dumps(stats, indent=2, sort_keys=True).encode())
    return path


def read_rank_stats(run_dir: str | os.PathLike) -> dict[int, dict[str, Any]]:
    """rank -> writer statistics, for every rank directory that has a readable writer.json."""
    out: dict[int, dict[str, Any]] = {}
    root = Path(run_dir) / TOKENS_DIR
    if not root.is_dir():
        return out
    for rdir in root.iterdir():
        m = RANK_RE.match(rdir.name)
        try:
            if m:
                out[int(m.group(1))] = json.loads((rdir / WRITER_STATS).read_text())
        except (OSError, ValueError):
            continue  # a rank that has not published yet, or a foreign file: nothing to add
    return out
