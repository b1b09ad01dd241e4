"""Exact, fast histogram binning against the shared edges of types.HIST_EDGES.

`np.searchsorted` costs ~35 ns per value against ~100 edges; the analysis bins four values
per token, so it would cost more than reading the Parquet. `BinTable` gives the same
answer (bin i holds edges[i-1] <= v < edges[i]) in a few ns: the top bits of a float64,
mapped to an order-preserving integer, index a table of cells; each cell holds at most one
edge, so one comparison against it finishes the job.

The d edges are uniform with a power-of-two step, so d's bin is exact arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kldiag.analysis.types import ABS_EDGES, D_EDGES

_LOW63 = np.int64(0x7FFF_FFFF_FFFF_FFFF)


def ordered_bits(v: np.ndarray) -> np.ndarray:
    """int64 keys with the order of the float64 values (an involution on the bits)."""
    b = np.ascontiguousarray(v, dtype=np.float64).view(np.int64)
    return b ^ ((b >> 63) & _LOW63)


def _from_ordered(o: np.ndarray) -> np.ndarray:
    return (o ^ ((o >> 63) & _LOW63)).view(np.float64)


@dataclass(frozen=True)
class BinTable:
    """bin(v) == np.searchsorted(edges, v, side="right") for every non-NaN float64 v."""

    edges: np.ndarray
    shift: int
    lo: np.ndarray  # int16 [cells]: bins of the cell's smallest value
    cut: np.ndarray  # float64 [cells]: the one edge inside the cell, else NaN
    positive: bool  # values are known >= +0.0: skip the sign fold

    @classmethod
    def build(cls, edges: np.ndarray, positive: bool = False, shift: int = 48) -> BinTable:
        edges = np.asarray(edges, dtype=np.float64)
        if np.any(np.diff(edges) <= 0):
            raise ValueError("histogram edges must be strictly increasing")
        while shift > 36:
            table = cls._try(edges, positive, shift)
            if table is not None:
                return table
            shift -= 1
        raise ValueError("histogram edges too close together for a BinTable")

    @classmethod
    def _try(cls, edges: np.ndarray, positive: bool, shift: int) -> BinTable | None:
        half = 1 << (63 - shift)
        cells = np.arange(-half, half, dtype=np.int64)
        first = _from_ordered(cells << shift)
        last = _from_ordered(((cells + 1) << shift) - 1)
        nan_first, nan_last = np.isnan(first), np.isnan(last)
        last = np.where(nan_last, np.where(last.view(np.int64) < 0, -np.inf, np.inf), last)
        first = np.where(nan_first, np.where(first.view(np.int64) < 0, -np.inf, np.inf), first)
        lo = np.searchsorted(edges, first, side="right")
        hi = np.searchsorted(edges, last, side="right")
        if np.any(hi - lo > 1):
            return None
        # NaN where the cell holds no edge: v >= NaN is False, even for v = +inf.
        cut = np.where(hi > lo, edges[np.minimum(lo, len(edges) - 1)], np.nan)
        if positive:  # only the non-negative half is ever indexed
            lo, cut = lo[half:], cut[half:]
        return cls(edges, shift, lo.astype(np.int16), cut, positive)

    def __call__(self, v: np.ndarray) -> np.ndarray:
        """Bin index (intp) of each value; NaN must be removed by the caller."""
        v = np.ascontiguousarray(v, dtype=np.float64)
        if self.positive:
            cell = v.view(np.int64) >> self.shift
        else:
            cell = (ordered_bits(v) >> self.shift) + (1 << (63 - self.shift))
        out = self.lo.take(cell).astype(np.intp)
        out += v >= self.cut.take(cell)
        return out


def abs_table() -> BinTable:
    """Binning of non-negative values (|weights|, rho) against ABS_EDGES."""
    return BinTable.build(ABS_EDGES, positive=True)


_D_STEP = 0.5  # a power of two: d / _D_STEP is exact
_D_OFFSET = -D_EDGES[0] / _D_STEP  # edges[i] = (i - _D_OFFSET) * _D_STEP
_D_UNIFORM = bool(float(_D_OFFSET).is_integer() and np.array_equal(
    D_EDGES, (np.arange(len(D_EDGES)) - _D_OFFSET) * _D_STEP))


def d_bins(d: np.ndarray) -> np.ndarray:
    """searchsorted(D_EDGES, d, "right") for non-NaN d, by exact arithmetic on uniform edges.

    edges[i] <= d  <=>  i <= d / step + offset  <=>  i <= floor(d / step) + offset, and
    d / step is exact in binary floating point, so no value crosses an edge by rounding.
    """
    if not _D_UNIFORM:
        return np.searchsorted(D_EDGES, d, side="right")
    k = np.floor(d * (1.0 / _D_STEP))
    np.clip(k, -_D_OFFSET - 1.0, len(D_EDGES) - 1.0 - _D_OFFSET, out=k)
    out = k.astype(np.intp)
    out += int(_D_OFFSET) + 1
    return out


def d_grid() -> np.ndarray:
    """(1 / step, offset, number of edges) of D_EDGES, for the compiled d_bins (fused.d_bin)."""
    if not _D_UNIFORM:
        raise ValueError("D_EDGES must be uniform with a power-of-two step for exact binning")
    return np.array([1.0 / _D_STEP, _D_OFFSET, float(len(D_EDGES))])


def quantile(counts: np.ndarray, edges: np.ndarray, q: float, vmax: float) -> float:
    """q-quantile from log-spaced histogram counts [n_bins], interpolated geometrically.

    Exact to within one bin (a factor 10**0.25 for ABS_EDGES); never above `vmax`.
    """
    n = counts.sum()
    if n == 0:
        return float("nan")
    i = int(np.searchsorted(np.cumsum(counts), q * n, side="left"))
    if i == 0:
        return float(min(edges[0], vmax))
    if i >= len(edges):
        return float(vmax)
    before = counts[:i].sum()
    frac = (q * n - before) / counts[i]
    lo, hi = edges[i - 1], edges[i]
    return float(min(lo * (hi / lo) ** frac, vmax))
