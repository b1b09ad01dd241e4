"""Compare: step curves of two or more runs on the same axes."""

import dash_charts as C
import dash_controls as K
import dash_data as D
import streamlit as st

from kldiag.views import pages as V

st.title("Compare runs")
paths = D.run_paths()
by_label = D.labels(paths)
if len(paths) < 2:
    st.info("Pass two or more runs to compare them: `kldiag dashboard RUN_A RUN_B`.")
chosen = st.multiselect("Runs", list(by_label), default=list(by_label), key="cmp_runs")
steps = {}
for label in chosen:
    with st.container():
        run = D.load(by_label[label])
    if run is not None:
        steps[label] = run.steps
if not steps:
    st.stop()
metrics = V.numeric_metrics(list(steps.values()))
default = metrics.index("k3_mean") if "k3_mean" in metrics else 0
c1, c2 = st.columns([3, 1])
metric = c1.selectbox("Metric", metrics, index=default, key="cmp_metric")
log_y = c2.toggle("Log y", metric.startswith(("weight_", "k3", "rho_max")), key="cmp_log")
long = V.compare_steps(steps, metric)
ctl = K.chart_controls("cmp", long["step"])
st.plotly_chart(C.compare(long, metric, log_y, ctl.smoothing, ctl.x_range))
K.downloads(long, f"compare-{metric}", "cmp_long")
