"""Tokens: the flagged tokens table; selecting a row opens its sequence."""

import dash_controls as K
import dash_data as D
import streamlit as st

from kldiag.views import pages as V

SHOWN = ["step", "seq", "pos", "rank", "piece", "logp", "logp_old", "logp_ref", "d", "rho",
         "k3", "k3_is", "weight_k3", "weight_k3_is", "weight_k3_abs", *V.FLAG_NAMES]
SORTS = ["weight_k3_abs", "weight_k3", "weight_k3_is", "d", "rho", "k3", "k3_is", "step", "seq"]

run = D.page("Tokens: worst and flagged")
flags = run.flags
if flags.empty:
    st.success("No token was flagged in this run.")
    st.stop()

lo, hi = int(flags["step"].min()), int(flags["step"].max())
K.restore_tokens(lo, hi)  # a deep link's step range and flags, applied once
c1, c2, c3, c4 = st.columns([3, 3, 2, 2])
step_range = c1.slider("Steps", lo, hi, (lo, hi), key="tok_steps") if hi > lo else (lo, hi)
kinds = c2.multiselect("Carrying any of the flags", list(V.FLAG_NAMES), key="tok_flags")
threshold = c3.number_input("Min |k3 weight|", 0.0, value=0.0, key="tok_threshold")
sort_by = c4.selectbox("Sort by", SORTS, key="tok_sort")
descending = c4.toggle("Descending", True, key="tok_desc")

table = V.filter_flags(flags, step_range, kinds, threshold, sort_by, descending)
st.caption(f"{len(table):,} of {len(flags):,} flagged tokens (the analysis keeps the worst by |k3 weight| "
           "and every non-finite one). Select a row to open its sequence.")
K.downloads(table, "flags", "tok_flags_dl")
K.copy_link(K.publish(K.run_label(), steps=f"{step_range[0]}-{step_range[1]}", flags=",".join(kinds) or None))
event = st.dataframe(table[[c for c in SHOWN if c in table.columns]], hide_index=True, width="stretch",
                     on_select="rerun", selection_mode="single-row", key="tok_table")
rows = event.selection.rows if event is not None else []
if rows:
    picked = table.iloc[rows[0]]
    st.session_state["seq_pick"] = {"path": run.path, "step": int(picked["step"]), "seq": int(picked["seq"]),
                                    "pos": int(picked["pos"]), "focus": True}
    st.switch_page("app_pages/sequence.py")
