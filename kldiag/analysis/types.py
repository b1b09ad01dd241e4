"""The analysis contract: its configuration and its result. Every default on one screen.

Everything users see (CLI, report, dashboard, trainer logs) reads an `Analysis`. Tables are
pyarrow Tables (call `.to_pandas()` to display them); column names are a public contract,
documented in docs/metrics.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from kldiag import estimators as E
from kldiag.format import Manifest


@dataclass(frozen=True)
class AnalysisConfig:
    """Thresholds and knobs of `kldiag.analyze`. The CLI exposes each one."""

    tau: float = E.TAU  # theta_ll_ref: d > log(tau)
    weight_limit: float = E.WEIGHT_LIMIT  # weight_blowup: |1 - exp(d)| > weight_limit
    clamp: float = E.CLAMP  # clamp_saturated: k3 > clamp
    clip_low: float | None = None  # PPO clip range for rho; None: the manifest's, else 0.2
    clip_high: float | None = None
    opsm_delta: float | None = None  # off-policy sequence mask on mean(log mu - s); None: manifest's, else 1e-4
    top_k: int = 1000  # worst tokens by |k3 weight| kept in `flags` (every non-finite one too)
    top_k_sequences: int | None = None  # None: keep every sequence
    per_rank: bool = False  # also one row per (step, rank)
    trainer_compatible: bool = False  # add the KL the trainer logs (TRL: micro-batch means)
    alert_window: int = 20  # trailing steps whose median an alert compares against
    alert_factor: float = 10.0  # "leaves its recent range": a jump by this factor
    threads: int | None = None  # threads reading and reducing parts; None: one per core this process may use
    workers: int | None = None  # removed (a process pool, slower than the threads): setting it raises, naming threads
    strict: bool = False  # corrupt parts raise instead of being skipped with a warning
    batch_size: int = 1 << 20  # rows per record batch: bounds memory
    use_cache: bool = True  # per-file partials under RUN/.kldiag/
    engine: str = "local"  # "local" (this machine) or "ray" (Ray tasks; pip install 'kldiag[ray]')
    ray_address: str | None = None  # engine="ray": a cluster address; None: RAY_ADDRESS, else a local Ray


# Histogram bin edges shared by every run, so histograms of runs, files and ranks add up.
D_EDGES = np.linspace(-40.0, 40.0, 161)  # d = log(pi_ref/pi_theta): log-spaced in the ratio
# |weight| and rho: 2^e and sqrt(2) * 2^e (rounded), from 2^-27 (7.5e-9) to 2^54 (1.8e16).
# Two bins an octave (a ratio of 1.41), so that a bin is integer arithmetic on the bits (bins.py).
ABS_PER_OCTAVE = 2
_k = np.arange(-27 * ABS_PER_OCTAVE, 54 * ABS_PER_OCTAVE + 1)
ABS_EDGES = np.ldexp(2.0 ** ((_k % ABS_PER_OCTAVE) / ABS_PER_OCTAVE), _k // ABS_PER_OCTAVE)
HIST_EDGES: dict[str, np.ndarray] = {
    "d": D_EDGES,
    "weight_k3_abs": ABS_EDGES,
    "weight_k3_is_abs": ABS_EDGES,
    "rho": ABS_EDGES,
}


@dataclass
class Histograms:
    """Per-step histograms. counts[name] has shape [len(steps), len(edges[name]) + 1].

    Bin 0 counts values below edges[0] (and zeros for the log-spaced metrics), bin i counts
    edges[i-1] <= v < edges[i], the last bin counts values >= edges[-1] including +inf.
    NaN is not binned (it is counted in the steps table's nonfinite_count).
    """

    steps: np.ndarray  # int64 [n_steps]
    edges: dict[str, np.ndarray]
    counts: dict[str, np.ndarray]  # int64 [n_steps, n_bins]


class _SequenceTable:
    """Analysis.sequences: a pa.Table, or the on-disk table of a long run (analysis.core.seqrows.SequenceRows),
    read whole at each access and not kept (the caller keeps what it needs); `Analysis.sequence_rows`
    gives the file itself, to query only what a face shows (the worst N, one sequence, a step range)
    without reading the rest, as the dashboard does (kldiag.views.sequences)."""

    def __set_name__(self, owner, name: str) -> None:
        self.slot = f"_{name}"

    def __get__(self, obj, owner=None):
        if obj is None:
            raise AttributeError(self.slot)  # no class-level default: the field stays required
        value = obj.__dict__[self.slot]
        return value if isinstance(value, pa.Table) else value.table()

    def __set__(self, obj, value) -> None:
        obj.__dict__[self.slot] = value


# The off-policy sequence mask's delta grid (DeepSeek-V3.2; TRL's off_policy_mask_threshold) that every
# analysis counts per step: what the Estimators page slides over without holding a row per sequence.
OPSM_DELTAS = (0.0, 1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)


@dataclass
class OpsmCounts:
    """Sequences the off-policy sequence mask drops, per step, at each delta of `deltas`.

    step, sequences, known [n_steps] (known: sequences with an advantage, the mask's denominator, as
    the step table's opsm_masked_frac); masked [n_steps, len(deltas)]: known sequences with advantage < 0
    and mean(log mu - logp) > delta (kldiag.estimators.opsm_drop)."""

    deltas: tuple[float, ...]
    step: np.ndarray
    sequences: np.ndarray
    known: np.ndarray
    masked: np.ndarray


@dataclass
class Analysis:
    """Result of `kldiag.analyze(run_dir)`.

    steps:      one row per step (columns in STEP_COLUMNS, more allowed), sorted by step
    steps_by_rank: one row per (step, rank) when config.per_rank, else None
    sequences:  one row per sequence (SEQUENCE_COLUMNS); past 100k rows kept on disk, read at each access
                (`sequence_rows` queries part of it)
    flags:      worst tokens by |k3 weight| plus every non-finite/invalid one (FLAG_COLUMNS)
    histograms: per-step histograms of d, |k3 weight|, |k3_is weight|, rho
    alerts:     ALERT_COLUMNS, one row per episode (kldiag.analysis.rules.episodes), sorted by start
    trainer_kl: step, micro-averaged KL as the trainer logs it, when trainer_compatible
    superseded: rank, attempt, rows: rows left out because a later attempt of the rank
                re-recorded their steps (a restart); empty when the run has one attempt
    lost:       the parts none of whose rows were read (unreadable, 0 bytes, 0 rows), each with
                its rank and step range (kldiag.analysis.runtime.lost.LostPart)
    spans:      (rank, attempt, step_min, step_max) of each part that was read
    flag_context: (step, rank, seq, iteration, pos) of each flagged token -> the token ids around it, as the
                pass read them (kldiag.analysis.core.around: int32 [2 * WIDTH])
    """

    run_dir: Path | str  # a Path, or the URI of a remote run
    manifest: Manifest
    config: AnalysisConfig
    steps: pa.Table
    sequences: pa.Table = _SequenceTable()  # type: ignore[assignment]  # a long run's: read from disk at each access
    flags: pa.Table
    histograms: Histograms
    alerts: pa.Table
    steps_by_rank: pa.Table | None = None
    trainer_kl: pa.Table | None = None
    files: int = 0  # parts analysed in total
    files_new: int = 0  # parts computed now (not from the cache)
    skipped: list[str] = field(default_factory=list)  # parts skipped as corrupt, by path
    superseded: pa.Table | None = None
    lost: list[Any] = field(default_factory=list)  # kldiag.analysis.runtime.lost.LostPart, in part order
    spans: list[tuple[int, int, int, int]] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    reduced: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)  # reducer name -> merged partial
    memo: dict[Any, Any] = field(default_factory=dict, repr=False)  # what faces derived from it (a parity fit)
    opsm: OpsmCounts | None = None  # the off-policy sequence mask per step at every delta of OPSM_DELTAS
    flag_context: dict[tuple[int, int, int, int, int], np.ndarray] = field(default_factory=dict, repr=False)

    @property
    def sequence_rows(self) -> Any:
        """The sequence table on disk (analysis.core.seqrows.SequenceRows: .worst(n), .sequence(step, seq),
        .steps(first, last), .table(columns, filter)) when the run's was spilled there, else None."""
        value = self.__dict__.get("_sequences")
        return None if isinstance(value, pa.Table) else value

    @property
    def sequence_count(self) -> int:
        """Rows of `sequences`, without reading them."""
        value = self.__dict__.get("_sequences")
        return value.num_rows


STEP_COLUMNS = (
    "step", "tokens", "sequences",
    "k1_mean", "k2_mean", "k3_mean", "k3_is_mean",
    "weight_k3_abs_mean", "weight_k3_abs_max", "weight_k3_abs_p50", "weight_k3_abs_p90",
    "weight_k3_abs_p99", "weight_k3_abs_p999",
    "weight_k3_is_abs_mean", "weight_k3_is_abs_max", "weight_k3_is_abs_p99",
    "blame_share",
    "theta_ll_ref_count", "weight_blowup_count", "clamp_saturated_count", "nonfinite_count",
    "invalid_count", "flagged_frac",
    "rho_mean", "rho_min", "rho_max", "rho_ess", "rho_clip_frac",
    "drift_abs_mean", "mismatch_kl", "opsm_masked_frac",
)
SEQUENCE_COLUMNS = (
    "step", "seq", "group", "rank", "length", "advantage",
    "k3_mean", "k3_is_mean", "weight_k3_abs_max", "weight_k3_is_abs_max",
    "flagged_count", "nonfinite_count", "opsm_masked",
)
FLAG_COLUMNS = (
    "step", "seq", "pos", "rank", "micro", "iteration", "token_id", "piece",
    "logp", "logp_old", "logp_ref", "logp_sampler", "advantage", "mask",
    "d", "rho", "k3", "k3_is", "weight_k3", "weight_k3_is",
    "theta_ll_ref", "weight_blowup", "clamp_saturated", "nonfinite", "invalid",
)
ALERT_COLUMNS = ("step", "kind", "metric", "value", "baseline", "message",  # step: the episode's start
                 "start", "end", "peak_step", "peak_value", "severity", "steps")
