"""Per-turn display for multi-turn (agentic) runs: the Mismatch page's chart, the Sequence page's turns,
the report's section. Data from kldiag/analysis/reducers/turns.py (`turns_of`), shaped here; no Streamlit.

Single-turn runs: `TurnsView.multi_turn` is False and the faces leave their turn sections out.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from kldiag.analysis.cache import store
from kldiag.analysis.reducers import turns as TU
from kldiag.views import charts as VC
from kldiag.views import pages as V

TABLE_COLUMNS = {"turn": "turn", "tokens": "tokens", "mismatch_abs_mean": "mean |log mu - log pi_old|",
                 "start_mismatch_abs_mean": "... at its first token", "body_mismatch_abs_mean": "... after it",
                 "mismatch_abs_max": "max |log mu - log pi_old|", "mismatch_mean": "mean log mu - log pi_old",
                 "drift_abs_mean": "mean |log pi_theta - log pi_old|", "weight_k3_abs_mean": "mean |k3 weight|",
                 "flagged_frac": "flagged share"}
TOOL_STYLE = "background: rgba(148,163,184,0.18); color: #64748b; opacity: 0.75"  # tokens outside the loss


@dataclass(frozen=True)
class TurnsView:
    """The per-turn figures of one run: `summary` is analysis.reducers.turns.summary()."""

    summary: dict[str, Any]

    @property
    def multi_turn(self) -> bool:
        return bool(self.summary.get("multi_turn"))


def view_of(analysis) -> TurnsView:
    """The run's per-turn figures (read with the analysis when it was made with diagnosis.core.reducers()),
    kept in the run's result store (kldiag.analysis.cache.store)."""
    return store.cached(analysis, "turns_view", [], lambda: TurnsView(TU.turns_of(analysis)))


def table(view: TurnsView) -> pd.DataFrame:
    """One row per turn: tokens, mismatch (at the first token and after it), drift, |k3 weight|, flagged share."""
    df = pd.DataFrame(view.summary["by_turn"])
    if df.empty:
        return pd.DataFrame(columns=list(TABLE_COLUMNS.values()))
    return df[[c for c in TABLE_COLUMNS if c in df.columns]].rename(columns=TABLE_COLUMNS)


def steps_frame(view: TurnsView, key: str = "mismatch_abs_mean") -> pd.DataFrame:
    """Per step, one column per turn ("turn 0", ...): mean |log mu - log pi_old| (key) of that turn."""
    rows = view.summary["steps"]
    n = view.summary["turns"]
    out = {"step": [r["step"] for r in rows]}
    for t in range(n):
        out[f"turn {TU.turn_label(t)}"] = [r[key][t] if t < len(r[key]) else None for r in rows]
    return pd.DataFrame(out).astype({f"turn {TU.turn_label(t)}": float for t in range(n)})


def mismatch_by_step(view: TurnsView, onsets=()) -> go.Figure:
    """Per step, one line per turn: the engine mismatch of that turn's tokens."""
    df = steps_frame(view)
    return VC.lines(df, [c for c in df.columns if c != "step"], "Engine mismatch per step, by turn", onsets=onsets,
                    y_title="nats per token", subtitle="mean |log mu - log pi_old| of each turn's tokens")


def start_vs_body(view: TurnsView) -> go.Figure:
    """Per turn: mismatch at the turn's first token against the rest of the turn (a re-tokenised boundary
    shows as a tall first-token bar from turn 1 on)."""
    rows = view.summary["by_turn"]
    turns = [f"turn {r['turn']}" for r in rows]
    fig = go.Figure()
    for key, name in (("start_mismatch_abs_mean", "first token"), ("body_mismatch_abs_mean", "rest of the turn")):
        fig.add_trace(go.Bar(x=turns, y=[r[key] for r in rows], name=name))
    fig.update_layout(barmode="group")
    return VC.finish(fig, "A turn's first token vs the rest", "mean |log mu - log pi_old|", "turn",
                     "nats per token", height=320)


# ---- the Sequence page ------------------------------------------------------------------------


def annotate(df: pd.DataFrame) -> pd.DataFrame:
    """A sequence's tokens (read_sequence: sorted by iteration, pos) with `turn` and `pos_in_turn`:
    the recorded turn where present, else derived from the mask (analysis.reducers.turns.turn_index)."""
    if "pos_in_turn" in df:  # annotated already (the page annotates the whole sequence, then shows a window)
        return df
    out = df.copy()
    if out.empty or "mask" not in out:
        out["turn"], out["pos_in_turn"] = -1, -1
        return out
    it = out["iteration"].to_numpy() if "iteration" in out else np.zeros(len(out), np.int64)
    new = np.ones(len(out), bool)
    new[1:] = it[1:] != it[:-1]
    rec = None
    if "turn" in out and out["turn"].notna().any():
        rec = out["turn"].fillna(-1).to_numpy(np.int64)
    turn, pit = TU.turn_index(new, out["mask"].fillna(False).to_numpy(bool), rec)
    out["turn"], out["pos_in_turn"] = turn, pit
    return out


def _segments(turn: np.ndarray, new_iteration: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each stretch of one turn (or of tokens outside the loss)."""
    cut = np.flatnonzero(np.concatenate([[True], (turn[1:] != turn[:-1]) | new_iteration[1:], [True]]))
    return list(zip(cut[:-1].tolist(), cut[1:].tolist(), strict=True))


def sequence_html(df: pd.DataFrame, quantity: str = "weight_k3_abs", focus_pos: int | None = None) -> str:
    """The Sequence page's text: pages.sequence_html per turn, each turn labelled at its boundary, tokens
    outside the loss (tool replies, the prompt) greyed. A sequence with fewer than two turns: as before."""
    a = annotate(df)
    if a.empty or int(a["turn"].max()) < 1:
        return V.sequence_html(df, quantity, focus_pos)
    it = a["iteration"].to_numpy() if "iteration" in a else np.zeros(len(a), np.int64)
    new = np.concatenate([[True], it[1:] != it[:-1]])
    blocks = []
    for lo, hi in _segments(a["turn"].to_numpy(), new):
        t = int(a["turn"].iat[lo])
        inner = V.sequence_html(df.iloc[lo:hi], quantity, focus_pos)
        label = f"turn {t}" if t >= 0 else "not trained (tool reply / prompt)"
        style = ("border-left: 3px solid #2563eb; padding-left: 6px; margin: 4px 0" if t >= 0
                 else f"border-left: 3px dashed #94a3b8; padding-left: 6px; margin: 4px 0; {TOOL_STYLE}")
        blocks.append(f'<div class="kldiag-turn" data-turn="{t}" style="{style}">'
                      f'<div style="font-size: 0.75em; color: #64748b">{html.escape(label)}</div>{inner}</div>')
    return '<div class="kldiag-turns">' + "".join(blocks) + "</div>"


def sequence_caption(df: pd.DataFrame) -> str:
    """' · 3 turns, 8 tokens outside the loss' for a multi-turn sequence, '' otherwise."""
    a = annotate(df)
    if a.empty or int(a["turn"].max()) < 1:
        return ""
    return f" · {int(a['turn'].max()) + 1} turns, {int((a['turn'] < 0).sum())} tokens outside the loss (greyed)"
