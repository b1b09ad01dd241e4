"""Histogram maths for display: step x bin heatmaps and percentile bands read from the mergeable
per-step histograms (`Analysis.histograms`, fixed edges: kldiag.analysis.core.bins). Pure numpy and pandas."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from kldiag.analysis.types import Histograms


def bin_bounds(edges: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Lower and upper value of every histogram bin (len(edges) + 1 bins, see Histograms)."""
    lo = np.concatenate([[edges[0] if edges[0] <= 0 else 0.0], edges])
    hi = np.concatenate([edges, [np.inf]])
    return lo, hi


def hist_quantiles(counts: np.ndarray, edges: np.ndarray, qs: Sequence[float]) -> np.ndarray:
    """Quantiles [n_steps, len(qs)] of per-step histograms, interpolated inside a bin.

    Log-spaced edges (all positive) interpolate geometrically. The open-ended first and
    last bins return their finite edge. Steps with no counts give NaN.
    """
    counts = np.asarray(counts, dtype=np.float64)
    log = bool(np.all(edges > 0))
    lo = np.concatenate([[edges[0]], edges])
    hi = np.concatenate([edges, [edges[-1]]])
    total = counts.sum(axis=1, keepdims=True)
    cum = np.cumsum(counts, axis=1)
    out = np.full((counts.shape[0], len(qs)), np.nan)
    for j, q in enumerate(qs):
        target = q * total[:, 0]
        idx = np.minimum((cum < target[:, None]).sum(axis=1), counts.shape[1] - 1)
        rows = np.arange(counts.shape[0])
        before = np.where(idx > 0, cum[rows, np.maximum(idx - 1, 0)], 0.0)
        with np.errstate(invalid="ignore", divide="ignore"):
            frac = np.clip((target - before) / counts[rows, idx], 0.0, 1.0)
        a, b = lo[idx], hi[idx]
        val = np.exp(np.log(a) + frac * (np.log(b) - np.log(a))) if log else a + frac * (b - a)
        out[:, j] = np.where(total[:, 0] > 0, val, np.nan)
    return out


def coarsen_steps(steps: np.ndarray, counts: np.ndarray, max_rows: int = 400) -> tuple[np.ndarray, np.ndarray]:
    """Sum adjacent steps' histograms so at most `max_rows` remain; keeps each group's first step."""
    n = len(steps)
    if n <= max_rows:
        return steps, counts
    starts = np.linspace(0, n, max_rows + 1).astype(np.int64)[:-1]
    starts = np.unique(starts)
    return steps[starts], np.add.reduceat(counts, starts, axis=0)


def heatmap(hist: Histograms, name: str, max_rows: int = 400) -> dict[str, np.ndarray | list[str]]:
    """Step x bin heatmap of histogram `name`: z[bin, step] is the fraction of the step's tokens.

    Bins empty in every step are cut from both ends. Returns steps, labels (bin ranges), z.
    """
    steps, counts = coarsen_steps(hist.steps, hist.counts[name], max_rows)
    used = np.flatnonzero(counts.sum(axis=0))
    if used.size == 0:
        return {"steps": steps, "labels": [], "z": np.zeros((0, len(steps)))}
    first, last = used[0], used[-1] + 1
    total = counts.sum(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        frac = np.where(total > 0, counts / np.maximum(total, 1), np.nan)
    lo, hi = bin_bounds(hist.edges[name])
    labels = [f"[{lo[i]:.3g}, {hi[i]:.3g})" for i in range(first, last)]
    return {"steps": steps, "labels": labels, "z": frac[:, first:last].T}


def percentile_bands(hist: Histograms, name: str,
                     qs: Sequence[float] = (0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99)) -> pd.DataFrame:
    """One row per step, one column per quantile ("p1", "p50", ...), from the histograms."""
    values = hist_quantiles(hist.counts[name], hist.edges[name], qs)
    df = pd.DataFrame(values, columns=[f"p{q * 100:g}" for q in qs])
    df.insert(0, "step", hist.steps)
    return df


REF_METRICS = ("d", "weight_k3_abs", "weight_k3_is_abs")  # need logp_ref: empty histograms without it


def measured(hist: Histograms, names: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the metrics of `names` whose histograms hold a value, those that do not). A run without logp_ref has
    empty d and weight histograms: a page opens on a metric it measured."""
    have = [m for m in names if m in hist.counts and np.asarray(hist.counts[m]).sum() > 0]
    return have, [m for m in names if m not in have]


def clamp_to_range(bands: pd.DataFrame, low: np.ndarray, high: np.ndarray) -> pd.DataFrame:
    """Percentile bands kept inside each step's observed [low, high] (the steps table's min and max): a
    quantile interpolated inside a bin may pass them (every rho exactly 1 read as a median of 1.2)."""
    cols = [c for c in bands.columns if c != "step"]
    lo, hi = np.asarray(low, np.float64)[:, None], np.asarray(high, np.float64)[:, None]
    v = bands[cols].to_numpy(np.float64)
    v = np.where(np.isfinite(lo), np.maximum(v, lo), v)
    v = np.where(np.isfinite(hi), np.minimum(v, hi), v)
    return bands.assign(**{c: v[:, i] for i, c in enumerate(cols)})
