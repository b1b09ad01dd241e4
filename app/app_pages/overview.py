"""Overview: the verdict and its causes (onset, fix), headline figures, alert episodes, and step
trends with the causes' onsets marked."""

import dash_controls as K
import dash_data as D
import streamlit as st

from kldiag.views import charts as VC
from kldiag.views import diagnosis as DV
from kldiag.views import leads as VL
from kldiag.views import numbers as VN
from kldiag.views import pages as V
from kldiag.views import routing as VR
from kldiag.views import sequences as VS
from kldiag.views import tasks as VK

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
        st.caption("Evidence (the figures behind this cause):")
        st.json(cause.to_dict()["evidence"], expanded=False)

h = V.headline(run.steps)
row1, row2 = st.columns(4), st.columns(4)
row1[0].metric("Steps", f"{h['steps']:,}", help=f"last step {h.get('last_step', '-')}")
row1[1].metric("Tokens", f"{h['tokens']:,}")
if h["steps"]:
    routing = VR.view_of(run.analysis).summary  # MoE routes, read with the analysis
    tiles = VL.overview_tiles(h, run.steps, routing)  # what the run measured: never a nan tile
    for column, (label, value, hint) in zip([row1[2], row1[3], row2[0], row2[1]], tiles[:4], strict=True):
        column.metric(label, value, help=hint or None)
    label, value, hint = tiles[4]
    flagged, tokens = VN.flagged_total(run.steps)
    if value == "n/a":
        row2[2].metric(label, value, help=hint)
        row2[2].caption("needs logp_ref")
    else:
        row2[2].metric(label, value, help=f"{flagged:,} of {tokens:,} tokens in the loss carry a flag "
                       "(docs/metrics.md); the Tokens and Estimators pages show the same count")
        row2[2].caption(f"{flagged:,} tokens")
    row2[3].metric("Alert episodes", f"{len(run.alerts)}")

onsets = VC.trend_onsets(dg)
st.subheader("Alerts (episodes)")
if run.alerts.empty and VL.all_clear_allowed(dg):
    st.success("No alerts: every metric stayed within its recent range.")
elif run.alerts.empty:
    st.info("No alert episode: every metric it watches stayed within its recent range (the verdict's causes above "
            "are read from the whole run).")
else:
    st.dataframe(DV.alerts_frame(run.alerts), hide_index=True, width="stretch",
                 column_config={"message": st.column_config.TextColumn("message", width="large")})
    K.downloads(run.alerts, "alerts", "ov_alerts")

with st.expander("What this run recorded"):  # the coverage table: what every figure below can read
    st.dataframe(VL.coverage_frame(D.coverage(run.path, run.keys)), hide_index=True, width="stretch",
                 column_config={"how to record": st.column_config.TextColumn(width="large")})

st.subheader("Step trends")
tasks = VK.choices(run.analysis)  # format v1.3 task labels: the trends of one task
s = VK.overview_steps(run.analysis, run.steps, st.selectbox("Task", tasks, key="ov_task") if tasks else None)
ctl = K.chart_controls("ov", s["step"])
kw = {"smoothing": ctl.smoothing, "x_range": ctl.x_range}
trends = VC.step_trends(s, onsets, **kw)  # the same charts as kldiag report's "Per step", those measured
for gap in VC.trend_gaps(s):
    st.caption(gap)
for i in range(0, len(trends), 2):
    for column, fig in zip(st.columns(2), trends[i:i + 2], strict=False):  # an odd last one: left
        column.plotly_chart(fig)
with st.expander("Steps table"):
    st.dataframe(s, hide_index=True, width="stretch")
    K.downloads(s, "steps", "ov_steps")
with st.expander("Sequences table"):
    worst = D.worst_sequences(run.path, run.keys, SEQUENCES_SHOWN)  # only their row groups read
    st.caption(f"The {len(worst):,} sequences with the largest |k3 weight| of {VS.count(run.analysis):,}; "
               "the downloads hold every one.")
    st.dataframe(worst, hide_index=True, width="stretch")
    K.downloads(lambda: run.analysis.sequences, "sequences", "ov_sequences")  # read whole on click only
