"""Kernel building blocks: columns of a record batch as numpy, segments, thresholds.

Per-token maths (tokens.py) is that of kldiag.estimators (DESIGN.md section 2), derived
from d = logp_ref - logp and x = logp - logp_old computed once
(tests/test_analysis_kernel.py checks every value against estimators.py):

    k1 = -d    k2 = d^2 / 2    k3 = expm1(d) - d    weight_k3 = -expm1(d)
    rho = exp(x)    k3_is = rho * k3    weight_k3_is = rho * (-d)

Everything is float64. Rows are grouped by step and by (step, seq) as runs of equal
consecutive keys (`Seg`): recorder files are step-ordered, so no sort is needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from kldiag.analysis import bins
from kldiag.analysis.types import ABS_EDGES, D_EDGES

LOGPS = ("logp", "logp_old", "logp_ref", "logp_sampler")
COLUMNS = ("step", "micro", "iteration", "seq", "group", "pos", "token_id", *LOGPS, "advantage", "mask")
N_D, N_ABS = len(D_EDGES) + 1, len(ABS_EDGES) + 1
ABS = bins.abs_table()
D_ZERO_BIN = int(np.searchsorted(D_EDGES, 0.0, side="right"))


@dataclass(frozen=True)
class Thresholds:
    """What the kernel needs from AnalysisConfig (clip range resolved from the manifest)."""

    tau: float
    weight_limit: float
    clamp: float
    clip_low: float
    clip_high: float
    top_k: int

    def d_window(self) -> tuple[float, float]:
        """(low, high): a token with low <= d <= high fires none of the d-flags.

        theta_ll_ref needs d > log(tau); weight_blowup needs exp(d) - 1 > W (d > log1p(W))
        or, when W < 1, 1 - exp(d) > W; clamp_saturated needs k3 > C, which needs
        d > log1p(C) or d < -C (k3 <= C on [-C, log1p(C)]). A small margin absorbs rounding;
        the flags themselves are then evaluated exactly on the few tokens outside.
        """
        high = min(np.log(self.tau), np.log1p(self.weight_limit), np.log1p(self.clamp))
        low = -self.clamp
        if self.weight_limit < 1.0:
            low = max(low, np.log1p(-self.weight_limit))
        # Shrink the window toward 0 on both sides: a token on its border is always evaluated.
        return low * (1 - 1e-9) + 1e-12, high * (1 - 1e-9) - 1e-12


# ---- columns and segments ----------------------------------------------------------


def f32(batch: pa.RecordBatch, name: str) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(float32 values, NaN at nulls; null mask or None); (None, None) if every row is null."""
    col = batch.column(name)
    if col.null_count == len(col):
        return None, None
    values = col.to_numpy(zero_copy_only=False)
    return values, (np.asarray(col.is_null()) if col.null_count else None)


def ints(batch: pa.RecordBatch, name: str) -> np.ndarray:
    col = batch.column(name)
    return (col.fill_null(0) if col.null_count else col).to_numpy(zero_copy_only=False)


@dataclass
class Batch:
    """A record batch as numpy: int keys, bool mask, float32 log-probs (NaN at nulls)."""

    n: int
    step: np.ndarray
    seq: np.ndarray
    mask: np.ndarray
    raw: dict[str, np.ndarray | None]  # LOGPS and "advantage", float32
    null: dict[str, np.ndarray | None]  # null masks, None when no row is null
    arrow: pa.RecordBatch  # columns read only at a few rows (group, pos, token_id, ...)
    clean: bool  # no null row in a present column, every log-prob finite and <= 0

    @classmethod
    def from_arrow(cls, batch: pa.RecordBatch) -> Batch:
        step = ints(batch, "step")
        if len(step) > 1 and np.any(step[1:] < step[:-1]):  # not step-ordered: sort once
            batch = batch.take(pa.array(np.argsort(step, kind="stable")))
            step = ints(batch, "step")
        raw, null, clean = {}, {}, True
        for name in (*LOGPS, "advantage"):
            raw[name], null[name] = f32(batch, name)
            if name in LOGPS and raw[name] is not None:
                # max is NaN if any NaN; +inf or > 0 fails too; min catches -inf.
                clean &= null[name] is None and bool(raw[name].max() <= 0) and bool(np.isfinite(raw[name].min()))
        mask = batch.column("mask")
        mask = (mask.fill_null(False) if mask.null_count else mask).to_numpy(zero_copy_only=False)
        return cls(batch.num_rows, step, ints(batch, "seq"), mask, raw, null, batch, clean)

    def at(self, name: str, rows: np.ndarray, fill: int = 0) -> np.ndarray:
        """Integer column `name` at `rows` (nulls as `fill`), without converting the rest."""
        col = self.arrow.column(name)
        if col.null_count:
            col = col.fill_null(fill)
        return col.to_numpy(zero_copy_only=False)[rows].astype(np.int64)

    def bad_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """Row indices with a non-finite present log-prob, and with a log-prob > 0."""
        if self.clean:
            return np.zeros(0, np.intp), np.zeros(0, np.intp)
        nf = np.zeros(self.n, bool)
        inv = np.zeros(self.n, bool)
        for name in LOGPS:
            v = self.raw[name]
            if v is None:
                continue
            bad = ~np.isfinite(v)
            if self.null[name] is not None:
                bad &= ~self.null[name]
            nf |= bad
            with np.errstate(invalid="ignore"):
                inv |= v > 0
        return np.flatnonzero(nf), np.flatnonzero(inv)


class Seg:
    """Consecutive segments of given lengths (zeros allowed), and reductions over them.

    Few segments (a batch spans a few steps): slice reductions, which are pairwise and
    SIMD; many (sequences): ufunc.reduceat over the non-empty segments.
    """

    SLICES = 16

    def __init__(self, lengths: np.ndarray):
        self.lengths = np.asarray(lengths, np.int64)
        self.n = len(lengths)
        self.ends = np.cumsum(self.lengths)
        self.begins = self.ends - self.lengths
        self.nonempty = self.lengths > 0
        self.dense = bool(self.nonempty.all())
        self.starts = self.begins[self.nonempty]

    def _reduce(self, ufunc, a: np.ndarray, fill, dtype=None) -> np.ndarray:
        if self.n <= self.SLICES:
            out = np.full(self.n, fill, dtype or np.result_type(a, type(fill)))
            for i in np.flatnonzero(self.nonempty):
                out[i] = ufunc.reduce(a[self.begins[i]:self.ends[i]], dtype=dtype)
            return out
        red = ufunc.reduceat(a, self.starts, dtype=dtype) if len(a) else np.zeros(0, dtype or a.dtype)
        if self.dense:
            return red
        out = np.full(self.n, fill, red.dtype)
        out[self.nonempty] = red
        return out

    def sum(self, a: np.ndarray) -> np.ndarray:
        return self._reduce(np.add, a, 0.0)

    def count(self, b: np.ndarray) -> np.ndarray:
        return self._reduce(np.add, b, 0, np.int64)

    def max(self, a: np.ndarray) -> np.ndarray:
        return self._reduce(np.fmax, a, np.nan)  # fmax: NaN (an excluded token) never wins

    def min(self, a: np.ndarray) -> np.ndarray:
        return self._reduce(np.fmin, a, np.nan)

    def count_at(self, idx: np.ndarray) -> np.ndarray:
        """How many of the sorted positions `idx` fall in each segment."""
        return np.searchsorted(idx, self.ends) - np.searchsorted(idx, self.begins)

    def hist(self, bin_index: np.ndarray, n_bins: int) -> np.ndarray:
        """[n, n_bins] counts of bin_index per segment."""
        if self.n <= self.SLICES:
            out = np.zeros((self.n, n_bins), np.int64)
            for i, (a, b) in enumerate(zip(self.begins, self.ends, strict=True)):
                out[i] = np.bincount(bin_index[a:b], minlength=n_bins)
            return out
        seg_id = np.repeat(np.arange(self.n), self.lengths)
        return np.bincount(seg_id * n_bins + bin_index, minlength=self.n * n_bins).reshape(self.n, n_bins)


def finite_sum(seg: Seg, v: np.ndarray, n_valid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sum of the finite values, their count) per segment. Excluded tokens must hold 0.

    The plain sum is finite exactly when every summand is (barring overflow of the sum,
    which takes the exact path too), so the common case costs one pass.
    """
    total = seg.sum(v)
    if np.isfinite(total).all():
        return total, n_valid
    fin = np.isfinite(v)
    return seg.sum(np.where(fin, v, 0.0)), n_valid - seg.count(~fin)
