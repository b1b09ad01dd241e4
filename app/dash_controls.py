"""Page-level widgets every page shares: the chart controls (one smoothing control and one
step range per page, applied to all its step charts), table downloads, and deep links.
The computation lives in kldiag.views.dash; this module only places widgets."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import streamlit as st

from kldiag.views import dash as VD

SMOOTHING_HELP = ("Time-weighted exponential moving average, debiased at the start (as W&B and TensorBoard "
                  "draw it); the raw line stays faint behind. 0 shows the raw values.")
LINK_SEEN = "_link_seen"
NOTICES = "_link_notices"  # what a deep link asked for that does not exist, and where it went instead


@dataclass(frozen=True)
class ChartControls:
    """What the page's charts share: EMA weight in [0, 0.99] and the step range shown (None: all)."""

    smoothing: float = 0.0
    x_range: tuple[int, int] | None = None


def chart_controls(page: str, steps: np.ndarray | pd.Series) -> ChartControls:
    """One row of controls above a page's step charts: smoothing and the steps shown (zoom)."""
    s = np.asarray(steps)
    left, right = st.columns([1, 3])
    smoothing = left.slider("Smoothing", 0.0, 0.99, 0.0, 0.01, key=f"{page}_smoothing", help=SMOOTHING_HELP)
    x_range = None
    if s.size > 1 and int(s.min()) < int(s.max()):
        lo, hi = int(s.min()), int(s.max())
        chosen = right.slider("Steps shown (zooms every chart of the page)", lo, hi, (lo, hi), key=f"{page}_steps")
        x_range = None if tuple(chosen) == (lo, hi) else (int(chosen[0]), int(chosen[1]))
    return ChartControls(smoothing=float(smoothing), x_range=x_range)


def downloads(table, name: str, key: str) -> None:
    """CSV and Parquet download buttons for a table (a DataFrame, or a function that reads it: a long
    run's sequence table is read from disk only then). The bytes are made on click, in a thread of
    their own (a large table costs nothing until then); downloading does not rerun the page."""
    cols = st.columns([1, 1, 6])
    for col, fmt in zip(cols, VD.DOWNLOAD_FORMATS, strict=False):
        col.download_button(f"{fmt.upper()}", lambda f=fmt: VD.table_bytes(table() if callable(table) else table, f), file_name=f"{name}.{fmt}",
                            mime=VD.DOWNLOAD_FORMATS[fmt], key=f"{key}_{fmt}", on_click="ignore",
                            icon=":material/download:", help=f"Download {name} as {fmt.upper()}")


# ---- deep links ---------------------------------------------------------------------------


def restore(labels: dict[str, str]) -> None:
    """Apply the URL's query (run, step, seq, pos) once when it changes: the run picker's
    choice and, with step and seq, the sequence the Sequence page opens (at token pos)."""
    params = {k: st.query_params.get(k) for k in st.query_params}
    seen = st.session_state.get(LINK_SEEN)
    if not params or params == seen:
        return
    st.session_state[LINK_SEEN] = params
    link = VD.parse_link(params)
    run = link.get("run")
    if run in labels:
        st.session_state["run_label"] = run
    elif run is not None and labels:
        shown = chosen_label(labels) or next(iter(labels))
        notice(f"The link names a run `{run}` that this dashboard does not show: showing `{shown}` instead "
               f"(runs here: {', '.join(f'`{k}`' for k in labels)}).")
    if "steps" in params or "flags" in params:  # the Tokens page's filters
        st.session_state["tok_pick"] = {"steps": VD.parse_range(params.get("steps")),
                                        "flags": [f for f in (params.get("flags") or "").split(",") if f]}
    if "step" in link:  # the Sequence page checks that the step and sequence exist
        chosen = labels.get(run) if run in labels else labels.get(chosen_label(labels) or "")
        st.session_state["seq_pick"] = {"path": chosen, "step": link["step"], "seq": link.get("seq"),
                                        "pos": link.get("pos", 0), "focus": "pos" in link, "link": True}


def notice(text: str) -> None:
    """Queue a notice for the page that runs next (the deep link's target shows it at its top)."""
    st.session_state.setdefault(NOTICES, []).append(text)


def show_notices() -> None:
    """Show and clear the queued notices (every page's prelude calls this)."""
    for text in st.session_state.pop(NOTICES, []):
        st.warning(text, icon=":material/link_off:")


def restore_tokens(lo: int, hi: int) -> None:
    """The Tokens page's filters from a deep link (steps clamped to the run's), applied once."""
    pick = st.session_state.pop("tok_pick", None)
    if not pick:
        return
    if pick["steps"] is not None:
        a, b = pick["steps"]
        clamped = (min(max(a, lo), hi), min(max(b, lo), hi))
        if clamped != (a, b):
            notice(f"The link's steps {a}-{b} are outside the flagged tokens' steps {lo}-{hi}: showing "
                   f"{clamped[0]}-{clamped[1]}.")
        st.session_state["tok_steps"] = clamped
    known = [f for f in pick["flags"] if f in VD.FLAG_NAMES]
    if len(known) < len(pick["flags"]):
        notice(f"Unknown flags in the link ({', '.join(f for f in pick['flags'] if f not in known)}) are left out; "
               f"the flags are {', '.join(VD.FLAG_NAMES)}.")
    if known:
        st.session_state["tok_flags"] = known


def chosen_label(labels: dict[str, str]) -> str | None:
    """Of the runs' `labels` (dash_data.labels), the one the pages show: the sidebar's choice, else the first."""
    names = list(labels)
    chosen = st.session_state.get("run_label")
    return chosen if chosen in names else (names[0] if names else None)


def publish(run_label: str | None, **values: int | str | None) -> str:
    """Write the page's state into the URL (no rerun) and return the full link to it."""
    params = VD.link_params(run_label, **values)
    st.query_params.from_dict(params)
    st.session_state[LINK_SEEN] = dict(params)
    try:
        base = st.context.url or ""
    except AttributeError:  # older Streamlit: a relative link still works in the same app
        base = ""
    return VD.link_url(base, params)


def copy_link(url: str) -> None:
    """The link in a code box: its copy button puts it on the clipboard."""
    with st.expander("Link to this view", icon=":material/link:"):
        st.code(url, language=None)
        st.caption("Copy it with the button on the right; it opens this run, step, sequence and token.")
