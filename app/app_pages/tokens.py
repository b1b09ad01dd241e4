"""Tokens: the flagged tokens table; selecting a row opens its sequence. A run with top-k lists
(format v1.2) also shows the engine's and the trainer's distributions at a chosen token."""

import dash_controls as K
import dash_data as D
import streamlit as st

from kldiag import format as F
from kldiag.views import leads as VL
from kldiag.views import numbers as VN
from kldiag.views import pages as V
from kldiag.views import topk as VT

SHOWN = ["step", "seq", "pos", "rank", "piece", "logp", "logp_old", "logp_ref", "d", "rho",
         "k3", "k3_is", "weight_k3", "weight_k3_is", "weight_k3_abs", *V.FLAG_NAMES]
SORTS = ["weight_k3_abs", "weight_k3", "weight_k3_is", "d", "rho", "k3", "k3_is", "step", "seq"]



@st.cache_data(max_entries=16)
def _has_topk(path: str, keys: str) -> bool:
    return VT.has_topk(path)


@st.cache_data(max_entries=64)
def _lists(path: str, step: int, seq: int, pos: int, keys: str):
    return VT.token_lists(path, step, seq, pos, vocab=F.open_run(path).vocab())


def _fmt(v) -> str:
    return "n/a" if v is None else f"{v:.4g}"


def topk_section(run) -> None:
    """Both sides' top-k distributions at a chosen token; nothing for a run without top-k lists."""
    if not _has_topk(run.path, run.keys):
        return
    result, first = D.topk_summary(run.path, run.keys)
    st.subheader("Top-k distributions: engine vs trainer")
    if result is None or first is None:
        st.info("The run has top-k columns, but no token in the loss has a list.")
        return
    c = st.columns(4)
    c[0].metric("Tokens with both lists", f"{result['tokens_both']:,}")
    c[1].metric("KL(engine || trainer), mean", _fmt(result["kl_mean"]),
                help=f"bounds [{_fmt(result['lower_mean'])}, {_fmt(result['upper_mean'])}] (upper: no unlisted "
                     f"trainer log-prob below {result['logp_floor']})")
    c[2].metric("Top-1 agreement", _fmt(result["top1_agree"]))
    c[3].metric("Rank disagreement", _fmt(result["rank_disagree"]))
    offenders = VT.offenders_frame(result)
    other = "another token ..."
    labels = [VT.token_label(o) for o in offenders.to_dict("records")]
    pick = st.selectbox("Token (largest KL estimate first)", [*labels, other], key="topk_pick")
    if pick == other:
        cols = st.columns(3)
        at = {k: int(cols[i].number_input(k, value=first[k], step=1, key=f"topk_{k}"))
              for i, k in enumerate(("step", "seq", "pos"))}
    else:
        at = {k: int(offenders.iloc[labels.index(pick)][k]) for k in ("step", "seq", "pos")}
    lists = _lists(run.path, at["step"], at["seq"], at["pos"], run.keys)
    if lists.empty:
        st.info(f"No top-k list at step {at['step']}, seq {at['seq']}, pos {at['pos']}.")
        return
    st.plotly_chart(VT.distribution_figure(lists, f"step {at['step']}, seq {at['seq']}, pos {at['pos']}"),
                    key="topk_chart")
    st.caption("Bars: each side's listed probabilities; a dotted line: that side's smallest listed one, the "
               "most an id it did not list can have. KL figures and bounds: docs/metrics.md, \"topk\".")


def measured_section(run) -> None:
    """What a run without pi_ref can tell, first: why the flags are missing, then the tokens the engine routed to
    other experts and those with the largest engine mismatch."""
    st.info(VL.needs("The token flags (theta_ll_ref, weight_blowup, clamp_saturated) and the |k3 weight| ranking",
                     "logp_ref", plural=True) + " Non-finite and invalid log-probs are still flagged.")
    lists = D.mismatch_tokens(run.path, run.keys)
    if not lists["routed"].empty:
        st.subheader("Tokens routed to other experts by the engine")
        st.caption(f"{len(lists['routed']):,} shown, the largest |log pi_old/mu| first; the Mismatch page has the "
                   "share per layer.")
        st.dataframe(lists["routed"], hide_index=True, width="stretch", key="tok_routed")
    if not lists["largest"].empty:
        st.subheader("Tokens with the largest engine mismatch")
        st.caption("|log pi_old/mu| per token: the trainer's log-prob against the engine's.")
        st.dataframe(lists["largest"], hide_index=True, width="stretch", key="tok_mismatch")
    elif not run.present.get("logp_sampler", True):
        st.caption(VL.needs("The engine mismatch per token", "logp_sampler"))


run = D.page("Tokens: worst and flagged")
flags = run.flags
if not run.present.get("logp_ref", True):
    measured_section(run)
if flags.empty:
    if VL.all_clear_allowed(D.diagnosis(run)) and run.present.get("logp_ref", True):
        st.success("No token was flagged in this run.")  # green only beside a healthy verdict
    elif run.present.get("logp_ref", True):
        st.info("No token carries a flag; the verdict's causes (Overview) are read from other figures.")
    topk_section(run)
    st.stop()
if not run.present.get("logp_ref", True):
    st.subheader("Non-finite and invalid log-probs")

lo, hi = int(flags["step"].min()), int(flags["step"].max())
K.restore_tokens(lo, hi)  # a deep link's step range and flags, applied once
K.show_notices()
c1, c2, c3, c4 = st.columns([3, 3, 2, 2])
step_range = c1.slider("Steps", lo, hi, (lo, hi), key="tok_steps") if hi > lo else (lo, hi)
kinds = c2.multiselect("Carrying any of the flags", list(V.FLAG_NAMES), key="tok_flags")
threshold = c3.number_input("Min |k3 weight|", 0.0, value=0.0, key="tok_threshold")
sort_by = c4.selectbox("Sort by", SORTS, key="tok_sort")
descending = c4.toggle("Descending", True, key="tok_desc")

table = V.filter_flags(flags, step_range, kinds, threshold, sort_by, descending)
st.caption(VN.flags_caption(flags, len(table), run.steps) + " Select a row to open its sequence.")
K.downloads(table, "flags", "tok_flags_dl")
K.copy_link(K.publish(D.run_label(), steps=f"{step_range[0]}-{step_range[1]}", flags=",".join(kinds) or None))
event = st.dataframe(table[[c for c in SHOWN if c in table.columns]], hide_index=True, width="stretch",
                     on_select="rerun", selection_mode="single-row", key="tok_table")
rows = event.selection.rows if event is not None else []
if rows:
    picked = table.iloc[rows[0]]
    st.session_state["seq_pick"] = {"path": run.path, "step": int(picked["step"]), "seq": int(picked["seq"]),
                                    "pos": int(picked["pos"]), "focus": True}
    st.switch_page("app_pages/sequence.py")

topk_section(run)
