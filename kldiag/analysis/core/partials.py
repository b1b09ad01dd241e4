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

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kldiag.analysis.core import around, keyed
from kldiag.analysis.core.batch import COLUMNS, Thresholds
from kldiag.analysis.core.stats import batch_partials, select_first, select_top
from kldiag.analysis.kernels.ride import EstimatorRide, SignalRide
from kldiag.format import PartInfo

# bump when the meaning or layout of a partial changes (7: n_placeholder; o, m read in the loss only; 8: the
# flagged rows' context)
PARTIAL_VERSION = 8
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
    # the merge's seqs rows as step-ordered, step-disjoint chunks, not concatenated (prefix.Stream,
    # prefix.combine with chunked=True; `seqs` is then empty): the engine builds the sequence table
    # chunk by chunk and frees each one (seqrows.py)
    seq_chunks: list = field(default_factory=list)

    def seq_rows(self) -> list[keyed.Keyed]:
        """The seqs rows as chunks, whichever way this partial holds them."""
        return self.seq_chunks if self.seq_chunks else ([self.seqs] if self.seqs else [])


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


ALL_RANKS = -1  # the rank of a per-step row that holds every rank's tokens (per_rank off)


class PartReducer:
    """Folds one part's record batches into its Partial (memory: one batch at a time)."""

    def __init__(self, part: PartInfo, th: Thresholds):
        self.part, self.th = part, th
        self.steps: list = []
        self.seqs: list = []
        self.top: keyed.Keyed = {}
        self.bad: keyed.Keyed = {}
        self.rows, self.floor = 0, -np.inf
        self.ride: EstimatorRide | None = None  # reducers riding in this pass (AnalysisReducer.carry)
        self.signal: SignalRide | None = None
        self.edge = around.Edge()  # the previous batch's rows at its edges: the flagged rows' context

    def add(self, batch) -> None:
        self.edge.head = None
        r = batch_partials(batch, self.part.rank, self.th, self.floor, self.ride, self.edge, self.signal)
        if self.edge.head is not None:  # the rows left open by the batches before: an empty batch leaves them open
            self.top, self.bad = around.close(self.top, self.edge.head), around.close(self.bad, self.edge.head)
        self.steps.append(r.steps)
        self.seqs.append(r.seqs)
        # a batch's top is already ordered and cut to top_k: only a second batch needs a merge
        self.top = select_top(keyed.concat([self.top, r.top]), self.th.top_k) if self.top else r.top
        self.bad = select_first(keyed.concat([self.bad, r.bad]), self.th.top_k)
        if self.top and len(self.top["wabs"]) >= self.th.top_k:
            self.floor = float(self.top["wabs"][-1])  # later batches only need candidates above it
        self.rows += batch.num_rows

    def result(self, dropped: int = 0) -> Partial:
        superseded = {"rank": np.array([self.part.rank], np.int64), "attempt": np.array([self.part.attempt], np.int64),
                      "n_rows": np.array([dropped], np.int64)} if dropped else {}
        return Partial(keyed.merge(self.steps), keyed.merge(self.seqs), around.done(self.top), around.done(self.bad),
                       superseded, self.rows)


def to_arrays(p: Partial) -> dict[str, np.ndarray]:
    """A Partial as named arrays ("table/column", and "rows"): the engine's one cache format."""
    arrays = {f"{t}/{name}": col for t in TABLES for name, col in getattr(p, t).items()}
    arrays["rows"] = np.array([p.rows], np.int64)
    return arrays


def from_arrays(arrays: dict[str, np.ndarray]) -> Partial:
    tables: dict[str, dict] = {t: {} for t in TABLES}
    for name, a in arrays.items():
        if name != "rows":
            t, col = name.split("/", 1)
            tables[t][col] = a
    return Partial(**tables, rows=int(arrays["rows"][0]))


@dataclass(frozen=True)
class AnalysisReducer:
    """The analysis as a reducer (reduce.py): per-step, per-sequence and flagged-row partials."""

    th: Thresholds
    name: str = "analysis"
    version: int = PARTIAL_VERSION
    columns: tuple[str, ...] = COLUMNS

    def settings(self) -> dict:
        return dict(self.th.__dict__)

    def start(self, part: PartInfo) -> PartReducer:
        return PartReducer(part, self.th)

    def add(self, state: PartReducer, batch) -> None:
        state.add(batch)

    def carry(self, state: PartReducer, rider, rider_state) -> bool:
        """Take `rider`'s per-token work into this part's pass (reduce.PartFold: a reducer whose `rides` names
        this one); False: it reads its batches itself. Two riders: the Estimators page's (its `ride(state)`
        gives a fused_ride.EstimatorRide), with the analysis's thresholds, and the learning signal's (a
        fused_ride.SignalRide: it rides in the estimators' pass, and alone where they do not ride:
        stats.batch_partials)."""
        if not hasattr(rider, "ride"):
            return False
        ride = rider.ride(rider_state)
        if isinstance(ride, SignalRide):
            if state.signal is not None:
                return False
            state.signal = ride
            return True
        if state.ride is not None or (ride.tau, ride.weight_limit, ride.clamp) != (
                self.th.tau, self.th.weight_limit, self.th.clamp):
            return False  # its flags are the analysis's only with the analysis's thresholds
        state.ride = ride
        return True

    def finish(self, state: PartReducer, dropped: int) -> dict[str, np.ndarray]:
        p = state.result(dropped)
        if not self.th.per_rank and p.steps:  # one row per step once merged, however many ranks record
            p.steps = {**p.steps, "rank": np.full(len(p.steps["rank"]), ALL_RANKS, np.int64)}
        return to_arrays(p)

    def merge(self, parts: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
        return to_arrays(merge([from_arrays(p) for p in parts], self.th.top_k))
