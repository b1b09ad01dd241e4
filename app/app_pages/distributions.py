"""Distributions: step x bin heatmaps and percentile bands from the per-step histograms."""

import dash_charts as C
import dash_controls as K
import dash_data as D
import streamlit as st

from kldiag.views import hists as H
from kldiag.views import leads as VL

METRICS = {  # name: (label, log y, axis title with unit)
    "d": ("d = log(pi_ref / pi_theta)", False, "d (nats)"),
    "weight_k3_abs": ("|k3 weight| = |1 - pi_ref/pi_theta|", True, "|k3 weight| (no unit)"),
    "weight_k3_is_abs": ("|k3_is weight| = |rho log(pi_theta/pi_ref)|", True, "|k3_is weight| (no unit)"),
    "rho": ("rho = pi_theta / pi_old", True, "rho (ratio)"),
}

run = D.page("Distributions")
hist = run.analysis.histograms
available, unmeasured = H.measured(hist, list(METRICS))  # open on a metric the run measured
if not available or len(hist.steps) == 0:
    st.info("This run has no histograms yet." if not unmeasured or len(hist.steps) == 0 else
            VL.needs("Every distribution here", "logp_ref"))
    st.stop()
if any(m in H.REF_METRICS for m in unmeasured):
    st.caption(VL.needs("The distributions of d and the gradient weights", "logp_ref", plural=True))
name = st.segmented_control("Metric", available, default=available[0], key="dist_metric",
                            format_func=lambda m: METRICS[m][0]) or available[0]
title, log_y, unit = METRICS[name]

hm = H.heatmap(hist, name)
if not hm["labels"]:
    st.info(f"No finite values of {title} in this run.")
    st.stop()
ctl = K.chart_controls("dist", hist.steps)
heat = C.heatmap(hm["steps"], hm["labels"], hm["z"], f"{title} per step", "share of each step's tokens per bin",
                 f"bin of {unit}")
if ctl.x_range is not None:
    heat.update_xaxes(range=list(ctl.x_range))
st.plotly_chart(heat)
bands = H.percentile_bands(hist, name)
if name == "rho":  # inside each step's observed range: a bin's interpolation passes it
    ends = run.steps.set_index("step").reindex(bands["step"])
    bands = H.clamp_to_range(bands, ends["rho_min"].to_numpy(), ends["rho_max"].to_numpy())
st.plotly_chart(C.bands(bands, f"{title}: percentiles", log_y, ctl.smoothing, ctl.x_range, y_title=unit,
                        subtitle="per step, read off the histograms"))
with st.expander("Percentiles table"):
    st.dataframe(bands, hide_index=True, width="stretch")
    K.downloads(bands, f"percentiles-{name}", "dist_bands")
