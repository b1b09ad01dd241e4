"""The recorder's background writer: host batches -> Arrow record batches -> Parquet parts.

The training thread hands `HostBatch` objects over a bounded queue (kldiag.recorder);
this thread waits for their device copies, keeps only completion tokens, buffers record
batches and publishes one part per rotation (rows, steps or seconds, whichever first)
with kldiag.format.publish_part (temp file, fsync, rename). It never raises into the
training thread: failures are counted, warned about once, and re-raised by the
recorder only in strict mode.
"""

from __future__ import annotations

import errno
import queue
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa

from kldiag import format as F

LOGP_COLUMNS = ("logp", "logp_old", "logp_ref", "logp_sampler")
FLOAT_INPUTS = (*LOGP_COLUMNS, "advantage", "entropy")
# Parquet options on top of kldiag.format.PARQUET_WRITE_OPTIONS (bench/recorder.py measures them):
# byte-stream-split puts the sign/exponent bytes of the float32 log-probs side by side, where
# zstd finds them; delta encoding stores the +1 runs of `pos` and the constant runs of `seq`
# in a few bits.
WRITE_OPTIONS: dict[str, Any] = dict(
    use_dictionary=["step", "micro", "iteration", "rank", "group", "token_id", "mask"],
    use_byte_stream_split=list(F.FLOAT_COLUMNS),
    column_encoding={"pos": "DELTA_BINARY_PACKED", "seq": "DELTA_BINARY_PACKED"},
)
STATS_KEYS = ("rows", "files", "bytes", "dropped_rows", "lost_rows", "write_errors",
              "nonfinite", "invalid", "sampled_out_rows", "skipped_steps")


@dataclass
class HostArray:
    """One column on (or on its way to) the host. kind: "plain" or "bf16" (raw uint16 bits)."""

    data: Any  # numpy array, or a pinned torch tensor filled by a non-blocking copy
    kind: str = "plain"
    release: Callable[[], None] | None = None  # hands a pooled buffer back once read

    def numpy(self) -> np.ndarray:
        a = self.data if isinstance(self.data, np.ndarray) else self.data.numpy()
        if self.kind == "bf16":
            # bfloat16 is the top half of a float32: widen the bits, no torch needed.
            return (a.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        return a


@dataclass
class HostBatch:
    """A micro-batch of [B, T] columns plus [B] row ids, as record() hands it over."""

    step: int
    micro: int
    iteration: int
    seq: np.ndarray  # int64 [B]
    group: np.ndarray | None  # int64 [B]
    columns: dict[str, HostArray] = field(default_factory=dict)  # logp..., token_id, mask, completion
    event: Any = None  # torch.cuda.Event recorded after the copies; waited on here


@dataclass
class _Flush:
    done: threading.Event = field(default_factory=threading.Event)


_STOP = object()


def _column(batch: HostBatch, name: str, keep: np.ndarray, dtype: Any) -> np.ndarray | None:
    col = batch.columns.get(name)
    if col is None:
        return None
    a = col.numpy()
    if a.ndim == 1:  # advantages given per sequence: one value for every token of the row
        a = np.broadcast_to(a[:, None], keep.shape)
    out = np.asarray(a[keep], dtype=dtype)
    return out


def to_record_batch(batch: HostBatch, rank: int) -> tuple[pa.RecordBatch, int, int]:
    """The completion tokens of `batch` as a TOKEN_SCHEMA record batch.

    Returns (record batch, nonfinite rows, invalid rows): a row is nonfinite when any of
    its log-probs is NaN/inf, invalid when any is > 0. Both are written as they are.
    """
    if batch.event is not None:
        batch.event.synchronize()
    shape = batch.columns["logp"].data.shape
    comp = batch.columns.get("completion") or batch.columns.get("mask")
    keep = comp.numpy().astype(bool, copy=False) if comp is not None else np.ones(shape, bool)
    n = int(keep.sum())
    lengths = keep.sum(axis=1)
    pos = np.broadcast_to(np.arange(shape[1], dtype=np.int32), shape)[keep]
    arrays: dict[str, pa.Array] = {
        "step": pa.array(np.full(n, batch.step, np.int64)),
        "micro": pa.array(np.full(n, batch.micro, np.int32)),
        "iteration": pa.array(np.full(n, batch.iteration, np.int16)),
        "rank": pa.array(np.full(n, rank, np.int16)),
        "seq": pa.array(np.repeat(batch.seq, lengths)),
        "group": (pa.array(np.repeat(batch.group, lengths)) if batch.group is not None
                  else pa.nulls(n, pa.int64())),
        "pos": pa.array(pos),
    }
    bad_nonfinite = np.zeros(n, bool)
    bad_invalid = np.zeros(n, bool)
    for name in FLOAT_INPUTS:
        v = _column(batch, name, keep, np.float32)
        if v is None:
            arrays[name] = pa.nulls(n, pa.float32())
            continue
        arrays[name] = pa.array(v)
        if name in LOGP_COLUMNS:
            with np.errstate(invalid="ignore"):
                bad_nonfinite |= ~np.isfinite(v)
                bad_invalid |= v > 0
    tok = _column(batch, "token_id", keep, np.int32)
    arrays["token_id"] = pa.array(tok) if tok is not None else pa.nulls(n, pa.int32())
    mask = _column(batch, "mask", keep, bool)
    arrays["mask"] = pa.array(mask if mask is not None else np.ones(n, bool))
    for col in batch.columns.values():
        if col.release is not None:
            col.release()
    rb = pa.RecordBatch.from_arrays([arrays[f.name] for f in F.TOKEN_SCHEMA], schema=F.TOKEN_SCHEMA)
    return rb, int(bad_nonfinite.sum()), int(bad_invalid.sum())


def _next_index(directory: Path) -> int:
    """First free part index of a rank: a resumed run never overwrites its earlier parts."""
    if not directory.is_dir():
        return 0
    found = [int(m.group(3) or 0) for m in map(F.PART_RE.match, (p.name for p in directory.iterdir())) if m]
    return max(found) + 1 if found else 0


class Writer(threading.Thread):
    """Consumes the queue; publishes parts. `stats` is read by the training thread."""

    def __init__(self, run_dir: Path, rank: int, q: "queue.Queue[Any]", *, rotate_rows: int,
                 rotate_steps: int | None, rotate_seconds: float | None, stats: dict[str, int],
                 on_error: Callable[[BaseException], None], on_publish: Callable[[], None]):
        super().__init__(name=f"kldiag-writer-rank{rank}", daemon=True)
        self.run_dir, self.rank, self.q = run_dir, rank, q
        self.rotate_rows, self.rotate_steps, self.rotate_seconds = rotate_rows, rotate_steps, rotate_seconds
        self.stats, self.on_error, self.on_publish = stats, on_error, on_publish
        self.directory = F.rank_dir(run_dir, rank)
        self.index: int | None = None
        self.buffer: list[pa.RecordBatch] = []
        self.buffered_rows = 0
        self.steps: set[int] = set()
        self.first_at = 0.0

    def run(self) -> None:
        while True:
            item = self._next()
            if item is None:  # rotation deadline passed with nothing new
                self.publish()
            elif item is _STOP:
                self.publish()
                return
            elif isinstance(item, _Flush):
                self.publish()
                item.done.set()
            else:
                self._add(item)

    def _next(self) -> Any:
        if not self.buffer or self.rotate_seconds is None:
            return self.q.get()
        wait = self.first_at + self.rotate_seconds - time.monotonic()
        try:
            return self.q.get(timeout=max(wait, 0.0)) if wait > 0 else self.q.get_nowait()
        except queue.Empty:
            return None

    def _add(self, item: HostBatch) -> None:
        try:
            rb, nonfinite, invalid = to_record_batch(item, self.rank)
        except Exception as e:  # noqa: BLE001 - a bad batch must not stop the writer
            self.stats["write_errors"] += 1
            self.on_error(e)
            return
        self.stats["nonfinite"] += nonfinite
        self.stats["invalid"] += invalid
        if self.rotate_steps is not None and item.step not in self.steps and len(self.steps) >= self.rotate_steps:
            self.publish()
        if not self.buffer:
            self.first_at = time.monotonic()
        self.buffer.append(rb)
        self.buffered_rows += rb.num_rows
        self.steps.add(item.step)
        if self.buffered_rows >= self.rotate_rows:
            self.publish()

    def publish(self) -> None:
        """Write the buffered rows as one part; on failure count them as lost and go on."""
        if not self.buffer:
            return
        table = pa.Table.from_batches(self.buffer, schema=F.TOKEN_SCHEMA)
        rows, steps = self.buffered_rows, self.steps
        self.buffer, self.buffered_rows, self.steps = [], 0, set()
        if rows == 0:
            return
        try:
            if self.index is None:
                self.index = _next_index(self.directory)
            name = F.part_name(min(steps), max(steps), self.index)
            path = F.publish_part(table, self.directory, name, **WRITE_OPTIONS)
            self.index += 1
            self.stats["rows"] += rows
            self.stats["files"] += 1
            self.stats["bytes"] += path.stat().st_size
        except Exception as e:  # noqa: BLE001 - disk full, read-only, ...: never kill training
            self.stats["write_errors"] += 1
            self.stats["lost_rows"] += rows
            self.on_error(e)
            return
        self.on_publish()


def describe_error(e: BaseException) -> str:
    """A one-line cause with the fix for the usual disk failures."""
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"{e} (the disk is full: free space or point the Recorder at another directory)"
    if isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR):
        return f"{e} (the run directory is not writable: pass a writable run_dir)"
    return f"{type(e).__name__}: {e}"
