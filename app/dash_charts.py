"""Plotly figures of per-step aggregates (never per-token data, except bounded samples)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
import plotly.express as px
import plotly.graph_objects as go

# Distinct hues: the Streamlit theme's blue shades are hard to tell apart on one chart.
COLORWAY = px.colors.qualitative.D3
ESTIMATOR_COLORS = {"weight_k3": "#d62728", "weight_k3_is": "#2ca02c", "weight_k2": "#7f7f7f"}

LABELS = {
    "k3_mean": "k3 mean", "k3_is_mean": "k3_is mean", "k1_mean": "k1 mean", "k2_mean": "k2 mean",
    "weight_k3_abs_max": "max |k3 weight|", "weight_k3_abs_p99": "p99 |k3 weight|",
    "weight_k3_is_abs_max": "max |k3_is weight|", "weight_k3_is_abs_p99": "p99 |k3_is weight|",
}


def lines(df: pd.DataFrame, columns: Sequence[str], title: str, log_y: bool = False,
          onsets: Sequence[tuple[int, str]] = (), x: str = "step", height: int = 320) -> go.Figure:
    """One line per column of `df` against `x`; dashed vertical lines at alert onsets."""
    fig = go.Figure()
    for c in columns:
        if c in df.columns:
            y = df[c].to_numpy(dtype=np.float64, na_value=np.nan)
            if log_y:
                y = np.where(y > 0, y, np.nan)  # log axes cannot show zeros
            fig.add_trace(go.Scatter(x=df[x], y=y, mode="lines+markers" if len(df) < 60 else "lines",
                                     name=LABELS.get(c, c)))
    for step, label in onsets:
        fig.add_vline(x=step, line_dash="dash", line_color="crimson", opacity=0.7,
                      annotation_text=label, annotation_position="top left", annotation_font_size=10)
    fig.update_layout(title=title, height=height, margin={"l": 10, "r": 10, "t": 40, "b": 10}, colorway=COLORWAY,
                      legend={"orientation": "h", "yanchor": "top", "y": -0.2}, xaxis_title=x)
    if log_y:
        fig.update_yaxes(type="log")
    return fig


def heatmap(steps: np.ndarray, labels: Sequence[str], z: np.ndarray, title: str) -> go.Figure:
    """Share of each step's tokens per bin on a log colour scale, so rare tails stay visible."""
    with np.errstate(divide="ignore"):
        logz = np.where(z > 0, np.log10(np.where(z > 0, z, 1.0)), np.nan)  # empty bins stay blank
    lo = int(np.floor(np.nanmin(logz))) if np.isfinite(logz).any() else -4
    ticks = list(range(lo, 1))
    fig = go.Figure(go.Heatmap(
        x=steps, y=list(labels), z=logz, customdata=z, colorscale="Viridis", zmin=lo, zmax=0,
        colorbar={"title": "share", "tickvals": ticks, "ticktext": [f"1e{t}" if t else "1" for t in ticks]},
        hovertemplate="step %{x}<br>%{y}<br>share %{customdata:.3g}<extra></extra>"))
    fig.update_layout(title=title, height=440, margin={"l": 10, "r": 10, "t": 40, "b": 10}, xaxis_title="step")
    return fig


def bands(df: pd.DataFrame, title: str, log_y: bool) -> go.Figure:
    """TensorBoard-style distribution: shaded p1-p99, p10-p90, p25-p75 bands and the median."""
    fig = go.Figure()
    for (lo, hi), alpha in zip((("p1", "p99"), ("p10", "p90"), ("p25", "p75")), (0.15, 0.25, 0.35), strict=True):
        fig.add_trace(go.Scatter(x=df["step"], y=df[hi], mode="lines", line={"width": 0}, showlegend=False,
                                 hoverinfo="skip"))
        fig.add_trace(go.Scatter(x=df["step"], y=df[lo], mode="lines", line={"width": 0}, fill="tonexty",
                                 fillcolor=f"rgba(31,119,180,{alpha})", name=f"{lo}-{hi}"))
    fig.add_trace(go.Scatter(x=df["step"], y=df["p50"], mode="lines", line={"color": "rgb(31,119,180)"},
                             name="median"))
    fig.update_layout(title=title, height=360, margin={"l": 10, "r": 10, "t": 40, "b": 10}, xaxis_title="step")
    if log_y:
        fig.update_yaxes(type="log")
    return fig


def compare(long: pd.DataFrame, metric: str, log_y: bool) -> go.Figure:
    """One line per run of a step metric (long frame: run, step, value)."""
    fig = px.line(long, x="step", y="value", color="run", log_y=log_y, markers=len(long) < 200,
                  title=f"{metric} per step", color_discrete_sequence=COLORWAY)
    fig.update_layout(height=460, margin={"l": 10, "r": 10, "t": 40, "b": 10}, yaxis_title=metric)
    return fig


def weight_scatter(sample: pd.DataFrame, n_tokens: int) -> go.Figure:
    """|weight| of k3, k3_is and k2 against d on a bounded token sample (log y)."""
    long = sample.melt(id_vars=["step", "d", "flagged"], value_vars=list(ESTIMATOR_COLORS),
                       var_name="estimator", value_name="weight")
    long["|weight|"] = np.abs(long["weight"].to_numpy(dtype=np.float64)).clip(1e-8)
    fig = px.scatter(long, x="d", y="|weight|", color="estimator", symbol="estimator", log_y=True, opacity=0.6,
                     hover_data=["step", "flagged"], color_discrete_map=ESTIMATOR_COLORS,
                     title=f"|gradient weight| vs d = log(pi_ref/pi_theta): {len(sample):,} sampled of "
                           f"{n_tokens:,} tokens")
    fig.update_layout(height=420, margin={"l": 10, "r": 10, "t": 40, "b": 10})
    return fig
