"""The Recorder's options: one dataclass, every default on one screen (`kldiag.RecorderConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class RecorderConfig:
    """How a `kldiag.Recorder` records. Each field is also a keyword of `Recorder(run_dir, ...)`."""

    # What the run's manifest (run.json) says about the training.
    beta: float | None = None  # the KL coefficient the trainer uses
    estimator: str | None = None  # its KL loss: "k1", "k2", "k3", "k3_is", "k3_clamped"
    clip_range: float | tuple[float, float] | None = None  # PPO clip epsilon, or (low, high)
    trainer: str | None = None  # "trl", "verl", "slime", ... (fixes are phrased in its option names)
    trainer_version: str | None = None
    config: dict[str, Any] | None = None  # more trainer settings for the manifest (loss_type, ...)
    tags: dict[str, Any] | list[str] | None = None  # free-form labels of the run
    tokenizer: Any = None  # a tokenizer (or {id: text}) for the vocab sidecar: token text in every view
    full_routes: bool = False  # v1.3: store the MoE routes' expert lists too, not only their per-token summary
    # Where this process writes.
    world_size: int | None = None  # default: $WORLD_SIZE, else 1
    rank: int | None = None  # default: $RANK, else 0 (one writer, one folder tokens/rank-R per rank)
    # When a part file is published (whichever comes first).
    rotate_rows: int = 1_000_000  # rows per part
    rotate_steps: int | None = None  # steps per part
    rotate_seconds: float | None = 60.0  # seconds since the part's first row (what `watch` sees live)
    # The queue between record() and the writer.
    queue_batches: int = 64  # micro-batches waiting at most
    backpressure: str = "block"  # queue full: "block" (wait for the writer) or "drop" (count and drop)
    # Sampling, to record less of a long run.
    every_n_steps: int = 1  # record the steps divisible by this
    seq_fraction: float = 1.0  # share of sequences kept, by a hash of the sequence id (the same on every rank)
    # The flight recorder, while sampling: the last steps whole, published when a guard fires.
    flight_steps: int = 0  # steps kept at full fidelity on the host (0: off); only when sampling
    flight_bytes: int = 256 << 20  # the ring's bound in bytes (the oldest steps go first)
    # Failures and priority.
    strict: bool = False  # raise RecorderError on a write error instead of warning and counting it
    writer_nice: int | None = 10  # niceness of the writer threads (None: leave it)

    def __post_init__(self) -> None:
        if self.backpressure not in ("block", "drop"):
            raise ValueError(f"backpressure={self.backpressure!r}; pass 'block' (wait for the writer) or 'drop'")
        if self.every_n_steps < 1 or not 0.0 < self.seq_fraction <= 1.0:
            raise ValueError(f"every_n_steps={self.every_n_steps}, seq_fraction={self.seq_fraction}; "
                             "pass every_n_steps >= 1 and 0 < seq_fraction <= 1")
        if self.rotate_rows < 1 or self.queue_batches < 1:
            raise ValueError("rotate_rows and queue_batches must be >= 1")
        if self.flight_steps < 0 or self.flight_bytes < 1:
            raise ValueError(f"flight_steps={self.flight_steps}, flight_bytes={self.flight_bytes}; "
                             "pass flight_steps >= 0 (0: off) and flight_bytes >= 1")

    @classmethod
    def build(cls, options: RecorderConfig | None = None, **changes: Any) -> RecorderConfig:
        """`options` (or the defaults) with `changes`; an unknown keyword is a TypeError naming the valid ones."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise TypeError(f"Recorder got unknown option(s) {', '.join(unknown)}; "
                            f"valid: {', '.join(sorted(names))}")
        base = {f.name: getattr(options, f.name) for f in fields(cls)} if options is not None else {}
        return cls(**{**base, **changes})
