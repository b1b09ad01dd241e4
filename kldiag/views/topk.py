"""The Tokens page's top-k section: both sides' distributions at one token, the per-step figures.

Shown only for a run that recorded top-k lists (format v1.2's optional `topk_*` columns; the maths
and the reducer are kldiag/analysis/reducers/topk.py). The bar chart puts the engine's (mu) and the
trainer's (pi) listed probabilities side by side over the union of their ids; an id one side did
not list has no bar on that side (its probability is only known to be below that side's smallest
listed one, drawn as a dotted line).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pyarrow as pa
import pyarrow.compute as pc

from kldiag import format as F
from kldiag.analysis.reducers import topk as T
from kldiag.analysis.runtime import runner
from kldiag.errors import KldiagError
from kldiag.views import charts as VC
from kldiag.views.pages import decode

SIDE_NAMES = {"topk_ids_sampler": "engine (mu)", "topk_ids": "trainer (pi)"}
COLORS = {"engine (mu)": "#1f77b4", "trainer (pi)": "#ff7f0e"}
TOPK_IDS = ("topk_ids", "topk_ids_sampler")


def has_topk(run_dir: str | os.PathLike) -> bool:
    """Whether any part of the run holds a top-k column (reads part footers only, newest first)."""
    for part in reversed(F.list_parts(run_dir)):
        try:
            names = set(F.open_part(part, ()).schema_arrow.names)
        except (KldiagError, OSError):  # an unreadable part holds nothing to show; the analysis warns
            continue
        if names.intersection(TOPK_IDS):
            return True
    return False


def summary(analysis, reducer: T.TopkReducer | None = None) -> dict | None:
    """The run's top-k figures (TopkReducer.result; None without top-k lists): read along with the
    analysis when it was made with the reducer, else one pass, cached per part."""
    reducer = reducer or T.TopkReducer()
    return reducer.result(runner.reduced(analysis, reducer))


def steps_frame(result: Mapping | None) -> pd.DataFrame:
    """Per-step figures of `summary` as a frame (empty without top-k lists)."""
    return pd.DataFrame(result["steps"]) if result else pd.DataFrame()


def offenders_frame(result: Mapping | None) -> pd.DataFrame:
    """The tokens with the largest KL estimate, worst first (empty without top-k lists)."""
    return pd.DataFrame(result["offenders"]) if result else pd.DataFrame()


def token_lists(run_dir: str | os.PathLike, step: int, seq: int, pos: int, iteration: int = 0,
                vocab: Mapping[int, str] | None = None) -> pd.DataFrame:
    """Both sides' lists at one token, one row per id in their union: token_id, piece, and per side
    (`engine (mu)`, `trainer (pi)`) its log-prob and prob (NaN where that side did not list the id),
    sorted by the larger prob. Empty when the token or its lists are not in the run."""
    parts = [p for p in F.list_parts(run_dir) if p.step_min <= step <= p.step_max]
    columns = ["step", "seq", "pos", "iteration", *(c for pair in T.SIDES for c in pair)]

    def at(b: pa.RecordBatch) -> pa.Array:
        keep = pc.equal(b.column("seq"), int(seq))
        for name, value in (("pos", pos), ("iteration", iteration)):
            keep = pc.and_(keep, pc.equal(b.column(name), int(value)))
        return keep

    row = F.open_run(run_dir).read_rows(parts, [int(step)], at, columns).slice(0, 1).combine_chunks()
    frames = []
    for ids_name, logp_name in T.SIDES:
        got = T.side(row.to_batches()[0], ids_name, logp_name) if row.num_rows else None
        if got is None:
            continue
        ok = T.valid_slots(*got)[0]
        frames.append(pd.DataFrame({"token_id": got[0][0][ok], "side": SIDE_NAMES[ids_name],
                                    "logp": got[1][0][ok]}))
    if not frames:
        return pd.DataFrame(columns=["token_id", "piece"])
    long = pd.concat(frames, ignore_index=True)
    wide = long.pivot_table(index="token_id", columns="side", values="logp", aggfunc="first")
    out = pd.DataFrame({"token_id": wide.index.astype(np.int64)})
    for name in SIDE_NAMES.values():
        lp = wide[name].to_numpy(np.float64) if name in wide else np.full(len(out), np.nan)
        out[f"logp {name}"], out[f"prob {name}"] = lp, np.exp(lp)
    out["piece"] = decode(out["token_id"], vocab)
    top = out[[f"prob {n}" for n in SIDE_NAMES.values()]].max(axis=1)
    out = out.assign(_top=top.to_numpy()).sort_values("_top", ascending=False)
    return out.drop(columns="_top").reset_index(drop=True)


def distribution_figure(lists: pd.DataFrame, title: str = "") -> go.Figure:
    """Grouped bars of each side's listed probabilities over the union of ids (token_lists's frame);
    a dotted line at each side's smallest listed prob, the most an id it did not list can have."""
    fig = go.Figure()
    labels = [f"{p} ({t})" for p, t in zip(lists["piece"], lists["token_id"], strict=True)]
    for name in SIDE_NAMES.values():
        prob = lists.get(f"prob {name}")
        if prob is None or prob.isna().all():
            continue
        fig.add_bar(x=labels, y=prob, name=name, marker_color=COLORS[name])
        fig.add_hline(y=float(prob.min()), line_dash="dot", line_color=COLORS[name], opacity=0.6)
    fig.update_layout(barmode="group")
    VC.finish(fig, "Top-k distributions at one token", title, "token (id)", "probability (0 to 1)", height=380,
              legend_per_row=4)
    return fig


def first_listed(run_dir: str | os.PathLike) -> dict[str, int] | None:
    """(step, seq, pos, iteration) of the first token in the loss with a top-k list (reads the first
    part that has one), for a token picker's default; None when there is none."""
    run = F.open_run(run_dir)
    for part in F.list_parts(run_dir):
        t = run.read_parts([part], columns=["step", "seq", "pos", "iteration", "mask", *TOPK_IDS])
        has = pc.or_(pc.is_valid(t.column("topk_ids")), pc.is_valid(t.column("topk_ids_sampler")))
        t = t.filter(pc.and_(has, pc.fill_null(t.column("mask"), False)))
        if t.num_rows:
            return {c: int(t.column(c)[0].as_py()) for c in ("step", "seq", "pos", "iteration")}
    return None


def token_label(o: Mapping) -> str:
    """One offender (a row of offenders_frame) as a picker label."""
    return (f"step {int(o['step'])}, seq {int(o['seq'])}, pos {int(o['pos'])}: KL ~ {o['kl']:.3g} "
            f"(>= {o['lower']:.3g})")
