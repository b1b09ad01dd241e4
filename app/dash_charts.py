"""Plotly figures of per-step aggregates (never per-token data, except bounded samples).

The step charts the report draws too (`lines`, the Overview's step trends) and the rules every
chart follows (titles, axis titles with units, legends, log axes) are in kldiag.views.charts;
this module keeps the dashboard's own charts (heatmap, bands, compare, scatter) on those rules."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
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


KIND_SYMBOLS = {"sampled": "circle", "flagged": "x", "top |k3 weight|": "diamond"}


def weight_scatter(sample: pd.DataFrame, n_tokens: int) -> go.Figure:
    """|weight| of k3, k3_is and k2 against d on a bounded token sample (log y): a WebGL trace per
    (estimator, kind of token), estimators by colour and kinds by symbol. Built from the columns' arrays:
    plotly express's grouping of the melted frame was a third of the page's warm first render (0.3 s)."""
    kind = (sample["kind"].to_numpy(dtype=object) if "kind" in sample.columns
            else np.full(len(sample), "sampled", dtype=object))
    d = sample["d"].to_numpy(dtype=np.float64)
    ids = [c for c in ("step", "seq") if c in sample.columns]
    custom = np.stack([sample[c].to_numpy() for c in ids], 1) if ids else None
    hover = "".join(f"<br>{c}=%{{customdata[{i}]}}" for i, c in enumerate(ids))
    kinds = list(dict.fromkeys(kind.tolist()))  # in order of appearance, as the legend lists them
    fig, every = go.Figure(), []
    for col, color in ESTIMATOR_COLORS.items():
        w = np.abs(sample[col].to_numpy(dtype=np.float64))
        every.append(w)
        name = ESTIMATOR_NAMES[col]
        for k in kinds:
            sel = kind == k
            fig.add_trace(go.Scattergl(
                x=d[sel], y=w[sel], mode="markers", name=f"{name}, {k}", legendgroup=f"{name}, {k}", showlegend=True,
                marker={"color": color, "opacity": 0.6, "symbol": KIND_SYMBOLS.get(k, "circle")},
                customdata=custom[sel] if custom is not None else None,
                hovertemplate=f"estimator={name}<br>kind={k}<br>d=%{{x}}<br>|weight|=%{{y}}{hover}"
                              f"<br>column={col}<extra></extra>"))
    fig.update_yaxes(type="log")
    fig.update_layout(legend={"title": {"text": ""}, "tracegroupgap": 0})
    counts = pd.Series(kind).value_counts()
    worst = ", ".join(f"{n:,} {k}" for k, n in counts.items() if k != "sampled")
    VC.finish(fig, "|gradient weight| against d", f"{worst + ' and ' if worst else ''}"
              f"{int(counts.get('sampled', 0)):,} sampled of {n_tokens:,} tokens",
              "d = log(pi_ref / pi_theta) (nats)", "|weight| (per token, no unit)", height=440, legend_per_row=4)
    decade_ticks(fig, np.concatenate(every) if every else np.zeros(0))
    return fig
