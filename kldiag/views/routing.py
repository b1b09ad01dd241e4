"""MoE routing display: the Mismatch page's routing section and the report's. Data from
kldiag/analysis/reducers/routing.py (`routing_of`), shaped here; no Streamlit.

A run recorded without routes (format v1.3's experts/experts_sampler): `RoutingView.routed` is False and
the faces leave the section out. A run that recorded the trainer's routes only: `RoutingView.compared` is
False, and the faces say which side is missing instead of an agreement (`headline`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pandas as pd
import plotly.graph_objects as go

from kldiag.analysis.reducers import routing as RO
from kldiag.views import charts as VC

TABLE_COLUMNS = {"side": "tokens", "tokens": "count", "mismatch_abs_mean": "mean |log mu - log pi_old|",
                 "mismatch_abs_max": "max |log mu - log pi_old|", "k3_mean": "mean K3 (mismatch KL)",
                 "is_mean": "mean pi_old/mu", "is_max": "max pi_old/mu"}
SIDE_LABELS = {"agree": "routed alike", "disagree": "routed differently"}


@dataclass(frozen=True)
class RoutingView:
    """The routing figures of one run: `summary` is analysis.reducers.routing.summary()."""

    summary: dict[str, Any]

    @property
    def routed(self) -> bool:
        return bool(self.summary.get("routed"))

    @property
    def compared(self) -> bool:
        """Both sides' routes were recorded: agreement, the shares and the by-side mismatch exist."""
        return bool(self.summary.get("compared_tokens"))


def view_of(analysis) -> RoutingView:
    """The run's routing figures (read with the analysis when it was made with diagnosis.core.reducers())."""
    return RoutingView(RO.routing_of(analysis))


def headline(view: RoutingView) -> str:
    """One line: agreement, the share of the mismatch KL carried by tokens routed differently, the two sides."""
    s = view.summary
    a, d = s["agree"], s["disagree"]
    if not view.compared:
        return f"{s['routed_tokens']:,} routed tokens, but {s['not_compared'] or RO.ENGINE_MISSING}"

    def f(v: float | None, spec: str = ".3g") -> str:
        return "-" if v is None else format(v, spec)

    return (f"agreement {f(s['agreement'], '.2%')} of {s['routed_tokens']:,} routed tokens (mean set overlap "
            f"{f(s['overlap_mean'], '.3f')}); tokens routed differently carry {f(s['kl_share_disagree'], '.0%')} of "
            f"the mismatch KL: mean |log mu - log pi_old| {f(d['mismatch_abs_mean'])} on them, "
            f"{f(a['mismatch_abs_mean'])} on tokens routed alike; missing engine routes {f(s['missing_share'], '.2%')}")


def table(view: RoutingView) -> pd.DataFrame:
    """Two rows, tokens routed alike and differently: count, mismatch, K3, importance ratio."""
    rows = [{"side": SIDE_LABELS[k], **view.summary[k]} for k in RO.SIDES]
    return pd.DataFrame(rows)[list(TABLE_COLUMNS)].rename(columns=TABLE_COLUMNS)


def steps_frame(view: RoutingView) -> pd.DataFrame:
    """Per step: agreement, mismatch on both sides, the KL share, AReaL's two figures."""
    rows = view.summary["steps"]
    df = pd.DataFrame({"step": [r["step"] for r in rows],
                       "agreement": [None if r["differ_share"] is None else 1 - r["differ_share"] for r in rows],
                       **{k: [r[k] for r in rows] for k in ("agree_mismatch_abs_mean", "disagree_mismatch_abs_mean",
                                                             "kl_share_disagree", "areal_k3_mean",
                                                             "areal_extreme_frac")}})
    return df.astype({c: float for c in df.columns if c != "step"})


REPLAY_LIMIT = 0.01  # diagnosis.routing.RoutingConfig.max_differ_share: the heatmap's scale reaches twice it


def agreement_by_layer(view: RoutingView, limit: float = REPLAY_LIMIT) -> go.Figure:
    """Heatmap, step x layer: the share of routed tokens whose expert set DIFFERS at that layer, every routed
    layer shown (one where nothing differs is grey). Grey at 0, dark red from twice the replay limit up
    (`limit`, 1%: Miles' replay check): a layer over the limit stands out against a clean one."""
    rows = view.summary["steps"]
    width = len(view.summary["layers"])
    z = [[None if v is None else v for v in r["differ_share_by_layer"]] + [None] * (width - len(
        r["differ_share_by_layer"])) for r in rows]
    top = max([limit * 2, *(v for line in z for v in line if v is not None)])
    fig = go.Figure(go.Heatmap(x=list(range(width)), y=[r["step"] for r in rows], z=z, zmin=0, zmax=top,
                               colorscale=[[0.0, "#e5e7eb"], [min(limit / top, 1.0), "#fcae91"], [1.0, "#a50f15"]],
                               xgap=2, ygap=1,
                               colorbar={"title": {"text": "differ"}, "tickformat": ".1%"},
                               hovertemplate="layer %{x}, step %{y}: %{z:.2%} routed differently<extra></extra>"))
    return VC.finish(fig, "Routed differently, by layer and step",
                     f"share of routed tokens whose expert set differs; grey 0, pink at the {limit:.0%} replay limit",
                     "MoE layer (index)", "training step", height=320)


def mismatch_by_side(view: RoutingView, onsets=()) -> go.Figure:
    """Per step: mean |log mu - log pi_old| on tokens routed alike and differently."""
    df = steps_frame(view).rename(columns={"agree_mismatch_abs_mean": SIDE_LABELS["agree"],
                                           "disagree_mismatch_abs_mean": SIDE_LABELS["disagree"]})
    return VC.lines(df, list(SIDE_LABELS.values()), "Engine mismatch, routed alike vs differently",
                    onsets=onsets, y_title="nats per token", subtitle="mean |log mu - log pi_old| per step")


def agreement_by_step(view: RoutingView, onsets=()) -> go.Figure:
    """Per step: routing agreement and the share of the mismatch KL the tokens routed differently carry."""
    df = steps_frame(view).rename(columns={"agreement": "routing agreement",
                                           "kl_share_disagree": "mismatch KL routed differently",
                                           "areal_extreme_frac": "tokens with |D| > ln 2 (AReaL)"})
    return VC.lines(df, ["routing agreement", "mismatch KL routed differently", "tokens with |D| > ln 2 (AReaL)"],
                    "Routing agreement and the mismatch it carries", onsets=onsets, y_title="share (0 to 1)",
                    subtitle="D = log pi_train - log mu", legend_per_row=3)
