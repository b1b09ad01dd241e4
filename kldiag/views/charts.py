"""Plotly figures that the dashboard and `kldiag report` both draw, built here once (no Streamlit).

- `lines`: one line per column of a frame against the step, W&B-style smoothing, decade ticks
  on log axes, the onsets as dashed lines with labels in lanes;
- `STEP_TRENDS`, `step_trends`: the per-step charts of the dashboard's Overview and of the
  report, with the diagnosis's onsets (`trend_onsets`) marked; the report adds the blow-up limit.

Frames in, figures out: the app displays them with st.plotly_chart, the report embeds them
with plotly.io.to_html.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import plotly.express as px
import plotly.graph_objects as go

from kldiag.diagnosis.types import Diagnosis
from kldiag.views import dash as VD
from kldiag.views import diagnosis as DV

# Distinct hues: the Streamlit theme's blue shades are hard to tell apart on one chart.
COLORWAY = px.colors.qualitative.D3

LABELS = {
    "k3_mean": "k3 mean", "k3_is_mean": "k3_is mean", "k1_mean": "k1 mean", "k2_mean": "k2 mean",
    "weight_k3_abs_max": "max |k3 weight|", "weight_k3_abs_p99": "p99 |k3 weight|",
    "weight_k3_is_abs_max": "max |k3_is weight|", "weight_k3_is_abs_p99": "p99 |k3_is weight|",
}


@dataclass(frozen=True)
class StepChart:
    """One per-step chart: its title, the steps-table columns it draws, and its y axis."""

    title: str
    columns: tuple[str, ...]
    log_y: bool = False


STEP_TRENDS: tuple[StepChart, ...] = (
    StepChart("KL estimate per step: k3 vs k3_is", ("k3_mean", "k3_is_mean"), True),
    StepChart("|gradient weight|: max and p99", ("weight_k3_abs_max", "weight_k3_abs_p99", "weight_k3_is_abs_max",
                                                 "weight_k3_is_abs_p99"), True),
    StepChart("Flagged tokens per step", ("theta_ll_ref_count", "weight_blowup_count", "clamp_saturated_count",
                                          "nonfinite_count", "invalid_count")),
    StepChart("Blame share: flagged tokens' share of |k3 weight|", ("blame_share", "flagged_frac")),
    StepChart("rho = pi_theta / pi_old", ("rho_min", "rho_mean", "rho_max"), True),
    StepChart("Off-policy drift and sampler mismatch", ("rho_clip_frac", "drift_abs_mean", "mismatch_kl",
                                                        "opsm_masked_frac")),
)
WEIGHT_CHART = 1  # the |gradient weight| chart: where the blow-up limit goes


def lines(df: pd.DataFrame, columns: Sequence[str], title: str, log_y: bool = False,
          onsets: Sequence[tuple[int, str]] = (), x: str = "step", height: int = 320,
          smoothing: float = 0.0, x_range: tuple[int, int] | None = None) -> go.Figure:
    """One line per column of `df` against `x`; dashed vertical lines at alert onsets.

    smoothing > 0 draws the time-weighted EMA (kldiag.views.dash.ema) over the raw line,
    which stays faint behind; hover lists every series at a step; x_range zooms the x axis.
    """
    fig = go.Figure()
    xs = df[x].to_numpy()
    shown = []
    for i, c in enumerate(col for col in columns if col in df.columns):
        y = df[c].to_numpy(dtype=np.float64, na_value=np.nan)
        if log_y:
            y = np.where(y > 0, y, np.nan)  # log axes cannot show zeros
        name, color = LABELS.get(c, c), COLORWAY[i % len(COLORWAY)]
        mode = "lines+markers" if len(df) < 60 else "lines"
        if smoothing > 0:
            fig.add_trace(go.Scatter(x=xs, y=y, mode=mode, name=f"{name} (raw)", legendgroup=name, showlegend=False,
                                     opacity=0.25, line={"color": color}, hoverinfo="skip"))
            y = VD.ema(y, xs.astype(np.float64) if x == "step" else None, smoothing)
        fig.add_trace(go.Scatter(x=xs, y=y, mode=mode, name=name, legendgroup=name, line={"color": color}))
        shown.append(y)
    shown_x = x_range or ((float(xs.min()), float(xs.max())) if len(xs) else (0.0, 1.0))
    onset_marks(fig, [(step, label) for step, label in onsets if shown_x[0] <= step <= shown_x[1]], shown_x)
    fig.update_layout(title=title, height=height, margin={"l": 10, "r": 10, "t": 40, "b": 10}, colorway=COLORWAY,
                      legend={"orientation": "h", "yanchor": "top", "y": -0.2}, xaxis_title=x,
                      hovermode="x unified")
    if x_range is not None:
        fig.update_xaxes(range=list(x_range))
    if log_y:
        decade_ticks(fig, np.concatenate(shown) if shown else np.array([]))
    return fig


def decade_ticks(fig: go.Figure, values: np.ndarray, axis: str = "y") -> None:
    """A log axis labelled at decades only (1e-2, 1, 1e2 ...; never "2, 5" without their decade)."""
    update = fig.update_yaxes if axis == "y" else fig.update_xaxes
    update(type="log", dtick=VD.log_dtick(values), exponentformat="power", minor={"ticks": "outside",
                                                                                   "showgrid": False})


def onset_marks(fig: go.Figure, onsets: Sequence[tuple[int, str]], x_range: tuple[float, float]) -> None:
    """Dashed lines at alert onsets, their labels stacked in lanes so that none overlap."""
    lanes = VD.onset_lanes(onsets, *x_range)
    for (step, label), lane in zip(onsets, lanes, strict=True):
        fig.add_vline(x=step, line_dash="dash", line_color="crimson", opacity=0.7)
        fig.add_annotation(x=step, y=1.0 - 0.09 * lane, xref="x", yref="paper", text=label, showarrow=False,
                           xanchor="left", yanchor="top", font={"size": 10, "color": "crimson"},
                           bgcolor="rgba(128,128,128,0.12)")


def trend_onsets(dg: Diagnosis) -> list[tuple[int, str]]:
    """Where the step charts mark an onset: each cause's (info-level notes left out); without a
    cause, the first episode of each kind. One (step, label) per step, labels joined."""
    marks = DV.cause_onsets(dg)
    if marks:
        return marks
    first: dict[str, int] = {}
    for e in sorted(dg.episodes, key=lambda e: e.start):
        first.setdefault(e.kind, int(e.start))
    by_step: dict[int, list[str]] = {}
    for kind, step in first.items():
        by_step.setdefault(step, []).append(kind)
    return [(s, ", ".join(kinds)) for s, kinds in sorted(by_step.items())]


def limit_line(fig: go.Figure, steps: np.ndarray, limit: float, name: str = "blow-up limit") -> None:
    """A dotted horizontal line at `limit` across the steps (a trace: shapes on a log axis take log10 positions)."""
    steps = np.asarray(steps)
    fig.add_trace(go.Scatter(x=[steps.min(), steps.max()] if len(steps) else [], y=[limit] * 2 if len(steps) else [],
                             name=name, mode="lines", line={"dash": "dot", "color": "gray"}, hoverinfo="skip"))


def step_trends(steps: pd.DataFrame, onsets: Sequence[tuple[int, str]] = (), smoothing: float = 0.0,
                x_range: tuple[int, int] | None = None, blowup_weight: float | None = None) -> list[go.Figure]:
    """The STEP_TRENDS charts of a steps table, onsets marked; with blowup_weight, the |gradient
    weight| chart also draws that limit (the report does, with its DiagnosisConfig's value)."""
    figs = [lines(steps, c.columns, c.title, c.log_y, onsets, smoothing=smoothing, x_range=x_range)
            for c in STEP_TRENDS]
    if blowup_weight is not None:
        limit_line(figs[WEIGHT_CHART], steps["step"].to_numpy(), blowup_weight)
    return figs


# ---- the Mismatch page's charts (the dashboard's page and the report's Mismatch section) ----------

MISMATCH_NAMES = {"drift_abs": "|log pi_theta/pi_old| (drift)", "mismatch_abs": "|log pi_old/mu| (mismatch)"}


def binned_lines(df: pd.DataFrame, x: str, cols: Sequence[str], title: str, log_x: bool = False,
                 log_y: bool = False, names: dict[str, str] | None = None) -> go.Figure:
    """One line per column against x (a step, or a bin's centre): markers while there are few points."""
    fig = go.Figure()
    for c in cols:
        fig.add_trace(go.Scatter(x=df[x], y=df[c], mode="lines+markers" if len(df) < 40 else "lines",
                                 name=(names or {}).get(c, c)))
    fig.update_layout(title=title, height=340, margin={"t": 40, "b": 30}, legend={"orientation": "h"})
    fig.update_xaxes(title={"text": {"p": "mu's token probability"}.get(x, x)})
    if log_x:
        fig.update_xaxes(type="log")
    if log_y:
        fig.update_yaxes(type="log")
    return fig


def drift_vs_mismatch(by_step: pd.DataFrame) -> go.Figure:
    """Per step: mean |log pi_theta/pi_old| against mean |log pi_old/mu| (kldiag.mismatch.decompose)."""
    return binned_lines(by_step, "step", ["drift_abs", "mismatch_abs"],
                        "Policy drift against engine mismatch per step (nats)", names=MISMATCH_NAMES)


def mismatch_by_prob(by_prob: pd.DataFrame) -> go.Figure:
    """Mismatch by mu's token probability (bins, at their geometric centre): the low-probability pitfall."""
    prob = by_prob.assign(p=np.sqrt(by_prob["lo"] * by_prob["hi"]))
    return binned_lines(prob, "p", ["mismatch_abs", "mismatch_k3", "drift_abs"],
                        "Mismatch against the sampler's token probability (the low-probability-token pitfall)",
                        log_x=True, log_y=True)
