"""Overview: the verdict and its causes (onset, fix), headline figures, alert episodes, and step
trends with the causes' onsets marked."""

import dash_charts as C
import dash_controls as K
import dash_data as D
import streamlit as st

from kldiag.views import pages as V
from kldiag.views import diagnosis as DV

SEQUENCES_SHOWN = 1000

run = D.page("Overview")
if run.analysis.skipped:
    st.warning("Skipped unreadable parts: " + ", ".join(run.analysis.skipped))

dg = D.diagnosis(run)
st.markdown(DV.headline(dg))
for cause in dg.causes:
    onset = f" · onset step {cause.onset}" if cause.onset is not None else ""
    with st.expander(f"{cause.cause} ({cause.severity}{onset})", expanded=cause.severity != "info"):
        st.markdown(DV.md(cause.summary))
        st.markdown(f"**Fix:** {DV.md(cause.fix)}")
        st.json(cause.to_dict()["evidence"], expanded=False)

h = V.headline(run.steps)
row1, row2 = st.columns(4), st.columns(4)
row1[0].metric("Steps", f"{h['steps']:,}", help=f"last step {h.get('last_step', '-')}")
row1[1].metric("Tokens", f"{h['tokens']:,}")
if h["steps"]:
    row1[2].metric("Latest k3 mean", f"{h['k3_mean']:.3g}")
    row1[3].metric("Latest k3_is mean", f"{h['k3_is_mean']:.3g}")
    row2[0].metric("Max |k3 weight|", f"{h['weight_k3_abs_max']:.3g}")
    row2[1].metric("Max |k3_is weight|", f"{h['weight_k3_is_abs_max']:.3g}")
    row2[2].metric("Flagged tokens", f"{h['flagged_frac']:.3%}")
    row2[3].metric("Alert episodes", f"{len(run.alerts)}")

onsets = DV.cause_onsets(dg) or V.onset_steps(run.alerts)
st.subheader("Alerts (episodes)")
if run.alerts.empty:
    st.success("No alerts: every metric stayed within its recent range.")
else:
    st.dataframe(run.alerts, hide_index=True, width="stretch")
    K.downloads(run.alerts, "alerts", "ov_alerts")

st.subheader("Step trends")
s = run.steps
ctl = K.chart_controls("ov", s["step"])
kw = {"smoothing": ctl.smoothing, "x_range": ctl.x_range}
left, right = st.columns(2)
left.plotly_chart(C.lines(s, ["k3_mean", "k3_is_mean"], "KL estimate per step: k3 vs k3_is", True, onsets, **kw))
right.plotly_chart(C.lines(s, ["weight_k3_abs_max", "weight_k3_abs_p99", "weight_k3_is_abs_max",
                               "weight_k3_is_abs_p99"], "|gradient weight|: max and p99", True, onsets, **kw))
left, right = st.columns(2)
left.plotly_chart(C.lines(s, ["theta_ll_ref_count", "weight_blowup_count", "clamp_saturated_count",
                              "nonfinite_count", "invalid_count"], "Flagged tokens per step", False, onsets, **kw))
right.plotly_chart(C.lines(s, ["blame_share", "flagged_frac"],
                           "Blame share: flagged tokens' share of |k3 weight|", False, onsets, **kw))
left, right = st.columns(2)
left.plotly_chart(C.lines(s, ["rho_min", "rho_mean", "rho_max"], "rho = pi_theta / pi_old", True, onsets, **kw))
right.plotly_chart(C.lines(s, ["rho_clip_frac", "drift_abs_mean", "mismatch_kl", "opsm_masked_frac"],
                           "Off-policy drift and sampler mismatch", False, onsets, **kw))
with st.expander("Steps table"):
    st.dataframe(s, hide_index=True, width="stretch")
    K.downloads(s, "steps", "ov_steps")
with st.expander("Sequences table"):
    worst = run.sequences.nlargest(SEQUENCES_SHOWN, "weight_k3_abs_max")
    st.caption(f"The {len(worst):,} sequences with the largest |k3 weight| of {len(run.sequences):,}; "
               "the downloads hold every one.")
    st.dataframe(worst, hide_index=True, width="stretch")
    K.downloads(run.sequences, "sequences", "ov_sequences")
