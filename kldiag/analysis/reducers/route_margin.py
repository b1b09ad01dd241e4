"""Router confidence: the trainer router's margin at each token, on the tokens routed differently and the rest.

Reads the format v1.3 columns `route_margin_trainer` (per token, the minimum over MoE layers of the trainer
router's margin: the chosen experts' lowest logit minus the other experts' highest; for a top-k router the
k-th minus the (k+1)-th largest logit) and `route_margin_layer` (the layer giving that minimum). Over the
loss tokens with a finite margin:

    flipped   both sides' routes were compared (route_overlap finite) and some layer's expert set differs
    kept      both sides compared, no layer differs
    all       every token with a margin (a run with the trainer's routes alone has only these)

A low-precision engine router flips the tokens near a tie: their margins sit far below the kept ones'
(prime-rl #2545 asks for router confidence). `RouteMarginReducer` keeps per group the count, the sum and a
histogram of margins on fixed bins (symmetric log bins, 8 decades, ratio 10**(1/20) = 1.122 between edges),
and per layer the histogram of the minimum's layer; merging adds them, so cached and parallel passes equal a
serial one. Medians are read from the histograms (linear inside a bin: within one bin, 12% relative).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from kldiag import format as F
from kldiag.analysis.reducers.base import column as _col

GROUPS = ("flipped", "kept", "all")
DECADES, PER_DECADE, LOW = 8, 20, -6  # |margin| bins from 1e-6 to 1e2
_POS = np.logspace(LOW, LOW + DECADES, DECADES * PER_DECADE + 1)
EDGES = np.concatenate([-_POS[::-1], [0.0], _POS])  # bin i holds [EDGES[i-1], EDGES[i]); 0 and len: outside
BINS = len(EDGES) + 1


def batch_partial(batch: pa.RecordBatch) -> dict[str, np.ndarray]:
    """Counts, sums and histograms of one record batch (module docstring)."""
    mask, _ = _col(batch, "mask", False, bool)
    margin, ok = _col(batch, F.ROUTE_MARGIN_TRAINER, np.nan, np.float64)
    layer, ok_l = _col(batch, F.ROUTE_MARGIN_LAYER, -1, np.int64)
    differ, _ = _col(batch, F.ROUTE_DIFFER, 0, np.int64)
    overlap, ok_v = _col(batch, F.ROUTE_OVERLAP, np.nan, np.float64)
    has = mask & ok & np.isfinite(margin)
    compared = has & ok_v & np.isfinite(overlap)
    sel = {"flipped": compared & (differ > 0), "kept": compared & (differ <= 0), "all": has}
    bins = np.searchsorted(EDGES, np.where(has, margin, 0.0), side="right")
    out: dict[str, np.ndarray] = {}
    for g, s in sel.items():
        out[f"{g}_n"] = np.array([float(s.sum())])
        out[f"{g}_sum"] = np.array([float(margin[s].sum())])
        out[f"{g}_hist"] = np.bincount(bins[s], minlength=BINS).astype(float)
    lay = has & ok_l & (layer >= 0)
    width = int(layer[lay].max()) + 1 if lay.any() else 0
    grid = np.zeros((width, BINS))
    np.add.at(grid, (layer[lay], bins[lay]), 1.0)
    out["layer_hist"] = grid
    return out


def merge_partials(partials) -> dict[str, np.ndarray]:
    """Add the counts, sums and histograms; widen the per-layer grid to the widest."""
    partials = list(partials)
    if not partials:
        return batch_partial(pa.RecordBatch.from_pydict({"mask": pa.array([], pa.bool_())}))
    out = {k: np.sum([p[k] for p in partials], axis=0) for k in partials[0] if k != "layer_hist"}
    width = max(p["layer_hist"].shape[0] for p in partials)
    out["layer_hist"] = np.zeros((width, BINS))
    for p in partials:
        out["layer_hist"][: p["layer_hist"].shape[0]] += p["layer_hist"]
    return out


@dataclass(frozen=True)
class RouteMarginReducer:
    """The trainer router's margins on flipped, kept and all tokens, and per layer (module docstring)."""

    name: str = "route_margin"
    version: int = 1
    columns: tuple[str, ...] = ("mask", F.ROUTE_MARGIN_TRAINER, F.ROUTE_MARGIN_LAYER, F.ROUTE_DIFFER, F.ROUTE_OVERLAP)

    def settings(self) -> dict:
        return {"edges": [float(EDGES[0]), float(EDGES[-1]), len(EDGES)]}

    def start(self, part) -> list:
        return []

    def add(self, state: list, batch: pa.RecordBatch) -> None:
        names = batch.schema.names
        if batch.num_rows and F.ROUTE_MARGIN_TRAINER in names \
                and batch.column(F.ROUTE_MARGIN_TRAINER).null_count < batch.num_rows:
            state.append(batch_partial(batch))

    def finish(self, state: list, dropped: int) -> dict[str, np.ndarray]:
        return self.merge(state)

    def merge(self, partials) -> dict[str, np.ndarray]:
        return merge_partials(partials)


def hist_median(hist: np.ndarray) -> float | None:
    """The median of a histogram on EDGES (linear inside its bin); None when empty. The two outside bins
    (below -1e2, above 1e2) give their inner edge."""
    n = float(hist.sum())
    if n <= 0:
        return None
    cum = np.cumsum(hist)
    i = int(np.searchsorted(cum, n / 2.0))
    if i == 0:
        return float(EDGES[0])
    if i >= len(EDGES):
        return float(EDGES[-1])
    lo, hi = EDGES[i - 1], EDGES[i]
    before = cum[i - 1] if i > 0 else 0.0
    frac = (n / 2.0 - before) / hist[i] if hist[i] > 0 else 0.5
    return float(lo + frac * (hi - lo))


def summary(m: dict[str, np.ndarray]) -> dict[str, Any]:
    """JSON-ready margins: per group tokens, median, mean; per layer tokens and median of the minimum there.
    `measured` is False for a run without margins (no group then says anything)."""
    out: dict[str, Any] = {"measured": bool(m["all_n"].sum() > 0)}
    for g in GROUPS:
        n = float(m[f"{g}_n"].sum())
        out[g] = {"tokens": int(n), "median": hist_median(m[f"{g}_hist"]),
                  "mean": float(m[f"{g}_sum"].sum() / n) if n else None}
    out["by_layer"] = [{"layer": i, "tokens": int(row.sum()), "median": hist_median(row)}
                       for i, row in enumerate(m["layer_hist"]) if row.sum() > 0]
    return out
