"""Plotly figures of per-step aggregates (never per-token data, except bounded samples).

The step charts the report draws too (`lines`, the Overview's step trends) and the rules every
chart follows (titles, axis titles with units, legends, log axes) are in kldiag.views.charts;
this module keeps the dashboard's own charts (heatmap, bands, compare, scatter) on those rules."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import plotly.express as px
import plotly.graph_objects as go

from kldiag.views import charts as VC
from kldiag.views import dash as VD
from kldiag.views.charts import COLORWAY, LABELS, decade_ticks, lines  # noqa: F401 - the pages call C.lines

ESTIMATOR_COLORS = {"weight_k3": "#d62728", "weight_k3_is": "#2ca02c", "weight_k2": "#7f7f7f"}
ESTIMATOR_NAMES = {"weight_k3": "k3", "weight_k3_is": "k3_is", "weight_k2": "k2"}


def heatmap(steps: np.ndarray, labels: Sequence[str], z: np.ndarray, title: str, subtitle: str = "",
            y_title: str = "bin") -> go.Figure:
    """Share of each step's tokens per bin on a log colour scale, so rare tails stay visible."""
    with np.errstate(divide="ignore"):
        logz = np.where(z > 0, np.log10(np.where(z > 0, z, 1.0)), np.nan)  # empty bins stay blank
    lo = int(np.floor(np.nanmin(logz))) if np.isfinite(logz).any() else -4
    ticks = list(range(lo, 1))
    fig = go.Figure(go.Heatmap(
        x=steps, y=list(labels), z=logz, customdata=z, colorscale="Viridis", zmin=lo, zmax=0,
        colorbar={"title": {"text": "share of the step's tokens", "side": "right"}, "tickvals": ticks,
                  "ticktext": [f"1e{t}" if t else "1" for t in ticks]},
        hovertemplate="step %{x}<br>%{y}<br>share %{customdata:.3g}<extra></extra>"))
    title, subtitle = VC.fit_title(title, subtitle)
    return VC.finish(fig, title, subtitle, VC.AXIS_TITLES["step"], y_title, height=440)


def bands(df: pd.DataFrame, title: str, log_y: bool, smoothing: float = 0.0,
          x_range: tuple[int, int] | None = None, y_title: str = "", subtitle: str = "") -> go.Figure:
    """TensorBoard-style distribution: shaded p1-p99, p10-p90, p25-p75 bands and the median;
    smoothing applies the EMA to every percentile, x_range zooms the step axis."""
    df = VD.with_breaks(df, "step")
    if smoothing > 0:
        steps = df["step"].to_numpy(dtype=np.float64)
        df = df.assign(**{c: VD.ema(df[c].to_numpy(dtype=np.float64, na_value=np.nan), steps, smoothing)
                          for c in df.columns if c != "step"})
    fig = go.Figure()
    for (lo, hi), alpha in zip((("p1", "p99"), ("p10", "p90"), ("p25", "p75")), (0.15, 0.25, 0.35), strict=True):
        fig.add_trace(go.Scatter(x=df["step"], y=df[hi], mode="lines", line={"width": 0}, showlegend=False,
                                 hoverinfo="skip"))
        fig.add_trace(go.Scatter(x=df["step"], y=df[lo], mode="lines", line={"width": 0}, fill="tonexty",
                                 fillcolor=f"rgba(31,119,180,{alpha})", name=f"{lo} to {hi} percentile",
                                 hovertemplate=f"%{{y:.4g}} <i>({lo})</i>"))
    fig.add_trace(go.Scatter(x=df["step"], y=df["p50"], mode="lines", line={"color": "rgb(31,119,180)"},
                             name="median", hovertemplate="%{y:.4g} <i>(p50)</i>"))
    title, subtitle = VC.fit_title(title, subtitle)
    VC.finish(fig, title, subtitle, VC.AXIS_TITLES["step"], y_title, height=360)
    fig.update_layout(hovermode="x unified")
    if log_y:
        decade_ticks(fig, df[["p1", "p99"]].to_numpy(dtype=np.float64, na_value=np.nan).ravel())
    if x_range is not None:
        fig.update_xaxes(range=list(x_range))
    return fig


def compare(long: pd.DataFrame, title: str, y_title: str, log_y: bool, smoothing: float = 0.0,
            x_range: tuple[int, int] | None = None, subtitle: str = "") -> go.Figure:
    """One line per run of a step metric (long frame: run, step, value, and the column each run's
    value comes from); smoothing and x_range as in `lines`."""
    wide = long.pivot_table(index="step", columns="run", values="value", aggfunc="first", sort=True)
    fig = lines(wide.reset_index(), list(wide.columns), title, log_y, smoothing=smoothing, x_range=x_range,
                height=440, y_title=y_title, subtitle=subtitle, legend_per_row=4)
    if "column" in long.columns:  # the hover names each run's own column
        used = long.groupby("run", sort=False)["column"].first().to_dict()
        for trace in fig.data:
            run = trace.name.removesuffix(" (raw)")
            if run in used and trace.hoverinfo != "skip":
                trace.hovertemplate = f"%{{y:.4g}} <i>({used[run]})</i>"
    return fig


def weight_scatter(sample: pd.DataFrame, n_tokens: int) -> go.Figure:
    """|weight| of k3, k3_is and k2 against d on a bounded token sample (log y)."""
    sample = sample.assign(kind=sample["kind"] if "kind" in sample.columns else "sampled")
    ids = [c for c in ("step", "seq", "d", "flagged", "kind") if c in sample.columns]
    long = sample.melt(id_vars=ids, value_vars=list(ESTIMATOR_COLORS), var_name="column", value_name="weight")
    long["estimator"] = long["column"].map(ESTIMATOR_NAMES)
    long["|weight|"] = np.abs(long["weight"].to_numpy(dtype=np.float64))
    counts = sample["kind"].value_counts()
    worst = ", ".join(f"{n:,} {k}" for k, n in counts.items() if k != "sampled")
    fig = px.scatter(long, x="d", y="|weight|", color="estimator", symbol="kind", log_y=True, opacity=0.6,
                     hover_data=[c for c in ("step", "seq", "kind", "column") if c in long.columns],
                     color_discrete_map={ESTIMATOR_NAMES[c]: v for c, v in ESTIMATOR_COLORS.items()},
                     symbol_map={"sampled": "circle", "flagged": "x", "top |k3 weight|": "diamond"})
    VC.finish(fig, "|gradient weight| against d", f"{worst + ' and ' if worst else ''}"
              f"{int(counts.get('sampled', 0)):,} sampled of {n_tokens:,} tokens",
              "d = log(pi_ref / pi_theta) (nats)", "|weight| (per token, no unit)", height=440, legend_per_row=4)
    decade_ticks(fig, long["|weight|"].to_numpy())
    return fig
