"""The reducer protocol: every pass over a run's tokens is a reducer the one engine runs per part.

A reducer folds one part's record batches into a partial, a dict of named numpy arrays, and
merges partials in part order (the shape of Ray Data's AggregateFn and of Dask's
chunk/combine/aggregate: init, accumulate a block, merge, finalize):

    class Reducer:
        name: str                    # the cache's namespace, stable
        version: int                 # bump when the meaning or layout of a partial changes
        columns: tuple[str, ...]     # the token columns it reads
        def settings(self) -> dict   # JSON: every setting that changes a partial (part of the cache key)
        def start(self, part)        # an empty state for one part
        def add(self, state, batch)  # fold one record batch (superseded rows already removed)
        def finish(self, state, dropped) -> dict[str, np.ndarray]   # the part's partial
        def merge(self, partials) -> dict[str, np.ndarray]           # in part order
        def result(self, merged)     # what a face reads (a table, a TokenSet, ...)
        rides: str                   # optional: the reducer whose compiled pass may do its per-token work
        def carry(self, state, rider, rider_state) -> bool   # optional, a host's: take a rider (PartFold)

The runner (runtime/runner.py, runtime/part_fold.py) opens each part at most once for all the reducers that lack its partial,
reading the union of their columns, runs the same `compute_part` in this process, in worker
processes or in Ray tasks, caches every partial in one format (`save_arrays`: raw arrays behind a
JSON header, no pickle) keyed by the part's identity and the reducer's settings, and merges in
part order, so a cached, incremental or parallel run equals a serial recompute exactly.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import threading
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pyarrow as pa

from kldiag.format import PartInfo

Arrays = dict[str, np.ndarray]
CACHE_MAGIC = b"KLDPART2"


class Reducer(Protocol):
    name: str
    version: int
    columns: tuple[str, ...]

    def settings(self) -> dict[str, Any]: ...

    def start(self, part: PartInfo) -> Any: ...

    def add(self, state: Any, batch: pa.RecordBatch) -> None: ...

    def finish(self, state: Any, dropped: int) -> Arrays: ...

    def merge(self, partials: Sequence[Arrays]) -> Arrays: ...


# Rows per batch handed to the reducers. A part the recorder writes (about 1M rows) goes in one batch and a tail:
# a batch's fixed cost is paid about twice a part, not three times (512k rows: the first pass 79 -> 73 ns a row
# of CPU, the analysis 50 -> 47, for about 50-80 MB more at peak with a part decoding per core).
KERNEL_ROWS = 1 << 20


def cache_key(reducer: Reducer, part: PartInfo) -> str:
    """sha1 of the reducer's name, version and settings and the part's identity (size, mtime, attempts)."""
    text = json.dumps([reducer.name, reducer.version, reducer.settings(), part.key], sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()


def cache_path(cache_dir: Path, reducer: Reducer, part: PartInfo) -> Path:
    """CACHE/<reducer name>/<key>.part (CACHE: RUN/.kldiag, or a local directory for a URI run)."""
    return Path(cache_dir) / reducer.name / f"{cache_key(reducer, part)}.part"


def save_arrays(path: Path, arrays: Arrays) -> bool:
    """Write named arrays atomically; False when they cannot be cached (read-only run, object arrays).

    Layout: magic, 8-byte header length, 4-byte CRC32 of the header, a JSON header of (name, dtype,
    shape, offset) and the total data length, then the arrays' raw bytes: loading is one read and
    one json.loads (np.savez's per-array headers made a cached re-analysis 5x slower). A list value:
    chunks of one array, written one after the other (no concatenated copy in memory).
    """
    try:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            f = open(tmp, "wb")
        except FileNotFoundError:  # the folder's first file (a mkdir each save cost a system call)
            path.parent.mkdir(parents=True, exist_ok=True)
            f = open(tmp, "wb")
        with f:
            ok = write_arrays(f, arrays)
        if not ok:
            tmp.unlink(missing_ok=True)
            return False
        os.replace(tmp, path)
        return True
    except OSError:
        return False


def write_arrays(f, arrays: Arrays) -> bool:
    """save_arrays's layout into an open binary file; False (nothing written) for object arrays."""
    arrays = {k: [np.ascontiguousarray(c) for c in v] if isinstance(v, list) else [np.ascontiguousarray(v)]
              for k, v in arrays.items()}
    if any(c.dtype.hasobject or c.dtype != v[0].dtype for v in arrays.values() for c in v):
        return False  # raw bytes of pointers mean nothing
    header, offset = [], 0
    for name, v in arrays.items():
        shape = list(v[0].shape) if len(v) == 1 else [sum(len(c) for c in v), *v[0].shape[1:]]
        header.append([name, v[0].dtype.str, shape, offset])
        offset += sum(c.nbytes for c in v)
    head = json.dumps({"arrays": header, "bytes": offset}).encode()
    f.write(CACHE_MAGIC + len(head).to_bytes(8, "little") + zlib.crc32(head).to_bytes(4, "little") + head)
    for v in arrays.values():
        for c in v:
            f.write(memoryview(c).cast("B") if c.nbytes else b"")
    return True


MMAP_BYTES = 1 << 20  # mapped files from this size on (smaller ones are read: one syscall)


def load_arrays(path: Path, mapped: bool = False) -> Arrays | None:
    """Named arrays written by save_arrays, or None when absent or unreadable (then recomputed).

    mapped: a large file is memory-mapped (POSIX), its pages read when an array is first touched: a
    reducer's merged prefix (reducer_prefix.py) that no face of this process reads costs nothing (the
    token sample's is 150 MB at 300M rows). save_arrays replaces a file by renaming a new one over it,
    so a mapped file never changes under its arrays."""
    try:
        with open(path, "rb") as f:
            if mapped and os.name == "posix" and os.fstat(f.fileno()).st_size >= MMAP_BYTES:
                return parse_arrays(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
            return parse_arrays(f.read())
    except (OSError, ValueError):
        return None


def parse_arrays(buf: bytes) -> Arrays | None:
    """The arrays of a save_arrays file's bytes (views of `buf`), or None when they are not one."""
    try:
        if buf[:8] != CACHE_MAGIC:
            return None
        body = 20 + int.from_bytes(buf[8:16], "little")
        head = buf[20:body]
        if zlib.crc32(head) != int.from_bytes(buf[16:20], "little"):
            return None
        meta = json.loads(head)
        if len(buf) != body + meta["bytes"]:  # truncated or grown: not what was written
            return None
        out = {}
        for name, dtype, shape, offset in meta["arrays"]:
            count = int(np.prod(shape))
            out[name] = np.frombuffer(buf, np.dtype(dtype), count, body + offset).reshape(shape)
        return out
    except (ValueError, KeyError, TypeError):
        return None
