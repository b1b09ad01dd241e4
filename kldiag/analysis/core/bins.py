"""Exact, fast histogram binning against the shared edges of types.HIST_EDGES.

Both edge sets are chosen so that a bin index is a few integer operations, with no search
and no table, so the compiled kernel bins four values per token inside a vectorised loop:

- ABS_EDGES are c_j * 2^e with c_j the float64 nearest 2^(j/2), j = 0, 1: one octave holds
  two bins, and v >= c_j * 2^e compares v's exponent bits with e and its mantissa bits with
  those of c_j, exactly (scaling by 2^e changes no mantissa bit).
- D_EDGES are uniform with a power-of-two step, so d's bin is exact arithmetic.

`abs_bins` and `d_bins` (numpy) equal np.searchsorted(edges, v, side="right") for every
non-NaN v (tests/test_analysis_kernel.py); fused.abs_bin and fused.d_bin are their per-value twins.
"""

from __future__ import annotations

import numpy as np

from kldiag.analysis.types import ABS_EDGES, ABS_PER_OCTAVE, D_EDGES

_MANT = (1 << 52) - 1
# Mantissa bits of c_1.., and the shift that maps edges[0] to bin 1.
ABS_MANTISSAS = np.ascontiguousarray(ABS_EDGES[1:ABS_PER_OCTAVE]).view(np.int64) & _MANT
ABS_K0 = ABS_PER_OCTAVE * int(np.float64(ABS_EDGES[0]).view(np.int64) >> 52) - 1
if not (ABS_EDGES[0] == 2.0 ** np.floor(np.log2(ABS_EDGES[0])) and ABS_PER_OCTAVE == 2
        and np.array_equal(ABS_EDGES[ABS_PER_OCTAVE::ABS_PER_OCTAVE], 2 * ABS_EDGES[:-ABS_PER_OCTAVE:ABS_PER_OCTAVE])):
    raise ImportError("ABS_EDGES must be c_j * 2^e, two per octave from a power of two (kldiag.analysis.types)")


def abs_bins(v: np.ndarray) -> np.ndarray:
    """searchsorted(ABS_EDGES, v, "right") for v >= +0.0 (+inf included), int64."""
    b = np.ascontiguousarray(v, dtype=np.float64).view(np.int64)
    k = ABS_PER_OCTAVE * (b >> 52) - ABS_K0
    mant = b & _MANT
    for m in ABS_MANTISSAS:
        k += mant >= m
    return np.clip(k, 0, len(ABS_EDGES))


_D_STEP = 0.5  # a power of two: d / _D_STEP is exact
_D_OFFSET = -D_EDGES[0] / _D_STEP  # edges[i] = (i - _D_OFFSET) * _D_STEP
if not (float(_D_OFFSET).is_integer() and np.array_equal(D_EDGES, (np.arange(len(D_EDGES)) - _D_OFFSET) * _D_STEP)):
    raise ImportError("D_EDGES must be uniform with a power-of-two step (kldiag.analysis.types)")


def d_bins(d: np.ndarray) -> np.ndarray:
    """searchsorted(D_EDGES, d, "right") for non-NaN d, by exact arithmetic on uniform edges.

    edges[i] <= d  <=>  i <= d / step + offset  <=>  i <= floor(d / step) + offset, and
    d / step is exact in binary floating point, so no value crosses an edge by rounding.
    """
    k = np.floor(np.asarray(d, dtype=np.float64) * (1.0 / _D_STEP))
    np.clip(k, -_D_OFFSET - 1.0, len(D_EDGES) - 1.0 - _D_OFFSET, out=k)
    out = k.astype(np.int64)
    out += int(_D_OFFSET) + 1
    return out


def d_grid() -> np.ndarray:
    """(1 / step, offset, number of edges) of D_EDGES, for the compiled d_bin (fused.d_bin)."""
    return np.array([1.0 / _D_STEP, _D_OFFSET, float(len(D_EDGES))])


def quantile_rows(counts: np.ndarray, edges: np.ndarray, q: float, vmax: np.ndarray) -> np.ndarray:
    """`quantile` of every row of counts [n_rows, n_bins] against vmax [n_rows], vectorised (one call,
    not one per step): the same float operations per row, equal to `quantile` up to the last bit of
    pow; NaN where a row is empty or its vmax is NaN."""
    counts = np.asarray(counts)
    vmax = np.asarray(vmax, np.float64)
    n = counts.sum(axis=1)
    cum = np.cumsum(counts, axis=1)
    target = q * n
    i = (cum < target[:, None]).sum(axis=1)  # searchsorted(cum, target, "left"): cum is nondecreasing
    rows = np.arange(len(counts))
    inner = (i > 0) & (i < len(edges))
    j = np.where(inner, i, 1)
    before = np.where(inner, cum[rows, j - 1], 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        frac = (target - before) / counts[rows, np.minimum(j, counts.shape[1] - 1)]
        lo, hi = edges[j - 1], edges[np.minimum(j, len(edges) - 1)]
        out = np.minimum(lo * (hi / lo) ** frac, vmax)
    out = np.where(i == 0, np.minimum(edges[0], vmax), out)
    out = np.where(i >= len(edges), vmax, out)
    return np.where((n == 0) | np.isnan(vmax), np.nan, out)


def quantile(counts: np.ndarray, edges: np.ndarray, q: float, vmax: float) -> float:
    """q-quantile from log-spaced histogram counts [n_bins], interpolated geometrically.

    Exact to within one bin (a factor 2**0.5 for ABS_EDGES); never above `vmax`.
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
