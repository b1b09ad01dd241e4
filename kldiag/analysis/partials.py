"""Per-file partial results: computed by streaming one part, cached, merged associatively.

A `Partial` holds five keyed tables (keyed.py): per (step, rank) aggregates, per
(step, seq) aggregates, the top_k rows by |k3 weight|, the first top_k rows with a
non-finite or positive log-prob, and per (rank, attempt) the rows left out because a later
attempt of the rank superseded their step (format/parts.py). `merge` is associative and commutative up to float
rounding of sums (tests/test_analysis_partials.py); `analyze` always merges the files'
partials in part order, so a cached re-analysis equals a full recompute bit for bit.

Cache: CACHE/partials/<sha1(part key, settings)>.part (CACHE: RUN/.kldiag, or a local
per-URI directory for remote runs), numpy arrays only (no pickle), written atomically. The
key holds the part's (rank, name, size, mtime_ns, superseded steps) and every setting that
changes the partial, so editing a threshold or a new attempt recomputes.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from kldiag.analysis import keyed
from kldiag.analysis.kernel import COLUMNS, Thresholds
from kldiag.analysis.stats import batch_partials, select_first, select_top
from kldiag.format import PartInfo, open_part, superseded_mask

PARTIAL_VERSION = 5  # bump when the meaning or layout of a partial changes (5: superseded rows)
TABLES = ("steps", "seqs", "top", "bad", "superseded")


@dataclass
class Partial:
    """Mergeable partial results of one or more parts."""

    steps: keyed.Keyed = field(default_factory=dict)
    seqs: keyed.Keyed = field(default_factory=dict)
    top: keyed.Keyed = field(default_factory=dict)
    bad: keyed.Keyed = field(default_factory=dict)
    superseded: keyed.Keyed = field(default_factory=dict)  # rank, attempt, n_rows
    rows: int = 0


def merge(partials: Sequence[Partial], top_k: int) -> Partial:
    """Merge partials: aggregates by key, flagged rows by their total order, kept to top_k."""
    return Partial(
        steps=keyed.merge([p.steps for p in partials]),
        seqs=keyed.merge([p.seqs for p in partials]),
        top=select_top(keyed.concat([p.top for p in partials]), top_k),
        bad=select_first(keyed.concat([p.bad for p in partials]), top_k),
        superseded=keyed.merge([p.superseded for p in partials]),
        rows=sum(p.rows for p in partials),
    )


KERNEL_ROWS = 1 << 19  # rows per kernel call


def prefetched(items: Iterator, depth: int = 2) -> Iterator:
    """Yield from `items`, produced by a background thread `depth` ahead.

    Parquet decoding releases the GIL, so the next batch decodes while numpy works on this
    one. Errors are re-raised here; closing the generator stops the thread.
    """
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop, done = threading.Event(), object()

    def produce() -> None:
        try:
            for item in items:
                while not stop.is_set():
                    try:
                        q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
        except BaseException as e:  # handed to the consumer, which raises it
            q.put(e)
        q.put(done)

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    try:
        while (item := q.get()) is not done:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()


def _batches(part: PartInfo, batch_size: int, use_threads: bool) -> Iterator:
    """The record batches of one part, only COLUMNS; raises CorruptPartError when unreadable."""
    return open_part(part, COLUMNS).iter_batches(batch_size=batch_size, columns=list(COLUMNS),
                                                 use_threads=use_threads)


class PartReducer:
    """Folds one part's record batches into its Partial (memory: one batch at a time)."""

    def __init__(self, part: PartInfo, th: Thresholds):
        self.part, self.th = part, th
        self.steps: list = []
        self.seqs: list = []
        self.top: keyed.Keyed = {}
        self.bad: keyed.Keyed = {}
        self.rows, self.floor, self.dropped = 0, -np.inf, 0

    def add(self, batch) -> None:
        if self.part.exclude:  # rows of steps a later attempt re-recorded: counted, not analysed
            gone = superseded_mask(batch.column("step").to_numpy(), self.part.exclude)
            if gone.any():
                self.dropped += int(gone.sum())
                batch = batch.filter(pa.array(~gone))
        r = batch_partials(batch, self.part.rank, self.th, self.floor)
        self.steps.append(r.steps)
        self.seqs.append(r.seqs)
        # a batch's top is already ordered and cut to top_k: only a second batch needs a merge
        self.top = select_top(keyed.concat([self.top, r.top]), self.th.top_k) if self.top else r.top
        self.bad = select_first(keyed.concat([self.bad, r.bad]), self.th.top_k)
        if self.top and len(self.top["wabs"]) >= self.th.top_k:
            self.floor = float(self.top["wabs"][-1])  # later batches only need candidates above it
        self.rows += batch.num_rows

    def result(self) -> Partial:
        superseded = {"rank": np.array([self.part.rank], np.int64), "attempt": np.array([self.part.attempt], np.int64),
                      "n_rows": np.array([self.dropped], np.int64)} if self.dropped else {}
        return Partial(keyed.merge(self.steps), keyed.merge(self.seqs), self.top, self.bad, superseded, self.rows)


def compute_part(part: PartInfo, th: Thresholds, batch_size: int) -> Partial:
    """Stream one part (only COLUMNS) batch by batch; an unreadable part raises."""
    ((_, result),) = compute_parts([part], th, batch_size, errors=())
    return result


def compute_parts(parts: Sequence[PartInfo], th: Thresholds, batch_size: int, errors: tuple,
                  threads: int | None = None) -> Iterator[tuple[int, Partial | Exception]]:
    """(index, Partial or the error that made it unreadable) of each part, in part order.

    With several parts and CPUs, `threads` threads (default: one per CPU) each decode and
    reduce whole parts: decoding and the kernel release the GIL, so every core does both
    and no thread waits for another. One part or one CPU: a reader thread decodes ahead
    while this one runs the kernel.
    """
    threads = min(len(parts), threads or os.cpu_count() or 1)
    if threads <= 1:
        yield from _pipelined(parts, th, batch_size, errors)
        return
    pool = ThreadPoolExecutor(threads, thread_name_prefix="kldiag-part")
    try:
        yield from enumerate(pool.map(lambda part: _reduce_part(part, th, batch_size, errors), parts))
    finally:  # a consumer that stops early (strict mode) does not wait for the remaining parts
        pool.shutdown(wait=True, cancel_futures=True)


def _reduce_part(part: PartInfo, th: Thresholds, batch_size: int, errors: tuple) -> Partial | Exception:
    """One part's Partial, decoded in this thread (the other threads keep the other cores busy)."""
    red = PartReducer(part, th)
    try:  # the batch boundaries of _part_batches: every path sums a part's rows in the same order
        for batch in _batches(part, min(batch_size, KERNEL_ROWS), use_threads=False):
            red.add(batch)
    except errors as e:
        return e
    return red.result()


def _part_batches(parts: Sequence[PartInfo], batch_size: int, errors: tuple) -> Iterator:
    """(index, batch) of every part in turn, then (index, None); (index, error) when unreadable."""
    for i, part in enumerate(parts):
        try:
            # Small batches fill the decode/kernel pipeline quickly: a part is a few of them.
            for batch in _batches(part, min(batch_size, KERNEL_ROWS), use_threads=True):
                yield i, batch
        except errors as e:
            yield i, e
            continue
        yield i, None


def _pipelined(parts: Sequence[PartInfo], th: Thresholds, batch_size: int,
               errors: tuple) -> Iterator[tuple[int, Partial | Exception]]:
    """compute_parts with one kernel thread: a reader thread decodes ahead across parts."""
    red, failed = None, set()
    for i, item in prefetched(_part_batches(parts, batch_size, errors), depth=3):
        if i in failed:
            continue
        if isinstance(item, BaseException):
            failed.add(i)
            red = None
            yield i, item
        elif item is None:
            yield i, (red or PartReducer(parts[i], th)).result()
            red = None
        else:
            if red is None:
                red = PartReducer(parts[i], th)
            try:
                red.add(item)
            except errors as e:
                failed.add(i)
                red = None
                yield i, e


# ---- cache -----------------------------------------------------------------------------


def cache_key(part: PartInfo, th: Thresholds) -> str:
    settings = json.dumps([PARTIAL_VERSION, part.key, th.__dict__], sort_keys=True)
    return hashlib.sha1(settings.encode()).hexdigest()


def cache_path(cache_dir: Path, part: PartInfo, th: Thresholds) -> Path:
    """Where the partial of `part` is cached under a run's cache directory (Run.cache_dir())."""
    return cache_dir / "partials" / f"{cache_key(part, th)}.part"


CACHE_MAGIC = b"KLDPART1"


def save(path: Path, p: Partial) -> bool:
    """Write a partial atomically; False when the run directory is read-only.

    Layout: magic, 8-byte header length, a JSON header of (name, dtype, shape, offset), then
    the arrays' raw bytes. Loading a run's partials is then a read and a json.loads per
    part; np.savez's per-array headers made a cached re-analysis 5x slower (200 ms for 34 parts).
    """
    arrays = {f"{t}/{name}": np.ascontiguousarray(col) for t in TABLES for name, col in getattr(p, t).items()}
    arrays["rows"] = np.array([p.rows], np.int64)
    if any(a.dtype.hasobject for a in arrays.values()):  # raw bytes of pointers mean nothing: do not cache
        return False
    header, offset = [], 0
    for name, a in arrays.items():
        header.append([name, a.dtype.str, list(a.shape), offset])
        offset += a.nbytes
    head = json.dumps(header).encode()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        with open(tmp, "wb") as f:
            f.write(CACHE_MAGIC + len(head).to_bytes(8, "little") + head)
            for a in arrays.values():
                f.write(a.tobytes())
        os.replace(tmp, path)
        return True
    except OSError:
        return False


def load(path: Path) -> Partial | None:
    """A cached partial, or None when absent or unreadable (it is then recomputed)."""
    try:
        buf = path.read_bytes()
        if buf[:8] != CACHE_MAGIC:
            return None
        n_head = int.from_bytes(buf[8:16], "little")
        body = 16 + n_head
        tables: dict[str, dict] = {t: {} for t in TABLES}
        rows = None
        for name, dtype, shape, offset in json.loads(buf[16:body]):
            count = int(np.prod(shape))
            a = np.frombuffer(buf, np.dtype(dtype), count, body + offset).reshape(shape)
            if name == "rows":
                rows = int(a[0])
            else:
                t, col = name.split("/", 1)
                tables[t][col] = a
        return None if rows is None else Partial(**tables, rows=rows)
    except (OSError, ValueError, KeyError, TypeError):
        return None
