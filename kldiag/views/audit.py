"""The dashboard's audit section (Mismatch page): what the trainer logged against kldiag's
recomputation from the tokens, per metric and step (kldiag.crosswalk.audit). No Streamlit here.

`kldiag dashboard RUN --logs SRC` passes {run path: SRC} to the app in LOGS_ENV (JSON).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import pandas as pd
import plotly.graph_objects as go

from kldiag.crosswalk.audit import audit
from kldiag.errors import KldiagError
from kldiag.views import charts as VC

LOGS_ENV = "KLDIAG_LOGS"
SUMMARY_COLUMNS = ["metric", "logged as", "steps", "max rel diff", "verdict", "reason"]


@dataclass(frozen=True)
class AuditView:
    """summary: one row per audited metric; series: long frame (metric, step, logged, recomputed);
    error: why the audit could not run (shown instead), else None."""

    summary: pd.DataFrame
    series: pd.DataFrame
    error: str | None = None


def logs_for(path: str, env: dict[str, str] | None = None) -> str | None:
    """The metric log paired with run `path` by `kldiag dashboard --logs`, or None."""
    text = (env if env is not None else os.environ).get(LOGS_ENV)
    return json.loads(text).get(str(path)) if text else None


def audit_view(path: str, logs: str, framework: str) -> AuditView:
    """The audit of run `path` against `logs` under `framework`'s metrics, as frames."""
    empty = pd.DataFrame(columns=SUMMARY_COLUMNS)
    try:
        res = audit(path, logs, framework)
    except KldiagError as e:
        return AuditView(empty, pd.DataFrame(columns=["metric", "step", "logged", "recomputed"]), str(e))
    summary = pd.DataFrame([[m.name, m.logged_name, m.steps, m.max_rel_diff, m.verdict, m.reason or ""]
                            for m in res.metrics], columns=SUMMARY_COLUMNS)
    series = pd.DataFrame([(m.name, s, a, b) for m in res.metrics for s, a, b in m.series],
                          columns=["metric", "step", "logged", "recomputed"])
    return AuditView(summary, series)


def overlay(series: pd.DataFrame, metric: str) -> go.Figure:
    """Logged (markers) and recomputed (line) values of one metric per step."""
    df = series[series["metric"] == metric].sort_values("step")
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=df["step"], y=df["recomputed"], mode="lines", name="recomputed by kldiag"))
    fig.add_trace(go.Scatter(x=df["step"], y=df["logged"], mode="markers", name="logged by the trainer"))
    title, subtitle = VC.fit_title(f"{metric}: logged vs recomputed")
    VC.finish(fig, title, subtitle, VC.AXIS_TITLES["step"], metric, height=300)
    return fig
