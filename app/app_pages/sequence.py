"""Sequence: one completion, each token coloured by a chosen quantity, values on hover."""

import dash_charts as C
import dash_controls as K
import dash_data as D
import numpy as np
import dash_groups
import streamlit as st

from kldiag.views import pages as V
from kldiag.views import turns as VT

WINDOW = 2000  # tokens rendered as text at once

run = D.page("Sequence")
seqs = run.sequences
if seqs.empty:
    st.info("This run has no sequences yet.")
    st.stop()

pick = st.session_state.pop("seq_pick", None)
if pick and pick.get("path") == run.path:  # opened from the Tokens page
    st.session_state["seq_step"], st.session_state["seq_seq"] = pick["step"], pick["seq"]
    st.session_state["seq_start"] = max(0, pick.get("pos", 0) - WINDOW // 4)
    st.session_state["seq_focus"] = (pick["step"], pick["seq"], pick["pos"]) if pick.get("focus") else None

steps = np.unique(seqs["step"].to_numpy()).tolist()
if st.session_state.get("seq_step") not in steps:
    worst = seqs.loc[seqs["weight_k3_abs_max"].fillna(-1).idxmax()]  # start on the worst sequence
    st.session_state["seq_step"], st.session_state["seq_seq"] = int(worst["step"]), int(worst["seq"])
c1, c2, c3 = st.columns([1, 2, 3])
step = c1.selectbox("Step", steps, key="seq_step")
in_step = seqs[seqs["step"] == step].sort_values("weight_k3_abs_max", ascending=False, na_position="last")
choices = in_step["seq"].astype(int).tolist()
if st.session_state.get("seq_seq") not in choices:
    st.session_state["seq_seq"] = choices[0]
worst_by_seq = dict(zip(choices, in_step["weight_k3_abs_max"], strict=True))
seq = c2.selectbox("Sequence (worst first)", choices, key="seq_seq",
                   format_func=lambda s: f"{s}  (max |k3 weight| {worst_by_seq[s]:.3g})")
quantity = c3.radio("Colour by", list(V.SEQUENCE_QUANTITIES), horizontal=True, key="seq_quantity",
                    format_func=lambda q: V.SEQUENCE_QUANTITIES[q])

df = D.sequence(run.path, int(step), int(seq), run.keys)
if df.empty:
    st.info(f"Sequence {seq} has no tokens at step {step} in the published parts.")
    st.stop()
df = VT.annotate(df)  # turn and pos_in_turn: a multi-turn sequence is shown turn by turn, tool spans greyed
row = in_step[in_step["seq"] == seq].iloc[0]
focus = st.session_state.get("seq_focus")
focus_pos = focus[2] if focus and focus[:2] == (int(step), int(seq)) else None
K.copy_link(K.publish(K.run_label(), step=int(step), seq=int(seq), pos=focus_pos))
st.caption(f"{len(df)} tokens · advantage {row['advantage']:.3g} · mean k3 {row['k3_mean']:.3g} · "
           f"mean k3_is {row['k3_is_mean']:.3g} · flagged tokens {int(row['flagged_count'])} · "
           "hover a token for its values; underlined tokens carry a flag" + VT.sequence_caption(df))
shown, start = df, st.session_state.pop("seq_start", 0)
if len(df) > WINDOW:  # bounded HTML: a long completion is shown a window at a time
    start = st.slider("First token shown", 0, len(df) - WINDOW, min(start, len(df) - WINDOW),
                      key="seq_window")
    shown = df.iloc[start:start + WINDOW]
st.html(VT.sequence_html(shown, quantity, focus_pos))
dash_groups.show(run, int(step), int(seq), quantity)

plot = df.reset_index(names="token")
x = "pos" if df["iteration"].nunique() == 1 else "token"  # reuse iterations repeat positions
st.plotly_chart(C.lines(plot, ["logp", "logp_old", "logp_ref", "logp_sampler"],
                        "Log-probs of the sampled tokens per position", x=x))
st.plotly_chart(C.lines(plot, ["weight_k3_abs", "weight_k3_is_abs"], "|gradient weight| per position",
                        log_y=True, x=x))
with st.expander("Tokens table"):
    st.dataframe(df, hide_index=True, width="stretch")
    K.downloads(df, f"sequence-{step}-{seq}", "seq_tokens")
