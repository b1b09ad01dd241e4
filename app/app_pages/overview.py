"""Overview: the verdict and its causes (onset, fix), headline figures, alert episodes, and step
trends with the causes' onsets marked."""

import dash_controls as K
import dash_data as D
import streamlit as st

from kldiag.views import charts as VC
from kldiag.views import diagnosis as DV
from kldiag.views import numbers as VN
from kldiag.views import pages as V
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
    flagged, tokens = VN.flagged_total(run.steps)
    row2[2].metric("Flagged tokens", f"{h['flagged_frac']:.3%}", help=f"{flagged:,} of {tokens:,} tokens in the "
                   "loss carry a flag (docs/metrics.md); the Tokens and Estimators pages show the same count")
    row2[2].caption(f"{flagged:,} tokens")
    row2[3].metric("Alert episodes", f"{len(run.alerts)}")

onsets = VC.trend_onsets(dg)
st.subheader("Alerts (episodes)")
if run.alerts.empty:
    st.success("No alerts: every metric stayed within its recent range.")
else:
    st.dataframe(run.alerts, hide_index=True, width="stretch")
    K.downloads(run.alerts, "alerts", "ov_alerts")

st.subheader("Step trends")
tasks = VK.choices(run.analysis)  # format v1.3 task labels: the trends of one task
s = VK.overview_steps(run.analysis, run.steps, st.selectbox("Task", tasks, key="ov_task") if tasks else None)
ctl = K.chart_controls("ov", s["step"])
kw = {"smoothing": ctl.smoothing, "x_range": ctl.x_range}
trends = VC.step_trends(s, onsets, **kw)  # the same charts as kldiag report's "Per step"
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
