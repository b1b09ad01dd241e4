"""Distributions: step x bin heatmaps and percentile bands from the per-step histograms."""

import dash_charts as C
import dash_controls as K
import dash_data as D
import streamlit as st

from kldiag.views import pages as V

METRICS = {
    "d": ("d = log(pi_ref / pi_theta)", False),
    "weight_k3_abs": ("|k3 weight| = |1 - pi_ref/pi_theta|", True),
    "weight_k3_is_abs": ("|k3_is weight| = |rho log(pi_theta/pi_ref)|", True),
    "rho": ("rho = pi_theta / pi_old", True),
}

run = D.page("Distributions")
hist = run.analysis.histograms
available = [m for m in METRICS if m in hist.counts]
if not available or len(hist.steps) == 0:
    st.info("This run has no histograms yet.")
    st.stop()
name = st.segmented_control("Metric", available, default=available[0], key="dist_metric",
                            format_func=lambda m: METRICS[m][0]) or available[0]
title, log_y = METRICS[name]

hm = V.heatmap(hist, name)
if not hm["labels"]:
    st.info(f"No finite values of {title} in this run.")
    st.stop()
ctl = K.chart_controls("dist", hist.steps)
heat = C.heatmap(hm["steps"], hm["labels"], hm["z"], f"{title}: share of each step's tokens per bin")
if ctl.x_range is not None:
    heat.update_xaxes(range=list(ctl.x_range))
st.plotly_chart(heat)
bands = V.percentile_bands(hist, name)
st.plotly_chart(C.bands(bands, f"{title}: percentiles per step (from the histograms)", log_y, ctl.smoothing,
                        ctl.x_range))
with st.expander("Percentiles table"):
    st.dataframe(bands, hide_index=True, width="stretch")
    K.downloads(bands, f"percentiles-{name}", "dist_bands")
