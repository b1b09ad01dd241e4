"""Estimators: what k1, k2, k3, k3_is and clamped k3 would have done on this run's tokens."""

import dash_charts as C
import dash_controls as K
import dash_data as D
import streamlit as st

from kldiag.views import charts as VC
from kldiag.views import estimators as VE
from kldiag.views import leads as VL
from kldiag.views import numbers as VN
from kldiag.views import opsm as VO

run = D.page("Estimators")
p = D.estimator_partial(run.path, run.keys)
if p.skipped:
    st.warning("Skipped unreadable parts: " + ", ".join(p.skipped))

if p.tokens:
    st.subheader("Values and gradient weights on this run's tokens")
    table = VE.estimator_table(p)
    st.dataframe(table, hide_index=True, width="stretch", column_order=VE.TABLE_ORDER, column_config={
        "expected gradient": st.column_config.TextColumn(width="medium"),
        "flagged share of |weight|": st.column_config.NumberColumn(
            "flagged share", format="%.3f", help="flagged tokens' share of the estimator's |weight|")})
    K.downloads(table, "estimators", "est_table")
    cs = VE.clamp_summary(p)
    flagged, tokens = VN.flagged_total(run.steps)  # the Overview's figure, from the same analysis
    c = st.columns(4)
    c[0].metric("Tokens in the loss", f"{cs['tokens']:,}")
    c[1].metric("Flagged", f"{flagged / tokens if tokens else 0.0:.3%}", help=f"{flagged:,} of {tokens:,} tokens, "
                "as on the Overview (docs/metrics.md)")
    c[2].metric("Clamp-saturated", f"{cs['clamp_saturated_frac']:.3%}", help="tokens with k3 > clamp")
    c[3].metric("|k3 weight| lost to clamp", f"{cs['k3_weight_lost_share']:.1%}",
                help="Share of |k3 weight| lost to the clamp: verl/OpenRLHF/ROLL/AReaL clamp the k3 value, so "
                     "these tokens get no KL gradient")
    st.plotly_chart(C.weight_scatter(p.sample, p.tokens))
else:
    st.info(VL.needs("Comparing the KL estimators on this run's tokens", "logp_ref"))

st.subheader("Off-policy sequence mask (DeepSeek-V3.2)")
st.caption("A sequence is masked when its advantage is negative and the mean over its tokens of "
           "log mu - log pi_theta exceeds delta (mu: the sampler's log-prob, else pi_old's).")
counts = run.analysis.opsm
if counts is None or not counts.sequences.sum():
    st.info("No sequences yet.")
    st.stop()
if not counts.known.sum():  # no advantages: the mask was not measured, never "0.00% masked"
    st.info(VL.needs("The off-policy sequence mask", "advantage"))
    st.stop()
delta = st.select_slider("delta", list(counts.deltas), value=1e-4, key="opsm_delta", format_func=lambda v: f"{v:g}")
masked, known = VO.summary(counts, delta)
st.metric(f"Sequences masked at delta = {delta:g}", f"{masked / known if known else 0.0:.2%}",
          help=f"{masked} of the {known} sequences with an advantage")
by_step = VO.by_step(counts, delta)
ctl = K.chart_controls("est", by_step["step"])  # above the charts it zooms
left, right = st.columns(2)
curve = VO.curve(counts)
fig = C.lines(curve, ["masked_frac"], "Masked fraction as delta slides", x="delta",
              y_title="share of sequences (0 to 1)", subtitle="over the run's sequences with an advantage")
VC.decade_ticks(fig, curve["delta"].to_numpy(), axis="x")
if delta > 0:
    fig.add_vline(x=delta, line_dash="dot")
left.plotly_chart(fig)
right.plotly_chart(C.lines(by_step, ["masked_frac"], "Masked fraction per step", smoothing=ctl.smoothing,
                           x_range=ctl.x_range, y_title="share of the step's sequences",
                           subtitle=f"at delta = {delta:g}"))
K.downloads(by_step, f"opsm-per-step-{delta:g}", "est_opsm")
