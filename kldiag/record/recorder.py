"""Recorder: per-token log-probs from the training loop to a run directory (run format v1.3).

    with kldiag.Recorder("runs/x", beta=0.04, estimator="k3", clip_range=0.2) as rec:
        rec.record(step=step, logp=logp, logp_old=logp_old, logp_ref=logp_ref, mask=mask)

The training thread only validates shapes and starts the device-to-host copies (pinned
buffers and non-blocking copies for CUDA tensors, one CUDA event per batch); a background
thread (kldiag.record.writer) builds the Arrow tables and publishes Parquet parts atomically.
docs/recorder.md covers options, guarantees and the default seq id scheme.
"""

from __future__ import annotations

import atexit
import os
import queue
import signal
import sys
import threading
import time
import warnings
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

from kldiag import format as F
from kldiag.errors import RecorderError
from kldiag.record import flight as FL
from kldiag.record import writer as W
from kldiag.record.config import RecorderConfig
from kldiag.record.inputs import check_shapes, detect_rank, seq_unit, shape_of
from kldiag.record.routes import check_ids
from kldiag.version import __version__

if TYPE_CHECKING:
    from typing_extensions import Self

SEQ_LOCAL_BITS = 20  # default seq id: ((((step * world_size + rank) << 12) + attempt % 4096) << 20) + k
SEQ_ATTEMPT_BITS = 12
COLUMN_OF = {"completion_mask": "completion", "token_ids": "token_id", "seq_ids": "seq", "group_ids": "group",
             "advantages": "advantage"}


_OPEN: weakref.WeakSet[Recorder] = weakref.WeakSet()
_PREVIOUS_SIGTERM: Any = None


def _close_all() -> None:
    for rec in list(_OPEN):
        rec.close(_from_exit=True)


def _on_sigterm(signum: int, frame: Any) -> None:
    """Publish every recorded row, then do what SIGTERM did before kldiag was attached.

    Recorders stay open: a previous handler that only asks for a graceful stop lets
    training (and recording) go on to its end.
    """
    for rec in list(_OPEN):
        rec.flush()
        rec._write_stats()
        rec._write_manifest(final=True)
    previous = _PREVIOUS_SIGTERM
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


def _install_sigterm() -> None:
    global _PREVIOUS_SIGTERM
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) is _on_sigterm:
        return
    _PREVIOUS_SIGTERM = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, _on_sigterm)


atexit.register(_close_all)


class _Queue(queue.Queue):
    """A queue whose lock is re-entrant: the SIGTERM handler may flush while record() holds it."""

    def __init__(self, maxsize: int):
        super().__init__(maxsize)
        self.mutex = threading.RLock()
        self.not_empty = threading.Condition(self.mutex)
        self.not_full = threading.Condition(self.mutex)
        self.all_tasks_done = threading.Condition(self.mutex)


class Recorder:
    """Records per-token log-probs of one training run (one instance per rank).

    Every argument of record() is a [batch, time] array (torch tensor on any device and
    dtype, or numpy), except advantages ([batch] or [batch, time]), seq_ids/group_ids
    ([batch]) and the top-k ones ([batch, time, k]). Writer failures warn once and are
    counted (strict=True raises RecorderError).
    """

    def __init__(self, run_dir: str | os.PathLike, options: RecorderConfig | None = None, **kwargs: Any):
        """run_dir: a directory or a URI (s3://bucket/prefix). options: a RecorderConfig; any of its
        fields may also be passed as a keyword (`Recorder(run, beta=0.04, estimator="k3")`)."""
        o = self.options = RecorderConfig.build(options, **kwargs)
        beta, estimator, clip_range, config, tags = o.beta, o.estimator, o.clip_range, o.config, o.tags
        rotate_rows, queue_batches, backpressure, strict = o.rotate_rows, o.queue_batches, o.backpressure, o.strict
        self.store = F.resolve(run_dir)
        self.run_dir = F.run_path(self.store)
        self.rank, self.world_size = detect_rank(o.rank, o.world_size)
        self.store.check()  # a missing bucket or an unreachable endpoint is a clear error here, not mid-run
        self.attempt, first_index = F.next_attempt(self.store, self.rank)
        self.backpressure, self.strict = backpressure, strict
        self.every_n_steps, self.seq_fraction = int(o.every_n_steps), float(o.seq_fraction)
        sampling = self.every_n_steps > 1 or self.seq_fraction < 1.0
        self._flight = FL.Ring(o.flight_steps, o.flight_bytes) if o.flight_steps and sampling else None
        self._stats = dict.fromkeys(W.STATS_KEYS, 0)
        self._error: BaseException | None = None
        self._warned: set[str] = set()
        self._lock = threading.RLock()
        self._manifest_lock = threading.Lock()
        self._seq_next: dict[tuple[int, int], int] = {}
        self._queued = 0  # host batches put on the queue (Writer.converted catches up)
        self._closed = False
        self._last_stats_write = time.monotonic()
        if isinstance(clip_range, (int, float)):
            clip_range = (float(clip_range), float(clip_range))
        cfg = {"beta": beta, "estimator": estimator, "clip_range": list(clip_range) if clip_range else None}
        self.manifest = F.Manifest(
            kldiag_version=_version(), config={**{k: v for k, v in cfg.items() if v is not None}, **(config or {})},
            trainer={k: v for k, v in (("name", o.trainer), ("version", o.trainer_version)) if v is not None},
            world_size=self.world_size, tags=dict.fromkeys(tags, True) if isinstance(tags, (list, tuple)) else
            dict(tags or {}), sampling={"every_n_steps": self.every_n_steps, "seq_fraction": self.seq_fraction,
                                        "seq_hash": "splitmix64"})
        if self.rank == 0:
            F.resume_manifest(self.store, self.manifest, self.attempt)
        self._stager = W.Stager(keep=queue_batches + 2)
        self._queue: queue.Queue = _Queue(queue_batches)
        self._writer = W.Writer(self.store, self.rank, self.attempt, self._queue, rotate_rows=rotate_rows,
                                rotate_steps=o.rotate_steps, rotate_seconds=o.rotate_seconds, stats=self._stats,
                                on_error=self._on_error, on_publish=self._on_publish, nice=o.writer_nice,
                                index=first_index)
        self._write_manifest()
        if o.tokenizer is not None:
            self.write_vocab(o.tokenizer)
        self._writer.start()
        _OPEN.add(self)
        _install_sigterm()
        self._raise_if_failed()

    # ---- the training-thread side -----------------------------------------------------

    def record(self, *, step: int, logp: Any, logp_old: Any = None, logp_ref: Any = None, logp_sampler: Any = None,
               advantages: Any = None, mask: Any = None, completion_mask: Any = None, token_ids: Any = None,
               seq_ids: Any = None, group_ids: Any = None, entropy: Any = None, micro: int = 0,
               iteration: int = 0, turn: Any = None, topk_ids: Any = None, topk_logp: Any = None,
               topk_ids_sampler: Any = None, topk_logp_sampler: Any = None,
               experts: Any = None, experts_sampler: Any = None, route_margin_trainer: Any = None,
               route_margin_layer: Any = None, policy_version: Any = None, task: Any = None) -> None:
        """Queue one micro-batch. Shapes are checked before anything is copied or queued.

        Format v1.2, optional: turn [B, T] ints (the token's turn in its sequence: 0, 1, ...);
        topk_ids/topk_logp [B, T, K] (the trainer's top-k token ids and log-probs at each
        position) and topk_ids_sampler/topk_logp_sampler [B, T, K'] (the engine's); each
        side's ids and log-probs come together. Stored only where given (docs/format.md).

        Format v1.3, optional: experts/experts_sampler [B, T, L, k] ints, the trainer's and the engine's
        routed expert ids per token and MoE layer (-1: no route). Stored as a per-token comparison
        (kldiag.record.routes), the lists themselves only with full_routes=True. route_margin_trainer [B, T]
        floats and route_margin_layer [B, T] ints: the trainer router's confidence at the token (the minimum
        over MoE layers of its margin, NaN where none was measured) and the layer giving it.
        Format v1.3, optional: policy_version, ints [B] (the trainer step whose weights generated the
        sequence; staleness = step - policy_version) or [B, T] (the version that generated each token:
        partial or interruptible rollouts that straddle a weight update), and task [B] (strings: the
        sequence's task or environment).
        """
        given = {"logp": logp, "logp_old": logp_old, "logp_ref": logp_ref, "logp_sampler": logp_sampler,
                 "entropy": entropy, "mask": mask, "completion_mask": completion_mask, "token_ids": token_ids,
                 "advantages": advantages, "seq_ids": seq_ids, "group_ids": group_ids, "turn": turn,
                 "topk_ids": topk_ids, "topk_logp": topk_logp, "topk_ids_sampler": topk_ids_sampler,
                 "topk_logp_sampler": topk_logp_sampler,
                 "policy_version": policy_version, "task": task}
        routes = {"experts": experts, "experts_sampler": experts_sampler}  # v1.3
        given.update(route_margin_trainer=route_margin_trainer, route_margin_layer=route_margin_layer)
        given.update({k: v for k, v in routes.items() if v is not None})
        args = {k: v for k, v in given.items() if v is not None}
        step, micro, iteration = int(step), int(micro), int(iteration)
        batch, _ = check_shapes(args)
        for name in routes:
            if name in args:
                check_ids(name, args[name])
        with self._lock:
            self._raise_if_failed()
            if self._closed:
                raise RecorderError(f"record() after close() on the recorder of {self.run_dir}; "
                                    "open a new kldiag.Recorder for more rows")
            if self._flight is not None:  # the whole batch, before sampling: the flight recorder's ring
                if "seq_ids" not in args:
                    args["seq_ids"] = self._default_seq_ids(step, iteration, batch)
                self._flight.add(step, micro, iteration, args)
            if step % self.every_n_steps:
                self._stats["skipped_steps"] += 1
                return
            if "seq_ids" not in args:
                args["seq_ids"] = self._default_seq_ids(step, iteration, batch)
            if self.seq_fraction < 1.0:
                args = self._sample_rows(args)
                if args is None:
                    return
            if self.backpressure == "drop" and self._queue.full():
                self._drop(args)
                return
            self._queue.put(self._stage(step, micro, iteration, args))
            self._queued += 1

    def _default_seq_ids(self, step: int, iteration: int, batch: int) -> np.ndarray:
        """((((step * world_size + rank) << 12) + attempt % 4096) << 20) + k, k counting this
        rank's rows at (step, iteration): the same sequence on every iteration, and never the
        id of another attempt's sequence at that step."""
        if step < 0:
            raise ValueError(f"step={step} is negative; pass step >= 0, or pass seq_ids")
        k = self._seq_next.get((step, iteration), 0)
        high = ((step * self.world_size + self.rank) << SEQ_ATTEMPT_BITS) + self.attempt % (1 << SEQ_ATTEMPT_BITS)
        if k + batch > 1 << SEQ_LOCAL_BITS or high >= 1 << (63 - SEQ_LOCAL_BITS):
            raise ValueError(f"default seq ids overflow at step {step} (row {k + batch}); pass seq_ids")
        if len(self._seq_next) > 4096:  # old steps are done: keep the counter table small
            for key in list(self._seq_next)[:2048]:
                del self._seq_next[key]
        self._seq_next[(step, iteration)] = k + batch
        return (high << SEQ_LOCAL_BITS) + k + np.arange(batch, dtype=np.int64)

    def _sample_rows(self, args: dict[str, Any]) -> dict[str, Any] | None:
        """Keep the rows whose seq id hashes below seq_fraction (same rows on every iteration)."""
        seq = args["seq_ids"]
        seq = seq.detach().cpu().numpy() if W.torch_of(seq) is not None else np.asarray(seq)
        keep = np.flatnonzero(seq_unit(seq) < self.seq_fraction)
        self._stats["sampled_out_rows"] += len(seq) - len(keep)
        if len(keep) == 0:
            return None
        if len(keep) == len(seq):
            return args
        out = {}
        for name, x in args.items():
            torch = W.torch_of(x)
            out[name] = x[torch.from_numpy(keep).to(x.device)] if torch is not None else np.asarray(x)[keep]
        return out

    def _stage(self, step: int, micro: int, iteration: int, args: dict[str, Any]) -> W.HostBatch:
        columns = {COLUMN_OF.get(name, name): self._stager.stage(x) for name, x in args.items()}
        devices = {x.device for x in args.values() if getattr(x, "is_cuda", False)}  # numpy has no is_cuda
        events = []
        if devices:
            torch = sys.modules["torch"]
            for device in devices:
                events.append(torch.cuda.Event())
                events[-1].record(torch.cuda.current_stream(device))
        return W.HostBatch(step, micro, iteration, columns, events, self.options.full_routes)

    def _drop(self, args: dict[str, Any]) -> None:
        comp = args.get("completion_mask", args.get("mask"))
        if comp is not None and W.torch_of(comp) is not None:
            comp = comp.numpy() if comp.device.type == "cpu" else None  # no device sync to count
        rows = int(np.count_nonzero(comp)) if comp is not None else int(np.prod(shape_of(args["logp"])))
        self._stats["dropped_rows"] += rows
        self._warn_once("drop", f"kldiag: the writer of {self.run_dir} is behind; dropping micro-batches "
                        "(backpressure='drop'); stats['dropped_rows'] counts them. Raise queue_batches, "
                        "sample with every_n_steps/seq_fraction, or use backpressure='block'")

    # ---- control ------------------------------------------------------------------------

    @property
    def flight_on(self) -> bool:
        """Whether this recorder keeps a flight ring (it samples, and flight_steps > 0)."""
        return self._flight is not None

    @property
    def flight_nbytes(self) -> int:
        """Host bytes the flight ring holds now (at most flight_bytes; 0 without a ring)."""
        return self._flight.nbytes if self._flight is not None else 0

    def dump_flight(self, trigger: dict[str, Any] | None = None, figures: dict[str, Any] | None = None) -> str | None:
        """Publish the flight recorder's ring as an evidence bundle (a run at RUN/flight/<step>-<kind>/
        with flight.json); returns its path or URI, None when the recorder keeps no ring (it records
        every row, or flight_steps is 0). `trigger`: what fired ({"kind", "start", "message", ...})."""
        if self._flight is None:
            return None
        return FL.publish(self, type(self), self._flight.snapshot(), trigger, figures)

    def update_config(self, **kv: Any) -> None:
        """Merge `kv` into manifest["config"] (facts learned after the recorder started)."""
        self.manifest.config.update(kv)
        self._write_manifest()
        self._raise_if_failed()

    def write_vocab(self, tokenizer: Any) -> None:
        """Write RUN/vocab.parquet from a tokenizer (rank 0 only: every rank shares it)."""
        if self.rank != 0:
            return
        try:
            F.write_vocab(self.run_dir, tokenizer)
        except TypeError:
            raise
        except Exception as e:  # noqa: BLE001 - a disk failure is counted like any write error
            self._stats["write_errors"] += 1
            self._on_error(e)
        self._raise_if_failed()

    def observe(self, fn: Any) -> None:
        """Call fn({column: [B, T] or [B] numpy array}) in the writer thread for each recorded batch."""
        self._writer.observers.append(fn)

    def wait_converted(self, timeout: float = 1.0) -> bool:
        """Wait until the writer has converted (observers called, not published) every batch recorded so far."""
        return self._writer.wait_converted(self._queued, timeout)

    @property
    def writer_cpu_s(self) -> float:
        """Thread CPU seconds of the writer and publisher threads (known once closed)."""
        return self._writer.cpu_s + self._writer.publisher.cpu_s

    def flush(self, timeout: float | None = None) -> None:
        """Block until every micro-batch recorded so far is published."""
        if self._closed:
            return
        marker = W._Flush()
        self._queue.put(marker)
        deadline = None if timeout is None else time.monotonic() + timeout
        while not marker.done.wait(0.5):
            if not self._writer.is_alive() or (deadline is not None and time.monotonic() > deadline):
                break
        self._raise_if_failed()

    def close(self, _from_exit: bool = False) -> None:
        """Publish everything, then write the writer statistics (and, on rank 0, the manifest). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            _OPEN.discard(self)
            self._queue.put(W._STOP)
        self._writer.join()
        self._note_placeholders()
        self._write_stats()
        self._write_manifest(final=True)
        if not _from_exit:
            self._raise_if_failed()

    @property
    def stats(self) -> dict[str, int]:
        """rows, files, bytes published; dropped_rows, lost_rows, write_errors, nonfinite, invalid,
        placeholders (tokens outside the loss with a 0.0 or NaN logp_sampler/logp_old), ..."""
        return dict(self._stats)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        # Inside an exception the data still goes out, but the user's error is the one raised.
        self.close(_from_exit=exc_type is not None)

    def __repr__(self) -> str:
        return f"Recorder({str(self.run_dir)!r}, rank={self.rank}/{self.world_size}, rows={self._stats['rows']})"

    # ---- failures, statistics, manifest ------------------------------------------------

    def _on_error(self, e: BaseException) -> None:
        if self._error is None:
            self._error = e
        if self.strict:
            return  # raised on the training thread's next call instead
        self._warn_once("error", f"kldiag: writing {self.run_dir} failed: {W.describe_error(e)}; training goes "
                        "on, the failure is counted in the manifest (writer.write_errors). Pass strict=True to "
                        "raise instead")

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def _note_placeholders(self) -> None:
        """Say once that placeholders were seen: the hook or dump filled logp_sampler/logp_old where
        the engine generated nothing; written as they are, read by no figure, counted."""
        n = self._stats["placeholders"]
        if n:
            self._warn_once("placeholders", f"kldiag: {n:,} token(s) outside the loss (mask false) of {self.run_dir} "
                            "hold a placeholder logp_sampler/logp_old (0.0 or NaN: tool output or a prompt echo the "
                            "engine never generated); no mismatch, IS or fault figure reads them. Counted in "
                            "stats['placeholders'] and the manifest's writer.placeholders")

    def _raise_if_failed(self) -> None:
        if self.strict and self._error is not None:
            e, self._error = self._error, None
            raise RecorderError(f"kldiag recorder for {self.run_dir} failed: {W.describe_error(e)}") from e

    def _on_publish(self) -> None:
        self._note_placeholders()
        if time.monotonic() - self._last_stats_write > 10.0:
            self._last_stats_write = time.monotonic()
            self._write_stats()
            self._write_manifest(final=True)

    def _write_stats(self) -> None:
        try:
            F.write_rank_stats(self.store, self.rank, {"rank": self.rank, "attempt": self.attempt, **self._stats},
                               self.attempt)
        except Exception as e:  # noqa: BLE001 - counted, never raised into training
            self._stats["write_errors"] += 1
            self._on_error(e)

    def _write_manifest(self, final: bool = False) -> None:
        """Rank 0 writes run.json; `final` adds the writer statistics of every rank seen so far."""
        if self.rank != 0:
            return
        with self._manifest_lock:
            try:
                if final:
                    per_rank = F.read_rank_stats(self.store)
                    per_rank[(0, self.attempt)] = {"rank": 0, **self._stats}
                    total = {k: sum(int(s.get(k, 0)) for s in per_rank.values()) for k in W.STATS_KEYS}
                    self.manifest.writer = {**total, "ranks_reported": sorted({r for r, _ in per_rank}),
                                            "attempts_reported": sorted({a for _, a in per_rank})}
                F.write_manifest(self.store, self.manifest)
            except Exception as e:  # noqa: BLE001 - counted, never raised into training
                self._stats["write_errors"] += 1
                self._on_error(e)


def _version() -> str:
    return __version__
