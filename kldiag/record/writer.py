"""The recorder's host side: staging buffers, and the background threads that write Parquet parts.

Host batches become Arrow record batches (kldiag.record.rows), then published Parquet parts.

The training thread stages its arrays into reused host buffers (Stager: pinned memory and
non-blocking copies for CUDA tensors) and hands `HostBatch` objects over a bounded queue
(kldiag.record.recorder); the writer thread waits for the device copies, keeps only completion
tokens, buffers record batches and publishes one part per rotation (rows, steps or seconds,
whichever first) with kldiag.format.publish_part (temp file, fsync, rename). It never
raises into the training thread: failures are counted, warned about once, and re-raised
by the recorder only in strict mode.

Yielding to training: the writer converts, and a second thread (_Publisher) encodes and
publishes, so a publish never delays the conversion of the batches queued behind it (at
most one part waits for the publisher: memory stays bounded). The publisher (Parquet
encoding, compression, fsync: the bulk of the writer's CPU on large batches) lowers its OS
priority (`nice`, Linux: setpriority on its thread id) so training threads win the cores.
The converter keeps the trainer's priority: a TRL log waits for it (`converted` counts the
host batches converted so far, Writer.wait_converted), and a deprioritised thread holding
the GIL or owing a log would stall the training thread (a priority inversion).
"""

from __future__ import annotations

import concurrent.futures.thread  # noqa: F401 - pyarrow imports it on first write; at exit that import fails
import errno
import os
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from kldiag import format as F
from kldiag.errors import StorageError
from kldiag.record.rows import (  # noqa: F401 - HostBatch, to_record_batch and the rest: the recorder's names
    HostArray,
    HostBatch,
    Raw,
    Rows,
    conform,
    gather_pending,
    gather_rows,
    host_columns,
    rows_to_record_batch,
    to_record_batch,
)

CONVERT_ROWS = 1 << 16  # rows (padded, while not gathered) converted to Arrow at once: per-call costs amortised
STATS_KEYS = ("rows", "files", "bytes", "dropped_rows", "lost_rows", "write_errors",
              "nonfinite", "invalid", "sampled_out_rows", "skipped_steps", "placeholders")


def torch_of(x: Any) -> Any:
    """The torch module when x is a torch tensor (torch is never imported here), else None."""
    torch = sys.modules.get("torch")
    return torch if torch is not None and isinstance(x, torch.Tensor) else None


class Stager:
    """Copies arrays into host buffers the writer owns (pinned for CUDA), reusing them.

    Fresh host memory costs page faults (bench: 5 ms per [64, 2048] micro-batch here, vs
    0.4 ms reused) and pinned memory a cudaHostAlloc. Buffers are flat byte arrays pooled
    by power-of-two size, so micro-batches whose padded length changes every call still
    reuse them; at most `keep` buffers per size class are kept.
    """

    SMALL = 1 << 16  # bytes: below this a fresh copy is cheaper than the pool's bookkeeping

    def __init__(self, keep: int):
        self.keep = keep
        self.pools: dict[tuple[int, bool], deque] = {}

    def _buffer(self, nbytes: int, pinned: bool, make: Callable[[int], Any]) -> tuple[Any, Callable[[], None]]:
        size = 1 << max(nbytes - 1, 1).bit_length()
        pool = self.pools.setdefault((size, pinned), deque())
        flat = pool.pop() if pool else make(size)
        keep = self.keep

        def release() -> None:
            if len(pool) < keep:
                pool.append(flat)
        return flat[:nbytes], release

    def stage(self, x: Any) -> HostArray:
        torch = torch_of(x)
        if torch is None:
            a = np.asarray(x)
            if a.nbytes <= self.SMALL:  # small arrays (no page faults): a plain copy
                return HostArray(a.copy())
            flat, release = self._buffer(a.nbytes, False, lambda n: np.empty(n, np.uint8))
            buf = flat.view(a.dtype).reshape(a.shape)
            np.copyto(buf, a)
            return HostArray(buf, "plain", release)
        t = x.detach() if x.requires_grad else x  # detach() builds a new tensor object: a few us each
        bf16 = t.dtype == torch.bfloat16
        if t.is_cuda:
            flat, release = self._buffer(t.numel() * t.element_size(), True,
                                         lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True))
            buf = flat.view(t.dtype).view(t.shape)
            buf.copy_(t, non_blocking=True)
            return HostArray(buf.view(torch.int16) if bf16 else buf, "bf16" if bf16 else "plain", release)
        if not t.is_cpu:  # mps, xpu, ...: a blocking copy gives a fresh host tensor
            t = t.to("cpu")
            return HostArray(t.view(torch.int16).numpy() if bf16 else t.numpy(), "bf16" if bf16 else "plain")
        if t.numel() * t.element_size() <= self.SMALL:
            return HostArray((t.view(torch.int16) if bf16 else t).numpy().copy(), "bf16" if bf16 else "plain")
        staged = self.stage(t.view(torch.int16).numpy() if bf16 else t.numpy())
        staged.kind = "bf16" if bf16 else "plain"
        return staged


@dataclass
class _Flush:
    done: threading.Event = field(default_factory=threading.Event)


_STOP = object()


def lower_priority(nice: int | None) -> None:
    """Raise the calling thread's nice value by `nice` (Linux: per thread; elsewhere a no-op).

    An unprivileged thread may always lower its own priority; training threads then win the
    cores when the writer competes with them.
    """
    if not nice or not hasattr(os, "setpriority") or not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + int(nice)))
    except OSError:
        pass  # a sandbox that forbids it: run at the inherited priority


class _Publisher(threading.Thread):
    """Encodes and publishes the parts the Writer hands over, in order, one at a time."""

    def __init__(self, writer: Writer, nice: int | None):
        super().__init__(name=f"{writer.name}-publish", daemon=True)
        self.writer, self.nice = writer, nice
        self.q: queue.Queue[Any] = queue.Queue(maxsize=1)  # one part publishing, one waiting: bounded memory
        self.cpu_s = 0.0

    def run(self) -> None:
        lower_priority(self.nice)
        try:
            while (item := self.q.get()) is not _STOP:
                try:
                    self.writer.write_part(*item)
                finally:
                    self.q.task_done()
        finally:
            self.cpu_s = time.thread_time()


class Writer(threading.Thread):
    """Converts the queue's host batches; hands parts to its publisher. `stats` is read by the training thread.

    `observers` are called here with each batch's host columns ({name: numpy array}, after the
    device copies completed) before the buffers go back to the pool.
    """

    def __init__(self, store: F.Store, rank: int, attempt: int, q: queue.Queue[Any], *, rotate_rows: int,
                 rotate_steps: int | None, rotate_seconds: float | None, stats: dict[str, int],
                 on_error: Callable[[BaseException], None], on_publish: Callable[[], None], nice: int | None = None,
                 index: int = 0):
        super().__init__(name=f"kldiag-writer-rank{rank}", daemon=True)
        self.store, self.rank, self.attempt, self.q = store, rank, attempt, q
        self.rotate_rows, self.rotate_steps, self.rotate_seconds = rotate_rows, rotate_steps, rotate_seconds
        self.stats, self.on_error, self.on_publish = stats, on_error, on_publish
        self.directory = F.rank_rel(rank)
        self.index = index  # first free part index of the rank (the recorder listed the run once)
        self.buffer: list[pa.RecordBatch] = []  # converted rows of the next part
        self.pending: list[Raw | Rows] = []  # rows of the next part, converted CONVERT_ROWS cells at a time
        self.pending_cells = 0
        self.buffered_rows = 0  # rows of the next part, converted or not
        self.steps: set[int] = set()
        self.first_at = 0.0
        self.observers: list[Callable[[dict[str, np.ndarray]], None]] = []
        self.converted = 0  # host batches taken off the queue and converted (or failed)
        self.progress = threading.Condition()
        self.publisher = _Publisher(self, nice)
        self.stats_lock = threading.Lock()  # the publisher counts too
        self.cpu_s = 0.0  # thread CPU seconds of this thread, set when it ends (publisher: publisher.cpu_s)

    def run(self) -> None:
        self.publisher.start()  # it lowers its own priority; this thread keeps the trainer's
        try:
            F.clean_stale_temps(self.store, self.rank)  # left by a killed predecessor of this rank
        except OSError:
            pass  # an unwritable directory is reported by the first publish
        try:
            self._loop()
        finally:
            self.publisher.q.put(_STOP)
            self.publisher.join()
            self.cpu_s = time.thread_time()

    def _loop(self) -> None:
        while True:
            item = self._next()
            if item is None:  # rotation deadline passed with nothing new
                self.publish()
            elif item is _STOP:
                self.publish(wait=True)
                return
            elif isinstance(item, _Flush):
                self.publish(wait=True)
                item.done.set()
            else:
                self._add(item)
                with self.progress:
                    self.converted += 1
                    self.progress.notify_all()

    def wait_converted(self, target: int, timeout: float) -> bool:
        """Wait until `target` host batches are converted (observers called): True, or False on timeout."""
        with self.progress:
            return self.progress.wait_for(lambda: self.converted >= target or not self.is_alive(), timeout)

    def _next(self) -> Any:
        if not self.buffered_rows or self.rotate_seconds is None:
            return self.q.get()
        wait = self.first_at + self.rotate_seconds - time.monotonic()
        try:
            return self.q.get(timeout=max(wait, 0.0)) if wait > 0 else self.q.get_nowait()
        except queue.Empty:
            return None

    def _add(self, item: HostBatch) -> None:
        try:
            columns = host_columns(item)
            for fn in self.observers:
                try:
                    fn(columns)
                except Exception as e:  # noqa: BLE001 - an observer's bug must not stop the writer
                    self.on_error(e)
            if any(col.release is not None for col in item.columns.values()):
                rows: Raw | Rows = gather_rows(item, columns)  # pooled buffers go back to the pool now
            else:
                rows = Raw.of(item, columns)  # its own small copies: gathered with the next ones
        except Exception as e:  # noqa: BLE001 - a bad batch must not stop the writer
            self.count(write_errors=1)
            self.on_error(e)
            return
        if self.rotate_steps is not None and item.step not in self.steps and len(self.steps) >= self.rotate_steps:
            self.publish()
        if not self.buffered_rows:
            self.first_at = time.monotonic()
        self.pending.append(rows)
        self.pending_cells += rows.cells
        self.buffered_rows += rows.n
        self.steps.add(item.step)
        if self.buffered_rows >= self.rotate_rows:
            self.publish()
        elif self.pending_cells >= CONVERT_ROWS:  # padded size: memory stays bounded however sparse the rows
            pending, self.pending, self.pending_cells = self.pending, [], 0
            n = sum(item.n for item in pending)
            try:
                rb = self.convert(pending)
            except Exception as e:  # noqa: BLE001 - never kill the writer: these rows are counted as lost
                self.buffered_rows -= n
                self.count(write_errors=1, lost_rows=n)
                self.on_error(e)
                return
            self.buffered_rows -= n - rb.num_rows  # bad batches dropped (and counted) by convert
            self.buffer.append(rb)

    def convert(self, pending: list[Raw | Rows]) -> pa.RecordBatch:
        """Pending rows -> one Arrow record batch, counting nonfinite, invalid and placeholder rows.

        A batch that cannot be converted is dropped alone, counted (write_errors, lost_rows)
        and reported, as a batch that failed on arrival is.
        """
        rows = gather_pending(pending, self._bad_batch)
        rb, nonfinite, invalid, placeholders = rows_to_record_batch(rows, self.rank, self.attempt)
        self.count(nonfinite=nonfinite, invalid=invalid, placeholders=placeholders)
        return rb

    def _bad_batch(self, raw: Raw, e: Exception) -> None:
        self.count(write_errors=1, lost_rows=raw.n)
        self.on_error(e)

    def publish(self, wait: bool = False) -> None:
        """Hand the buffered rows to the publisher as one part; `wait`: until every part handed over is out.

        The rows not yet converted go as they are: the publisher, at its lower priority, converts them.
        """
        if self.buffered_rows:
            self.publisher.q.put((self.buffer, self.pending, self.buffered_rows, self.steps))
        self.buffer, self.pending, self.pending_cells, self.buffered_rows, self.steps = [], [], 0, 0, set()
        if wait:
            self.publisher.q.join()

    def write_part(self, batches: list[pa.RecordBatch], pending: list[Raw | Rows], rows: int, steps: set[int]) -> None:
        """Publisher thread: write one part; on failure count its rows as lost and go on."""
        try:
            if pending:
                rb = self.convert(pending)
                rows -= sum(item.n for item in pending) - rb.num_rows  # bad batches: counted by convert
                batches = [*batches, rb]
            table = conform(batches)
            name = F.part_name(min(steps), max(steps), self.index, self.attempt)
            size = F.publish(self.store, self.directory, name, table)
            self.index += 1
            self.count(rows=rows, files=1, bytes=size)
        except Exception as e:  # noqa: BLE001 - disk full, read-only, ...: never kill training
            self.count(write_errors=1, lost_rows=rows)
            self.on_error(e)
            return
        self.on_publish()

    def count(self, **n: int) -> None:
        with self.stats_lock:
            for key, v in n.items():
                self.stats[key] += v


def describe_error(e: BaseException) -> str:
    """A one-line cause with the fix for the usual disk failures."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"{e} (the disk is full: free space or point the Recorder at another directory)"
    if isinstance(e, StorageError):
        return str(e)
    if isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR):
        return f"{e} (the run directory is not writable: pass a writable run_dir)"
    return f"{type(e).__name__}: {e}"
