"""Part files: listing (with attempts and superseded steps), atomic publishing, opening.

Layout (v1.1; unchanged in v1.2, whose optional columns live inside the parts)::

    RUN/tokens/rank-R/part-S0-S1-aA-N.parquet     rank R, steps S0..S1, attempt A, N-th file of R
    RUN/tokens/rank=R/part-S0-S1-N.parquet        v1 (read only): attempt 0

Attempts. Every recorder start on a run (a restart, a resume from a checkpoint, a second
attach) is a new attempt of each rank it writes: 1 + the largest attempt already on that
rank. The rows of attempt A for a step are *superseded* when a later attempt of the same
rank covers that step: its parts' step range [first step, last step] contains it. The
analysis and every reader of kldiag then use only the latest attempt's rows for that step;
superseded rows stay on disk untouched. (TensorBoard discards events past a restart step;
W&B's rewind forks the history; here both attempts stay readable.)
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from kldiag.errors import CorruptPartError, StorageError
from kldiag.format.schema import (
    PARQUET_WRITE_OPTIONS,
    PART_RE,
    RANK_RE,
    RANK_RE_V1,
    TOKENS_DIR,
    check_schema,
    rank_dir_name,
)
from kldiag.format.storage import Entry, Store, resolve

Interval = tuple[int, int]


@dataclass(frozen=True)
class PartInfo:
    """A published part. (rank, name, size, mtime_ns, exclude) is its identity for caches.

    `path` is what messages show (an OS path, or the object's URI); `exclude` holds the
    step intervals of this part superseded by later attempts of its rank.
    """

    path: str
    rank: int
    step_min: int
    step_max: int
    index: int
    size: int
    mtime_ns: int
    attempt: int = 0
    rel: str = ""
    exclude: tuple[Interval, ...] = ()
    store: Store | None = field(default=None, compare=False, repr=False)

    @property
    def name(self) -> str:
        return self.rel.rsplit("/", 1)[-1] if self.rel else os.path.basename(self.path)

    @property
    def key(self) -> str:
        ex = ",".join(f"{a}-{b}" for a, b in self.exclude)
        return f"{self.rank}/{self.name}/{self.size}/{self.mtime_ns}/{ex}"

    def open(self) -> pq.ParquetFile:
        return self.store.open_parquet(self.rel) if self.store is not None else pq.ParquetFile(self.path)


def rank_rel(rank: int) -> str:
    return f"{TOKENS_DIR}/{rank_dir_name(rank)}"


def _parse(entry: Entry) -> tuple[int, int, int, int, int] | None:
    """(rank, step_min, step_max, attempt, index) of a part entry, None for anything else."""
    bits = entry.rel.split("/")
    if len(bits) != 3:
        return None
    m_rank = RANK_RE.match(bits[1]) or RANK_RE_V1.match(bits[1])
    m = PART_RE.match(bits[2])
    if not m_rank or not m:
        return None
    return int(m_rank.group(1)), int(m.group(1)), int(m.group(2)), int(m.group(3) or 0), int(m.group(4) or 0)


def list_parts(run_dir: str | os.PathLike | Store) -> list[PartInfo]:
    """Published parts sorted by (step_min, rank, attempt, index), superseded steps marked.

    Temp, dot and foreign files are skipped. On object storage this is one recursive list.
    """
    store = resolve(run_dir)
    found = []
    for entry in store.list_files(TOKENS_DIR, recursive=True):
        parsed = _parse(entry)
        if parsed is not None:
            found.append((entry, *parsed))
    hulls = attempt_hulls([(r, a, s0, s1) for _, r, s0, s1, a, _ in found])
    parts = [PartInfo(store.display(e.rel), r, s0, s1, i, e.size, e.mtime_ns, a, e.rel,
                      superseded_intervals(hulls, r, a, s0, s1), store if not store.local else None)
             for e, r, s0, s1, a, i in found]
    parts.sort(key=lambda p: (p.step_min, p.rank, p.attempt, p.index))
    return parts


def attempt_hulls(parts: Sequence[tuple[int, int, int, int]]) -> dict[tuple[int, int], Interval]:
    """(rank, attempt) -> [first step, last step] over its parts, from (rank, attempt, s0, s1)."""
    hulls: dict[tuple[int, int], Interval] = {}
    for rank, attempt, s0, s1 in parts:
        lo, hi = hulls.get((rank, attempt), (s0, s1))
        hulls[(rank, attempt)] = (min(lo, s0), max(hi, s1))
    return hulls


def superseded_intervals(hulls: dict[tuple[int, int], Interval], rank: int, attempt: int,
                         s0: int, s1: int) -> tuple[Interval, ...]:
    """Merged step intervals inside [s0, s1] that later attempts of `rank` cover."""
    cut = sorted((max(lo, s0), min(hi, s1)) for (r, a), (lo, hi) in hulls.items()
                 if r == rank and a > attempt and lo <= s1 and hi >= s0)
    merged: list[Interval] = []
    for lo, hi in cut:
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return tuple(merged)


def superseded_mask(step: np.ndarray, exclude: Sequence[Interval]) -> np.ndarray:
    """bool [n]: rows whose step falls in one of the `exclude` intervals."""
    out = np.zeros(len(step), bool)
    for lo, hi in exclude:
        out |= (step >= lo) & (step <= hi)
    return out


def next_attempt(run_dir: str | os.PathLike | Store, rank: int) -> tuple[int, int]:
    """(attempt, first free part index) of a new writer of `rank`, from one listing: attempt 0
    on a fresh rank, else 1 + the largest; the index never overwrites an earlier part."""
    mine = [p for p in list_parts(run_dir) if p.rank == rank]
    if not mine:
        return 0, 0
    return max(p.attempt for p in mine) + 1, max(p.index for p in mine) + 1


def next_index(run_dir: str | os.PathLike | Store, rank: int) -> int:
    """First free part index of a rank: a resumed run never overwrites its earlier parts."""
    return next_attempt(run_dir, rank)[1]


def publish(store: Store, rel_dir: str, name: str, table: pa.Table, **options: object) -> int:
    """Publish `table` as rel_dir/name atomically (see storage.Store.write_parquet); returns bytes."""
    return store.write_parquet(f"{rel_dir}/{name}", table, **{**PARQUET_WRITE_OPTIONS, **options})


def publish_part(table: pa.Table, directory: str | os.PathLike, name: str, **options: object) -> str:
    """Write `table` as directory/name atomically (a local directory); returns the path."""
    store = resolve(os.fspath(directory))
    store.write_parquet(name, table, **{**PARQUET_WRITE_OPTIONS, **options})
    return store.full(name)


def clean_stale_temps(run_dir: str | os.PathLike | Store, rank: int) -> int:
    """Remove the dot-temp files a killed writer of `rank` left (local runs; object stores
    have none: a PUT that did not finish leaves nothing). Returns how many were removed."""
    store = resolve(run_dir)
    if not store.local:
        return 0
    removed = 0
    for entry in store.list_files(rank_rel(rank)):
        name = entry.name
        if not (name.startswith(".") and name.endswith(".tmp")):
            continue
        pid = name[:-4].rsplit(".", 1)[-1]
        if pid.isdigit() and (int(pid) == os.getpid() or _alive(int(pid))):
            continue  # a live writer of this rank (this process, or another) may be publishing it
        try:
            store.remove(entry.rel)
            removed += 1
        except OSError:
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def open_part(part: PartInfo | str | os.PathLike, columns: Sequence[str] | None = None) -> pq.ParquetFile:
    """Open a part, check its schema, raise CorruptPartError naming it when unreadable."""
    path = part.path if isinstance(part, PartInfo) else os.fspath(part)
    try:
        pf = part.open() if isinstance(part, PartInfo) else pq.ParquetFile(path)
    except StorageError:
        raise
    except (OSError, pa.ArrowInvalid) as e:
        raise CorruptPartError(f"part file {path} is unreadable ({e}); restore it from a copy if one exists, "
                               "or move it out of the run directory to read the rest (its rows are lost)") from e
    check_schema(pf.schema_arrow, str(path), columns)
    return pf
