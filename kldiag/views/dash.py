"""Chart and table helpers the dashboard shares with every page: pure package code.

- `ema`: the time-weighted, debiased exponential moving average that W&B draws by default
  (docs.wandb.ai, "Smooth line plots", TWEMA) and TensorBoard's scalar smoothing reduces
  to on evenly spaced steps (tensorboard/components/vz_line_chart2/line-chart.ts);
- `onset_lanes`: onset labels that do not overlap (log axes: kldiag.views.charts.log_axis);
- `step_stride`, `with_breaks`: the run's normal step stride, and a frame with a break (a NaN
  row) wherever steps are missing beyond it, so that a line is not drawn across lost steps;
- `table_bytes`: any table as CSV or Parquet bytes, for downloads;
- `link_params`, `parse_link`: the query string of a deep link (run, step, seq, pos).

None of this imports Streamlit; app/ only displays what it returns.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from urllib.parse import urlencode, urlsplit, urlunsplit

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from kldiag.estimators import FLAG_NAMES  # noqa: F401 - the Tokens page's deep link names these

MAX_SMOOTHING = 0.999
DOWNLOAD_FORMATS = {"csv": "text/csv", "parquet": "application/vnd.apache.parquet"}
LINK_KEYS = ("run", "step", "seq", "pos")


# ---- smoothing -----------------------------------------------------------------------


def ema(y: np.ndarray, x: np.ndarray | None = None, weight: float = 0.6) -> np.ndarray:
    """Time-weighted, debiased EMA of y [n] at positions x [n] (steps, increasing).

    weight in [0, 0.999]: 0 is the raw series; each point's decay is weight ** (gap / typical
    gap), so a skipped step decays like two steps and evenly spaced steps give TensorBoard's
    EMA exactly. Debiased as W&B's TWEMA: smoothed_i = sum_j a_ij y_j / sum_j a_ij, so the
    first point is y_0 and early points are not pulled towards 0. Non-finite points are
    gaps: NaN in the output, and they leave the average untouched. float64 [n].
    """
    y = np.asarray(y, dtype=np.float64)
    w = min(max(float(weight), 0.0), MAX_SMOOTHING)
    if w == 0.0 or y.size == 0:
        return y.copy()
    x = np.arange(y.size, dtype=np.float64) if x is None else np.asarray(x, dtype=np.float64)
    gaps = np.diff(x, prepend=x[0])
    typical = float(np.median(gaps[1:])) if y.size > 1 else 1.0
    decay = w ** (gaps / typical if typical > 0 else np.ones_like(gaps))
    out = np.full(y.size, np.nan)
    acc = norm = 0.0
    pending = 1.0  # decay carried over gaps (non-finite points)
    for i, (yi, a) in enumerate(zip(y.tolist(), decay.tolist(), strict=True)):
        pending *= a
        if not math.isfinite(yi):
            continue
        acc, norm, pending = acc * pending + yi, norm * pending + 1.0, 1.0
        out[i] = acc / norm
    return out


# ---- axes and lines ----------------------------------------------------------------------------


def step_stride(steps: np.ndarray) -> float:
    """The run's normal distance between recorded steps: the most common positive difference
    (1 for every step; n for a recorder's every_n_steps; 0 for fewer than two steps)."""
    s = np.unique(np.asarray(steps, dtype=np.float64)[np.isfinite(np.asarray(steps, dtype=np.float64))])
    if s.size < 2:
        return 0.0
    gaps, counts = np.unique(np.diff(s), return_counts=True)
    return float(gaps[np.argmax(counts)])  # ties: the smallest


def with_breaks(df: pd.DataFrame, x: str = "step") -> pd.DataFrame:
    """`df` sorted by x with one all-NaN row (x halfway) inside every gap wider than 1.5 strides,
    so that Plotly breaks its lines there (connectgaps is off) instead of joining the two sides."""
    if len(df) < 3:
        return df
    xs = df[x].to_numpy(dtype=np.float64)
    stride = step_stride(xs)
    order = np.argsort(xs, kind="stable")
    xs = xs[order]
    at = np.flatnonzero(np.diff(xs) > 1.5 * stride) if stride > 0 else np.array([], dtype=np.int64)
    if at.size == 0:
        return df
    gaps = pd.DataFrame({c: np.full(at.size, np.nan) for c in df.columns})
    gaps[x] = (xs[at] + xs[at + 1]) / 2
    out = pd.concat([df.iloc[order].astype({x: np.float64}), gaps], ignore_index=True)
    return out.sort_values(x, kind="stable").reset_index(drop=True)


def onset_lanes(onsets: Sequence[tuple[int, str]], x_min: float, x_max: float,
                char_frac: float = 0.016, lanes: int = 4) -> list[int]:
    """A vertical lane per onset label so that labels do not overlap (0 = top).

    A label starts at its step and is about len(label) * char_frac of the x range wide (10 px text, about 6 px
    a character, on a plot area of ~380 px: the narrowest chart of a page); it takes the first lane whose
    previous label ended before it starts, cycling through `lanes` when all are taken.
    """
    span = max(float(x_max) - float(x_min), 1e-9)
    ends = [-math.inf] * lanes
    out = []
    for step, label in onsets:
        start = (float(step) - float(x_min)) / span
        lane = next((i for i, e in enumerate(ends) if e < start), len(out) % lanes)
        ends[lane] = start + len(label) * char_frac
        out.append(lane)
    return out


# ---- downloads -----------------------------------------------------------------------


def table_bytes(table: pd.DataFrame | pa.Table, fmt: str) -> bytes:
    """A table as CSV (header, no index) or Parquet (zstd) bytes."""
    if fmt not in DOWNLOAD_FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {sorted(DOWNLOAD_FORMATS)}")
    if isinstance(table, pa.Table):
        table = table.to_pandas()
    if fmt == "csv":
        return table.to_csv(index=False).encode()
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pandas(table, preserve_index=False), buf, compression="zstd")
    return buf.getvalue()


# ---- deep links ----------------------------------------------------------------------


def parse_link(params: Mapping[str, str]) -> dict[str, str | int]:
    """The deep-link keys of a query string: run (a label) as text, step/seq/pos as ints.
    Keys that are absent or not integers are left out (a hand-edited URL never crashes)."""
    out: dict[str, str | int] = {}
    for key in LINK_KEYS:
        value = params.get(key)
        if value is None or value == "":
            continue
        if key == "run":
            out[key] = str(value)
            continue
        try:
            out[key] = int(value)
        except (TypeError, ValueError):
            continue
    return out


def parse_range(text: str | None) -> tuple[int, int] | None:
    """"3-9" -> (3, 9) (a single "5" -> (5, 5)); None when absent or malformed."""
    if not text:
        return None
    bits = str(text).split("-")
    try:
        a, b = (int(bits[0]), int(bits[-1])) if len(bits) in (1, 2) else (None, None)
    except ValueError:
        return None
    if a is None or b is None:
        return None
    return (min(a, b), max(a, b))


def link_params(run: str | None = None, **values: int | str | None) -> dict[str, str]:
    """Query parameters of a deep link, in LINK_KEYS order then the rest; None is left out."""
    merged = {"run": run, **values}
    ordered = [k for k in LINK_KEYS if k in merged] + [k for k in merged if k not in LINK_KEYS]
    return {k: str(merged[k]) for k in ordered if merged[k] is not None}


def link_url(base: str, params: Mapping[str, str]) -> str:
    """`base` (the page's URL, any query dropped) with `params` as its query string."""
    parts = urlsplit(base)
    return urlunsplit((parts.scheme, parts.netloc, parts.path, urlencode(dict(params)), ""))


