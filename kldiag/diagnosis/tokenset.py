"""The recorded tokens as float64 arrays, for the mismatch modules (parity, what-if, decomposition, crosswalk).

`load(run)` reads the columns these modules need through the public reader (superseded rows
left out), keeps one row per (seq, pos) (the first reuse iteration: a step's batch is its
sequences, each counted once) unless `all_iterations`, and sorts by (step, seq, pos).
Nulls become NaN; `has_old` says where logp_old was recorded (null: on-policy, pi_old = pi_theta).
Memory: ~100 bytes a token; `max_tokens` keeps every k-th step of a larger run (`step_stride`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

COLUMNS = ["step", "micro", "iteration", "rank", "seq", "group", "pos", "token_id", "logp", "logp_old",
           "logp_ref", "logp_sampler", "advantage", "mask", "entropy"]
MAX_TOKENS = 20_000_000


@dataclass
class TokenSet:
    """Per-token arrays [N], sorted by (step, seq, pos). Log-probs float64, NaN where null."""

    step: np.ndarray
    seq: np.ndarray
    group: np.ndarray  # int64, -1 where null
    pos: np.ndarray
    token_id: np.ndarray  # int64, -1 where null
    iteration: np.ndarray
    micro: np.ndarray
    rank: np.ndarray
    logp: np.ndarray
    logp_old: np.ndarray  # logp where null (on-policy)
    logp_ref: np.ndarray
    logp_sampler: np.ndarray
    advantage: np.ndarray
    mask: np.ndarray  # bool
    entropy: np.ndarray
    has_old: np.ndarray  # bool: logp_old was recorded
    step_stride: int = 1  # 1: every step; k: every k-th step of the run was kept
    meta: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.step)

    def take(self, idx: np.ndarray) -> TokenSet:
        arrays = {f.name: getattr(self, f.name)[idx] for f in fields(self) if f.name not in ("step_stride", "meta")}
        return TokenSet(**arrays, step_stride=self.step_stride, meta=dict(self.meta))

    def steps(self) -> np.ndarray:
        return np.unique(self.step)

    def step_slices(self) -> list[tuple[int, slice]]:
        """(step, slice into the arrays) for each step, in order (the arrays are step-sorted)."""
        if not len(self.step):
            return []
        cut = np.flatnonzero(np.diff(self.step)) + 1
        starts = np.r_[0, cut]
        ends = np.r_[cut, len(self.step)]
        return [(int(self.step[a]), slice(int(a), int(b))) for a, b in zip(starts, ends, strict=True)]

    @property
    def has_sampler(self) -> bool:
        return bool(np.isfinite(self.logp_sampler).any())

    @property
    def has_ref(self) -> bool:
        return bool(np.isfinite(self.logp_ref).any())


def _f64(t: pa.Table, name: str) -> np.ndarray:
    return t.column(name).to_numpy(zero_copy_only=False).astype(np.float64)


def _i64(t: pa.Table, name: str, null: int = -1) -> np.ndarray:
    return pc.fill_null(t.column(name), null).to_numpy(zero_copy_only=False).astype(np.int64)


def from_table(t: pa.Table, all_iterations: bool = False, step_stride: int = 1) -> TokenSet:
    """A TokenSet from a table in the run schema (tests build one directly)."""
    t = t.combine_chunks()
    if not all_iterations and t.num_rows:
        it = t.column("iteration").to_numpy(zero_copy_only=False)
        seq, pos = t.column("seq").to_numpy(zero_copy_only=False), t.column("pos").to_numpy(zero_copy_only=False)
        # the first iteration each (seq, pos) appears in (a run may start reusing mid-way)
        order = np.lexsort((it, pos, seq))
        keep_sorted = np.r_[True, (np.diff(seq[order]) != 0) | (np.diff(pos[order]) != 0)]
        keep = np.zeros(t.num_rows, bool)
        keep[order[keep_sorted]] = True
        t = t.filter(pa.array(keep))
    step, seq, pos = (t.column(c).to_numpy(zero_copy_only=False) for c in ("step", "seq", "pos"))
    order = np.lexsort((pos, seq, step))
    t = t.take(pa.array(order))
    logp = _f64(t, "logp")
    old = _f64(t, "logp_old")
    has_old = np.isfinite(old) | ~t.column("logp_old").is_null().to_numpy(zero_copy_only=False)
    return TokenSet(
        step=_i64(t, "step"), seq=_i64(t, "seq"), group=_i64(t, "group"), pos=_i64(t, "pos"),
        token_id=_i64(t, "token_id"), iteration=_i64(t, "iteration"), micro=_i64(t, "micro"), rank=_i64(t, "rank"),
        logp=logp, logp_old=np.where(has_old, old, logp), logp_ref=_f64(t, "logp_ref"),
        logp_sampler=_f64(t, "logp_sampler"), advantage=_f64(t, "advantage"),
        mask=pc.fill_null(t.column("mask"), False).to_numpy(zero_copy_only=False).astype(bool),
        entropy=_f64(t, "entropy"), has_old=has_old, step_stride=step_stride)


def stride_for(run, max_tokens: int) -> int:
    """Keep every k-th step so that about max_tokens rows are read (estimated from part sizes)."""
    parts = run.parts()
    total_bytes = sum(p.size for p in parts)
    est_rows = total_bytes / 12.0  # the recorder's parts are ~12 bytes a token (DESIGN.md section 5)
    return max(1, int(np.ceil(est_rows / max(max_tokens, 1))))


def load(run, all_iterations: bool = False, max_tokens: int = MAX_TOKENS,
         steps: tuple[int, int] | None = None) -> TokenSet:
    """The run's tokens (a kldiag.format Run, a path or a URI). steps=(first, last) limits the range."""
    if not hasattr(run, "iter_batches"):
        from kldiag.format import open_run

        run = open_run(run)
    stride = stride_for(run, max_tokens)
    batches = []
    for b in run.iter_batches(COLUMNS):
        step = b.column("step")
        keep = None
        if stride > 1:
            keep = pa.array(step.to_numpy(zero_copy_only=False) % stride == 0)
        if steps is not None:
            rng = pc.and_(pc.greater_equal(step, steps[0]), pc.less_equal(step, steps[1]))
            keep = rng if keep is None else pc.and_(keep, rng)
        batches.append(b if keep is None else b.filter(keep))
    from kldiag.format.schema import TOKEN_SCHEMA

    schema = pa.schema([TOKEN_SCHEMA.field(c) for c in COLUMNS])
    table = pa.Table.from_batches(batches, schema=schema) if batches else schema.empty_table()
    ts = from_table(table, all_iterations, stride)
    ts.meta = {"run": str(getattr(run, "uri", run)), "manifest_config": dict(getattr(run.manifest, "config", {}) or {}),
               "trainer": dict(getattr(run.manifest, "trainer", {}) or {})}
    return ts
