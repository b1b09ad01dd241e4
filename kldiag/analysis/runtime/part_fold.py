"""Reading a run's parts for the reducers: each part opened once, its batches folded by every reducer.

`compute_part` opens one part, reads the union of the reducers' columns (`union_columns`) in
KERNEL_ROWS-row record batches with superseded rows removed, and folds each batch into every reducer's
state (`PartFold`, where a reducer may ride in its host's compiled pass); `fold_parts` does the same over
many parts with the next part's batches decoded while this one's fold (`prefetched`). The reducer
protocol itself is kldiag.analysis.protocol.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa

from kldiag.analysis.core.batch import Thresholds
from kldiag.analysis.core.partials import AnalysisReducer, Partial, from_arrays
from kldiag.analysis.protocol import KERNEL_ROWS, Arrays, Reducer
from kldiag.format import PartInfo, open_part, superseded_mask


def union_columns(reducers: Sequence[Reducer]) -> list[str]:
    """The columns any of the reducers reads, in first-seen order ("step" always: superseded rows)."""
    return list(dict.fromkeys(["step", *(c for r in reducers for c in r.columns)]))


def part_batches(part: PartInfo, columns: Sequence[str], batch_size: int, use_threads: bool = False) -> Iterator:
    """The record batches of one part, only `columns`; raises CorruptPartError when unreadable."""
    return open_part(part, columns).iter_batches(batch_size=batch_size, columns=list(columns),
                                                 use_threads=use_threads)


class PartFold:
    """Folds one part's batches into every reducer's state; superseded rows are dropped once for all.

    A reducer may ride on another (its `rides`: the other's name): when both are in the group and the host's
    `carry(state, rider, rider_state)` takes it, the host's pass fills the rider's state (one compiled loop
    where both work per token) and the rider is not handed the batches; either way its `finish` makes
    its partial, and alone it reads its batches itself."""

    def __init__(self, part: PartInfo, reducers: Sequence[Reducer]):
        self.part, self.reducers = part, list(reducers)
        self.states = [r.start(part) for r in self.reducers]
        self.dropped = 0
        index = {r.name: i for i, r in enumerate(self.reducers)}
        self.carried = set()
        for i, r in enumerate(self.reducers):
            h = index.get(getattr(r, "rides", None))
            if h is not None and h != i and self.reducers[h].carry(self.states[h], r, self.states[i]):
                self.carried.add(i)

    def add(self, batch: pa.RecordBatch) -> None:
        if self.part.exclude:  # rows of steps a later attempt re-recorded: counted, not reduced
            gone = superseded_mask(batch.column("step").to_numpy(), self.part.exclude)
            if gone.any():
                self.dropped += int(gone.sum())
                batch = batch.filter(pa.array(~gone))
        for i, (r, s) in enumerate(zip(self.reducers, self.states, strict=True)):
            if i not in self.carried:
                r.add(s, batch)

    def finish(self) -> dict[str, Arrays]:
        return {r.name: r.finish(s, self.dropped) for r, s in zip(self.reducers, self.states, strict=True)}


def compute_part(part: PartInfo, reducers: Sequence[Reducer], batch_size: int,
                 errors: tuple = ()) -> dict[str, Arrays] | Exception:
    """Every reducer's partial of one part from one read of it; the error when the part is unreadable
    (an error not in `errors` propagates). The entry point of threads, processes and Ray tasks."""
    fold = PartFold(part, reducers)
    try:
        for batch in part_batches(part, union_columns(reducers), batch_size):
            fold.add(batch)
    except errors as e:
        return e
    return fold.finish()


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


Job = tuple[PartInfo, Sequence[Reducer]]  # a part and the reducers that lack its partial


def fold_parts(jobs: Sequence[Job], batch_size: int, errors: tuple,
               threads: int | None = None) -> Iterator[tuple[int, dict[str, Arrays] | Exception]]:
    """(index, the reducers' partials or the part's error) of each job, in job order.

    With several parts and CPUs, `threads` threads (default: one per CPU) each decode and reduce
    whole parts: decoding and the kernels release the GIL, so every core does both. One part or
    one CPU: a reader thread decodes ahead across parts while this one reduces.
    """
    threads = min(len(jobs), threads or os.cpu_count() or 1)
    if threads <= 1:
        yield from _pipelined(jobs, batch_size, errors)
        return
    pool = ThreadPoolExecutor(threads, thread_name_prefix="kldiag-part")
    try:
        yield from enumerate(pool.map(lambda job: compute_part(job[0], job[1], batch_size, errors), jobs))
    finally:  # a consumer that stops early (strict mode) does not wait for the remaining parts
        pool.shutdown(wait=True, cancel_futures=True)


def _job_batches(jobs: Sequence[Job], batch_size: int, errors: tuple) -> Iterator:
    """(index, batch) of every part in turn, then (index, None); (index, error) when unreadable."""
    for i, (part, reducers) in enumerate(jobs):
        try:
            # Small batches fill the decode/reduce pipeline quickly: a part is a few of them.
            for batch in part_batches(part, union_columns(reducers), batch_size, use_threads=True):
                yield i, batch
        except errors as e:
            yield i, e
            continue
        yield i, None


def _pipelined(jobs: Sequence[Job], batch_size: int, errors: tuple) -> Iterator:
    """fold_parts with one reducing thread: a reader thread decodes ahead across parts."""
    fold, failed = None, set()
    for i, item in prefetched(_job_batches(jobs, batch_size, errors), depth=3):
        if i in failed:
            continue
        if isinstance(item, BaseException):
            failed.add(i)
            fold = None
            yield i, item
        elif item is None:
            yield i, (fold or PartFold(*jobs[i])).finish()
            fold = None
        else:
            fold = fold or PartFold(*jobs[i])
            try:
                fold.add(item)
            except errors as e:
                failed.add(i)
                fold = None
                yield i, e


def partial_of(part: PartInfo, th: Thresholds, batch_size: int) -> Partial:
    """One part's analysis Partial from one read of it (an unreadable part raises)."""
    red = AnalysisReducer(th)
    return from_arrays(compute_part(part, [red], min(batch_size, KERNEL_ROWS))[red.name])
