"""Plotly figures that the dashboard and `kldiag report` both draw, built here once (no Streamlit).

Every chart follows the same rules, so that it reads without hovering:
- `finish`: a short title (a subtitle for the rest and for notes), every axis titled with its
  unit, the legend under the x-axis title (never over it), series named in words;
- `log_axis`: log axes labelled at whole decades only, at least two of them, at most about
  eight; a lower tail far below the data (zeros, 1e-8 weights) is cut off the axis with a
  note saying how many points are not drawn;
- `lines`: one line per column against the step, the column in the hover, W&B-style
  smoothing, the line broken over missing steps, the onsets as dashed lines with labels in lanes;
- `STEP_TRENDS`, `step_trends`: the per-step charts of the dashboard's Overview and of the
  report, with the diagnosis's onsets (`trend_onsets`) marked; the report adds the blow-up limit.

Frames in, figures out: the app displays them with st.plotly_chart, the report embeds them
with plotly.io.to_html.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import plotly.colors
import plotly.graph_objects as go

from kldiag.diagnosis.types import Diagnosis
from kldiag.views import dash as VD
from kldiag.views import diagnosis as DV
from kldiag.views import leads as VL

# Distinct hues: the Streamlit theme's blue shades are hard to tell apart on one chart. From plotly.colors:
# plotly.express would cost every page 0.08 s of imports for this list.
COLORWAY = plotly.colors.qualitative.D3

# Series in words (the column itself is in the hover).
LABELS = {
    "k3_mean": "k3 mean", "k3_is_mean": "k3_is mean", "k1_mean": "k1 mean", "k2_mean": "k2 mean",
    "weight_k3_abs_max": "max |k3 weight|", "weight_k3_abs_p99": "p99 |k3 weight|",
    "weight_k3_is_abs_max": "max |k3_is weight|", "weight_k3_is_abs_p99": "p99 |k3_is weight|",
    "theta_ll_ref_count": "pi_theta << pi_ref", "weight_blowup_count": "|k3 weight| > limit",
    "clamp_saturated_count": "k3 above the clamp", "nonfinite_count": "non-finite log-prob",
    "invalid_count": "log-prob > 0", "blame_share": "flagged share of |k3 weight|",
    "flagged_frac": "flagged share of tokens", "rho_clip_frac": "tokens with rho clipped",
    "opsm_masked_frac": "sequences masked (OPSM)", "rho_min": "min rho", "rho_mean": "mean rho",
    "rho_max": "max rho", "drift_abs_mean": "policy drift |log pi_theta/pi_old|",
    "mismatch_kl": "engine mismatch KL(mu||pi_old)",
    "drift_abs": "drift |log pi_theta/pi_old|", "mismatch_abs": "mismatch |log pi_old/mu|",
    "mismatch_k3": "mismatch k3(mu, pi_old)", "token_frac": "tokens masked or clipped",
    "seq_frac": "sequences affected", "ess": "effective sample size (share)",
    "mass_removed_pos_share": "removed where A > 0", "mass_removed_neg_share": "removed where A < 0",
    "masked_frac": "sequences masked", "logp": "policy pi_theta", "logp_old": "old policy pi_old",
    "logp_ref": "reference pi_ref", "logp_sampler": "sampler mu", "weight_k3_abs": "|k3 weight|",
    "weight_k3_is_abs": "|k3_is weight|",
}
AXIS_TITLES = {"step": "training step", "p": "mu's token probability", "position": "position in the completion (token)",
               "entropy": "token entropy (nats)", "delta": "delta (nats per token)", "pos": "position (token)",
               "token": "token (index in the sequence)"}
TITLE_CHARS = 48  # a title longer than this is cut on a half-width chart (17 px text, ~500 px wide)
MAX_DECADES_BELOW = 2  # a lower tail this many decades below the data's 1st percentile is cut off


@dataclass(frozen=True)
class StepChart:
    """One per-step chart: its title, the steps-table columns it draws, its y axis (title with unit, log)."""

    title: str
    columns: tuple[str, ...]
    log_y: bool = False
    y_title: str = ""
    subtitle: str = ""


STEP_TRENDS: tuple[StepChart, ...] = (
    StepChart("KL estimate per step: k3 vs k3_is", ("k3_mean", "k3_is_mean"), True, "KL (nats per token)",
              "mean over the step's tokens"),
    StepChart("|gradient weight|: max and p99", ("weight_k3_abs_max", "weight_k3_abs_p99", "weight_k3_is_abs_max",
                                                 "weight_k3_is_abs_p99"), True, "|weight| (per token, no unit)",
              "over the step's tokens; a typical token's is about 1"),
    StepChart("Flagged tokens per step", ("theta_ll_ref_count", "weight_blowup_count", "clamp_saturated_count",
                                          "nonfinite_count", "invalid_count"), False, "tokens",
              "by flag; a token can carry several"),
    StepChart("Flagged and masked shares per step", ("blame_share", "flagged_frac", "rho_clip_frac",
                                                     "opsm_masked_frac"), False, "share (0 to 1)",
              "of the step's tokens, sequences or |k3 weight|"),
    StepChart("rho = pi_theta / pi_old", ("rho_min", "rho_mean", "rho_max"), True, "rho (ratio)",
              "min, mean and max over the step's tokens"),
    StepChart("Drift |log pi_theta/pi_old| and KL(mu||pi_old)", ("drift_abs_mean", "mismatch_kl"), False,
              "nats per token", "means over the step's tokens (the Mismatch page plots |log pi_old/mu|)"),
)
# zero, not null, on a run without logp_ref: left out of the charts there (they were never measured)
REF_SERIES = ("theta_ll_ref_count", "weight_blowup_count", "clamp_saturated_count", "flagged_frac", "blame_share")
WEIGHT_CHART = 1  # the |gradient weight| chart: where the blow-up limit goes


def name_of(column: str) -> str:
    """A series' name in words (the column itself when there is none)."""
    return LABELS.get(column, column)


def finish(fig: go.Figure, title: str, subtitle: str = "", x_title: str = "", y_title: str = "",
           height: int = 340, legend_per_row: int = 2, extra: dict | None = None) -> go.Figure:
    """The layout every chart shares: title and subtitle above the plot, both axes titled, the
    legend under the x-axis title (its own rows at the bottom of the figure, never over a title;
    `legend_per_row`: about how many entries fit a row, 2 on a half-width chart). `extra`: more layout
    set in the same update (each plotly update validates the whole layout again)."""
    fig.update_layout(**finish_layout(title, subtitle, x_title, y_title, height, _legend_rows(fig, legend_per_row),
                                      extra))
    return fig


def finish_layout(title: str, subtitle: str = "", x_title: str = "", y_title: str = "", height: int = 340,
                  legend_rows: int = 0, extra: dict | None = None) -> dict:
    """`finish`'s layout as a dict, for a figure built from dicts (`lines`); legend_rows: `_legend_rows`."""
    bottom = 58 + 22 * legend_rows  # tick labels and the x title, then the legend's rows
    layout = dict(
        title={"text": title, "subtitle": {"text": subtitle}, "x": 0.0, "xref": "paper", "xanchor": "left",
               "yref": "container", "y": 0.985, "yanchor": "top"},
        height=height + 22 * legend_rows, colorway=COLORWAY,
        margin={"l": 10, "r": 20, "t": 64 if subtitle else 44, "b": bottom},
        legend={"orientation": "h", "yref": "container", "y": 0.0, "yanchor": "bottom", "x": 0.0,
                "xanchor": "left", "title": {"text": ""}},
        xaxis={"title": {"text": x_title}, "automargin": True},
        yaxis={"title": {"text": y_title}, "automargin": True})
    for key, value in (extra or {}).items():
        layout[key] = {**layout[key], **value} if isinstance(layout.get(key), dict) else value
    return layout


def _legend_rows(fig: go.Figure, per_row: int = 2) -> int:
    """Rows the legend takes under the chart: about `per_row` entries a row on a half-width chart."""
    return _rows(sum(t.showlegend is not False and bool(t.name) for t in fig.data), per_row)


def _rows(shown: int, per_row: int) -> int:
    return 0 if shown < 2 else math.ceil(shown / per_row)


def fit_title(title: str, subtitle: str = "") -> tuple[str, str]:
    """A title short enough not to be cut: the words past TITLE_CHARS go to the front of the subtitle."""
    if len(title) <= TITLE_CHARS:
        return title, subtitle
    cut = title.rfind(" ", 0, TITLE_CHARS)
    head, rest = title[:cut], title[cut + 1:]
    return head, (f"{rest}; {subtitle}" if subtitle else rest)


def log_axis(fig: go.Figure, values: np.ndarray, axis: str = "y", max_labels: int = 4) -> str:
    """A log axis labelled at whole decades: at least two labels, at most about `max_labels`
    (four fit a 200 px tall plot with room between them).

    The range runs from the decade below the data to the decade above it; a lower tail more
    than MAX_DECADES_BELOW decades under the 1st percentile (weights of 0 or 1e-8 next to
    weights of 1) is cut off. Returns a note saying how many points are not drawn ("" when none).
    """
    props, note = log_axis_props(values, max_labels)
    (fig.update_yaxes if axis == "y" else fig.update_xaxes)(**props)
    return note


def log_axis_props(values: np.ndarray, max_labels: int = 4) -> tuple[dict, str]:
    """`log_axis`'s axis properties and note, for a layout built as a dict."""
    v = np.asarray(values, dtype=np.float64).ravel()
    v = v[~np.isnan(v)]
    pos = v[np.isfinite(v) & (v > 0)]
    if pos.size == 0:
        return {"type": "log"}, ""
    lo, hi = math.floor(math.log10(pos.min())), math.ceil(math.log10(pos.max()))
    floor = math.floor(math.log10(np.quantile(pos, 0.01))) - MAX_DECADES_BELOW
    lo = max(lo, floor)
    hi = max(hi, lo + 1)
    dtick = max(1, math.ceil((hi - lo) / max_labels))
    pad = 0.04 * (hi - lo)  # the corner labels of two log axes (1e-4 under 1e-3) would touch
    props = {"type": "log", "range": [lo - pad, hi + pad], "dtick": dtick, "tick0": lo, "exponentformat": "power",
             "minor": {"ticks": "outside", "showgrid": False, "ticklen": 3}}
    below = int((np.isfinite(v) & (v < 10.0 ** lo)).sum())
    return props, (f"{below:,} point{'s' if below != 1 else ''} below 1e{lo} not drawn" if below else "")


def decade_ticks(fig: go.Figure, values: np.ndarray, axis: str = "y") -> None:
    """A log axis labelled at decades only (see `log_axis`), its note added to the subtitle."""
    add_note(fig, log_axis(fig, values, axis))


def add_note(fig: go.Figure, note: str) -> None:
    """Append a note (what a clipped axis leaves out) to the figure's subtitle."""
    if not note:
        return
    sub = fig.layout.title.subtitle.text or ""
    fig.update_layout(title_subtitle_text=f"{sub} · {note}" if sub else note)
    fig.update_layout(margin_t=max(fig.layout.margin.t or 0, 64))


def lines(df: pd.DataFrame, columns: Sequence[str], title: str, log_y: bool = False,
          onsets: Sequence[tuple[int, str]] = (), x: str = "step", height: int = 320,
          smoothing: float = 0.0, x_range: tuple[int, int] | None = None, y_title: str = "",
          subtitle: str = "", x_title: str | None = None, legend_per_row: int = 2) -> go.Figure:
    """One line per column of `df` against `x`; dashed vertical lines at alert onsets.

    Against the step, a step missing beyond the run's stride breaks the lines (`dash.with_breaks`).
    smoothing > 0 draws the time-weighted EMA (kldiag.views.dash.ema) over the raw line,
    which stays faint behind; hover lists every series at a step; x_range zooms the x axis.
    """
    if x == "step":
        df = VD.with_breaks(df, x)
    xs = df[x].to_numpy()
    traces, shown = _line_traces(df, columns, xs, x, log_y, smoothing)
    finite_x = xs[pd.notna(xs)].astype(np.float64) if len(xs) else np.array([])
    shown_x = x_range or ((float(finite_x.min()), float(finite_x.max())) if finite_x.size else (0.0, 1.0))
    extra = {"hovermode": "x unified", **onset_layout([(step, label) for step, label in onsets
                                                       if shown_x[0] <= step <= shown_x[1]], shown_x)}
    if x_range is not None:
        extra["xaxis"] = {"range": list(x_range)}
    title, subtitle = fit_title(title, subtitle)
    legend = _rows(sum(t.get("showlegend") is not False for t in traces), legend_per_row)
    layout = finish_layout(title, subtitle, AXIS_TITLES.get(x, x) if x_title is None else x_title, y_title, height,
                           legend, extra)
    if log_y:
        props, note = log_axis_props(np.concatenate(shown) if shown else np.array([]))
        layout["yaxis"] = {**layout["yaxis"], **props}
        if note:  # add_note's
            layout["title"]["subtitle"]["text"] = f"{subtitle} · {note}" if subtitle else note
            layout["margin"]["t"] = max(layout["margin"]["t"], 64)
    # built from plain dicts, unvalidated (plotly validates every property of every update: most of a
    # refresh's chart time); tests/test_views_charts.py checks the figure equals plotly's validated one
    return go.Figure({"data": traces, "layout": layout}, _validate=False)


def _line_traces(df: pd.DataFrame, columns: Sequence[str], xs: np.ndarray, x: str, log_y: bool,
                 smoothing: float) -> tuple[list[dict], list[np.ndarray]]:
    """`lines`' scatter traces as dicts (the smoothed line over its faint raw one) and the y values drawn."""
    shown, traces = [], []
    for i, c in enumerate(col for col in columns if col in df.columns):
        y = df[c].to_numpy(dtype=np.float64, na_value=np.nan)
        if log_y:
            y = np.where(y > 0, y, np.nan)  # log axes cannot show zeros
        name, color = name_of(c), COLORWAY[i % len(COLORWAY)]
        mode = "lines+markers" if len(df) < 60 else "lines"
        if smoothing > 0:
            traces.append({"type": "scatter", "x": xs, "y": y, "mode": mode, "name": f"{name} (raw)",
                           "legendgroup": name, "showlegend": False, "opacity": 0.25, "line": {"color": color},
                           "hoverinfo": "skip"})
            y = VD.ema(y, xs.astype(np.float64) if x == "step" else None, smoothing)
        traces.append({"type": "scatter", "x": xs, "y": y, "mode": mode, "name": name, "legendgroup": name,
                       "line": {"color": color}, "hovertemplate": f"%{{y:.4g}} <i>({c})</i>"})
        shown.append(y)
    return traces, shown


def onset_layout(onsets: Sequence[tuple[int, str]], x_range: tuple[float, float]) -> dict[str, list]:
    """Dashed lines at alert onsets, their labels stacked in lanes so that none overlap: the layout's
    shapes and annotations (what fig.add_vline and add_annotation make, without their per-call
    validation of the whole figure)."""
    lanes = VD.onset_lanes(onsets, *x_range)
    shapes, notes = [], []
    for (step, label), lane in zip(onsets, lanes, strict=True):
        shapes.append({"type": "line", "x0": step, "x1": step, "xref": "x", "y0": 0, "y1": 1, "yref": "y domain",
                       "line": {"dash": "dash", "color": "crimson"}, "opacity": 0.7})
        notes.append({"x": step, "y": 1.0 - 0.11 * lane, "xref": "x", "yref": "paper", "text": label,
                      "showarrow": False, "xanchor": "left", "yanchor": "top",
                      "font": {"size": 10, "color": "crimson"}, "bgcolor": "rgba(128,128,128,0.12)"})
    return {"shapes": shapes, "annotations": notes} if onsets else {}


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
    finish_legend(fig)


def finish_legend(fig: go.Figure, per_row: int = 2) -> None:
    """Room for the legend again after a trace was added to a finished figure."""
    rows = _legend_rows(fig, per_row)
    extra = 22 * rows - (fig.layout.margin.b - 58)
    if extra > 0:
        fig.update_layout(height=fig.layout.height + extra, margin_b=fig.layout.margin.b + extra)


def _measured(steps: pd.DataFrame) -> tuple[list[tuple[int, StepChart, tuple[str, ...]]], list[str]]:
    """The charts to draw with the series each keeps, and a sentence per chart left out. A series all null
    was not measured; without logp_ref the flag counts are zeros that were never measured either; a chart
    with nothing left, or with only zero counts, is left out and said. An empty table keeps every chart."""
    if steps.empty:
        return [(i, c, c.columns) for i, c in enumerate(STEP_TRENDS)], []
    no_ref = "k3_mean" in steps and steps["k3_mean"].isna().all()
    kept, gaps = [], []
    for i, c in enumerate(STEP_TRENDS):
        cols = tuple(k for k in c.columns if k in steps and steps[k].notna().any() and not (no_ref and k in REF_SERIES))
        if not cols:
            need = "logp_ref" if no_ref and any(k in REF_SERIES or k.startswith(("k3", "weight")) for k in c.columns) \
                else "advantage" if "opsm_masked_frac" in c.columns else "logp_sampler"
            gaps.append(f"\"{c.title}\" is not drawn: " + VL.needs("it", need))
        elif no_ref and cols != c.columns and not (steps[list(cols)].fillna(0) != 0).any().any():
            # what is left without logp_ref is 0 on every step: said, not drawn as a flat line on a -1..1 axis
            gaps.append(f"\"{c.title}\" is not drawn: " + ", ".join(name_of(k) for k in cols)
                        + " is 0 on every step; the rest needs logp_ref")
        else:
            kept.append((i, c, cols))
    return kept, gaps


def trend_gaps(steps: pd.DataFrame) -> list[str]:
    """What step_trends leaves out of a steps table, and why (the column it needs, how to record it)."""
    return _measured(steps)[1]


def step_trends(steps: pd.DataFrame, onsets: Sequence[tuple[int, str]] = (), smoothing: float = 0.0,
                x_range: tuple[int, int] | None = None, blowup_weight: float | None = None) -> list[go.Figure]:
    """The STEP_TRENDS charts of a steps table that the run measured (`trend_gaps` says which are left out),
    onsets marked; with blowup_weight, the |gradient weight| chart also draws that limit (the report does,
    with its DiagnosisConfig's value)."""
    figs = []
    for i, c, cols in _measured(steps)[0]:
        figs.append(lines(steps, cols, c.title, c.log_y, onsets, smoothing=smoothing, x_range=x_range,
                          y_title=c.y_title, subtitle=c.subtitle))
        if i == WEIGHT_CHART and blowup_weight is not None:
            limit_line(figs[-1], steps["step"].to_numpy(), blowup_weight)
    return figs


# ---- the Mismatch page's charts (the dashboard's page and the report's Mismatch section) ----------

MISMATCH_NAMES = {"drift_abs": "|log pi_theta/pi_old| (drift)", "mismatch_abs": "|log pi_old/mu| (mismatch)"}
# one colour per quantity on every chart of the Mismatch page, whatever the order of its lines
MISMATCH_COLORS = {"drift_abs": COLORWAY[0], "mismatch_abs": COLORWAY[1], "mismatch_k3": COLORWAY[2]}


def binned_lines(df: pd.DataFrame, x: str, cols: Sequence[str], title: str, log_x: bool = False,
                 log_y: bool = False, names: dict[str, str] | None = None, y_title: str = "nats per token",
                 subtitle: str = "") -> go.Figure:
    """One line per column against x (a step, or a bin's centre): markers while there are few points."""
    fig = go.Figure()
    if x == "step":
        df = VD.with_breaks(df, x)
    for c in cols:
        fig.add_trace(go.Scatter(x=df[x], y=df[c], mode="lines+markers" if len(df) < 40 else "lines",
                                 name=(names or {}).get(c, name_of(c)), hovertemplate=f"%{{y:.4g}} <i>({c})</i>",
                                 line={"color": MISMATCH_COLORS[c]} if c in MISMATCH_COLORS else None))
    title, subtitle = fit_title(title, subtitle)
    finish(fig, title, subtitle, AXIS_TITLES.get(x, x), y_title)
    if log_x:
        add_note(fig, log_axis(fig, df[x].to_numpy(dtype=np.float64, na_value=np.nan), "x"))
    if log_y:
        add_note(fig, log_axis(fig, df[list(cols)].to_numpy(dtype=np.float64, na_value=np.nan), "y"))
    return fig


def drift_vs_mismatch(by_step: pd.DataFrame) -> go.Figure:
    """Per step: mean |log pi_theta/pi_old| against mean |log pi_old/mu| (kldiag.mismatch.decompose)."""
    return binned_lines(by_step, "step", ["drift_abs", "mismatch_abs"], "Mean |log-ratio| per token: drift and mismatch",
                        names=MISMATCH_NAMES, subtitle="mean absolute log-ratio over the step's tokens, nats")


def mismatch_by_prob(by_prob: pd.DataFrame) -> go.Figure:
    """Mismatch by mu's token probability (bins, at their geometric centre): the low-probability pitfall."""
    prob = by_prob.assign(p=np.sqrt(by_prob["lo"] * by_prob["hi"]))
    return binned_lines(prob, "p", ["mismatch_abs", "mismatch_k3", "drift_abs"],
                        "Mismatch by the sampler's probability", log_x=True, log_y=True,
                        subtitle="the low-probability-token pitfall: unlikely tokens mismatch most")
