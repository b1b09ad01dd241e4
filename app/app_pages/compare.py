"""Compare: step curves of two or more runs on the same axes, each run's verdict above them. By
default each run shows its own loss weight (the |weight| of the estimator its manifest names)."""

import dash_charts as C
import dash_controls as K
import dash_data as D
import streamlit as st

from kldiag.format import read_manifest
from kldiag.views import diagnosis as DV
from kldiag.views import numbers as VN
from kldiag.views import pages as V

OWN = {"max": "Each run's own loss weight: max |weight| per step",
       "p99": "Each run's own loss weight: p99 |weight| per step"}

st.title("Compare runs")
paths = D.run_paths()
by_label = D.labels(paths)
if len(paths) < 2:
    st.info("Pass two or more runs to compare them: `kldiag dashboard RUN_A RUN_B`.")
chosen = st.multiselect("Runs", list(by_label), default=list(by_label), key="cmp_runs")
runs = {}
for label in chosen:
    with st.container():
        run = D.load(by_label[label])
    if run is not None:
        runs[label] = run
if not runs:
    st.stop()
steps = {label: run.steps for label, run in runs.items()}
estimators = {label: VN.loss_weight_column(read_manifest(run.path).config)[1] for label, run in runs.items()}
for col, (label, run) in zip(st.columns(min(len(runs), 4)), runs.items(), strict=False):
    verdict = D.diagnosis(run).verdict
    col.markdown(f"**{label}**  \n:{DV.COLOR[verdict]}[**{verdict.upper()}**]")  # the Overview's colours
    col.caption(VN.loss_caption(read_manifest(run.path).config))

# the metrics some run measured (a run without logp_ref has no weights: Compare opens on what it has)
metrics = VN.measured_metrics(list(steps.values()), V.numeric_metrics(list(steps.values())))
own = [m for m in OWN if any(c in metrics for c in (VN.loss_weight_column(read_manifest(r.path).config, m)[0]
                                                      for r in runs.values()))]
if not (own or metrics):
    st.info("No step metric holds a value in these runs yet.")
    st.stop()
c1, c2 = st.columns([3, 1])
metric = c1.selectbox("Metric", [*own, *metrics], key="cmp_metric",
                      format_func=lambda m: OWN.get(m) or VN.metric_label(m))
log_y = c2.toggle("Log y", metric in OWN or metric.startswith(("weight_", "k3", "rho_max")), key="cmp_log")
if metric in OWN:
    columns = {label: VN.loss_weight_column(read_manifest(run.path).config, metric)[0] for label, run in runs.items()}
    long = VN.compare_own(steps, columns)
    title, y_title = f"Loss weight per step ({metric})", "|weight| (per token, no unit)"
    subtitle = "each run's own estimator: " + ", ".join(f"{k} {estimators[k]}" for k in runs)
else:
    long = V.compare_steps(steps, metric)
    title, y_title, subtitle = f"{VN.metric_label(metric)} per step", VN.metric_axis(metric), ""
ctl = K.chart_controls("cmp", long["step"])
st.plotly_chart(C.compare(long, title, y_title, log_y, ctl.smoothing, ctl.x_range, subtitle=subtitle))
K.downloads(long, f"compare-{metric}", "cmp_long")
