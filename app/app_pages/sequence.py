"""Sequence: one completion, each token coloured by a chosen quantity, values on hover."""

import dash_charts as C
import dash_controls as K
import dash_data as D
import dash_groups
import streamlit as st

from kldiag.views import leads as VL
from kldiag.views import numbers as VN
from kldiag.views import pages as V
from kldiag.views import sequences as VS
from kldiag.views import turns as VT

WINDOW = 2000  # tokens rendered as text at once

run = D.page("Sequence")
steps = D.sequence_steps(run.path, run.keys)  # a long run's sequence rows stay on disk: read a step at a time
if not steps:
    st.info("This run has no sequences yet.")
    st.stop()

pick = st.session_state.pop("seq_pick", None)
if pick and pick.get("path") == run.path:  # a deep link, or a row of the Tokens page
    step_ok = pick["step"] in steps
    at_pick = VN.fault_first(D.step_sequences(run.path, run.keys, int(pick["step"]))) if step_ok else None
    seq_ok = step_ok and (pick["seq"] is None or pick["seq"] in at_pick["seq"].astype(int).tolist())
    if step_ok and seq_ok:
        first = int(at_pick["seq"].iloc[0])
        st.session_state["seq_step"] = pick["step"]
        st.session_state["seq_seq"] = first if pick["seq"] is None else pick["seq"]
        st.session_state["seq_start"] = max(0, pick.get("pos", 0) - WINDOW // 4)
        st.session_state["seq_focus"] = (pick["step"], pick["seq"], pick["pos"]) if pick.get("focus") else None
    else:
        top_step, top_seq = D.first_sequence(run.path, run.keys)
        asked = f"sequence {pick['seq']} at step {pick['step']}" if pick["seq"] is not None else f"step {pick['step']}"
        why = f"the run has no step {pick['step']} (steps {steps[0]}-{steps[-1]})" if not step_ok else \
            f"step {pick['step']} has no sequence {pick['seq']}"
        K.notice(f"The link asks for {asked}, but {why}: showing the worst sequence instead, "
                 f"{top_seq} at step {top_step}.")
        st.session_state["seq_step"], st.session_state["seq_seq"] = top_step, top_seq
        st.session_state["seq_focus"] = None
    K.show_notices()

if st.session_state.get("seq_step") not in steps:  # start on a faulty sequence, else the worst
    start = D.first_sequence(run.path, run.keys)
    if not run.present.get("logp_ref", True):  # no |k3 weight| to rank by: a token routed differently, or mismatched
        start = VL.first_measured(D.mismatch_tokens(run.path, run.keys)) or start
    st.session_state["seq_step"], st.session_state["seq_seq"] = start
c1, c2, c3 = st.columns([1, 2, 3])
step = c1.selectbox("Step", steps, key="seq_step")
in_step = VN.fault_first(D.step_sequences(run.path, run.keys, int(step)))  # faults, then the largest |k3 weight|
choices = in_step["seq"].astype(int).tolist()
if st.session_state.get("seq_seq") not in choices:
    st.session_state["seq_seq"] = choices[0]
label_of = {int(r.seq): VS.choice_label(r) for r in in_step.itertuples()}
seq = c2.selectbox("Sequence (faults, then worst first)", choices, key="seq_seq", format_func=label_of.get)

df = D.sequence(run.path, int(step), int(seq), run.keys)
if df.empty:
    st.info(f"Sequence {seq} has no tokens at step {step} in the published parts.")
    st.stop()
quantities = V.measured_quantities(df) or list(V.SEQUENCE_QUANTITIES)  # d and weights need logp_ref
if st.session_state.get("seq_quantity") not in quantities:
    st.session_state["seq_quantity"] = quantities[0]
quantity = c3.radio("Colour by", quantities, horizontal=True, key="seq_quantity",
                    format_func=lambda q: V.SEQUENCE_QUANTITIES[q])
df = VT.annotate(df)  # turn and pos_in_turn: a multi-turn sequence is shown turn by turn, tool spans greyed
row = in_step[in_step["seq"] == seq].iloc[0]
focus = st.session_state.get("seq_focus")
focus_pos = focus[2] if focus and focus[:2] == (int(step), int(seq)) else None
K.copy_link(K.publish(D.run_label(), step=int(step), seq=int(seq), pos=focus_pos))
st.caption(VS.caption(df, row) + VT.sequence_caption(df))
shown, start = df, st.session_state.pop("seq_start", 0)
if len(df) > WINDOW:  # bounded HTML: a long completion is shown a window at a time
    start = st.slider("First token shown", 0, len(df) - WINDOW, min(start, len(df) - WINDOW),
                      key="seq_window")
    shown = df.iloc[start:start + WINDOW]
st.html(VT.sequence_html(shown, quantity, focus_pos))
st.html(V.colour_scale_html(quantity, routed=VS.routed_count(df) > 0))  # what the colours mean
dash_groups.show(run, int(step), int(seq), quantity)

plot = df.reset_index(names="token")
x = "pos" if df["iteration"].nunique() == 1 else "token"  # reuse iterations repeat positions
st.plotly_chart(C.lines(plot, VS.drawn(plot, ["logp", "logp_old", "logp_ref", "logp_sampler"]),
                        "Log-probs per position", x=x, y_title="log-prob (nats)", subtitle="of the sampled tokens",
                        legend_per_row=4))  # only the log-probs the run recorded: no legend of an empty line
weights = VS.drawn(plot, ["weight_k3_abs", "weight_k3_is_abs"])
if weights:
    st.plotly_chart(C.lines(plot, weights, "|gradient weight| per position", log_y=True, x=x,
                            y_title="|weight| (no unit)", legend_per_row=4))
else:
    st.caption(VL.needs("The |gradient weight| per position", "logp_ref"))
with st.expander("Tokens table"):
    st.dataframe(df, hide_index=True, width="stretch")
    K.downloads(df, f"sequence-{step}-{seq}", "seq_tokens")
