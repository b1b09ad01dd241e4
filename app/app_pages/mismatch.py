"""Mismatch: the inference engine (mu) against the trainer (pi_old), policy drift against engine
mismatch, what corrections would have done, and the run's framework's own metrics."""

import dash_data as D
import streamlit as st

from kldiag.crosswalk import FRAMEWORKS
from kldiag.format import read_manifest
from kldiag.mismatch import corrections as CR
from kldiag.mismatch import whatif as W
from kldiag.views import audit as VA
from kldiag.views import charts as VC
from kldiag.views import leads as VL
from kldiag.views import mismatch as VM
from kldiag.views import routing as VR
from kldiag.views import tasks as VK
from kldiag.views import turns as VT


@st.cache_data(max_entries=64)
def _whatif(path: str, keys: str, method: str, convention: str, params: tuple):
    return VM.whatif_frame(D.mismatch_view(path, keys), W.WhatIf(method, convention, **dict(params)))


@st.cache_data(max_entries=16, show_spinner="Computing the framework's metrics ...")
def _crosswalk(path: str, keys: str, framework: str):
    return VM.crosswalk_frame(D.analysis_of(path, keys), framework)


lines = VC.binned_lines
SHARE = "share (0 to 1)"
# Below the fold, each in an expander whose body runs only once opened (on_change="rerun": opening it reruns the
# page): the first render replays no correction and recomputes no framework's metrics (about 0.4 s each at 300M rows)
WHATIF_TITLE = "What if: corrections replayed on these tokens"
CROSSWALK_TITLE = "The framework's own metrics (crosswalk)"


def parity_section(run: D.Loaded, view: VM.MismatchView) -> None:
    """Engine vs trainer: the parity figures, the verdict's engine causes, drift against mismatch."""
    st.subheader("Engine vs trainer parity")
    if not view.has_sampler:
        st.info("This run has no sampler log-probs (logp_sampler is null): the engine's mu is unknown, so there is "
                "no mismatch to decompose. Record the inference engine's log-probs to see this page.")
        return
    cols = st.columns(4)
    for c, (label, value, hint) in zip(cols, VM.parity_rows(view), strict=False):
        c.metric(label, value, help=hint)
    dg = D.diagnosis(run)
    for line in VM.parity_findings(dg):  # the verdict's engine causes
        st.warning(line)
    note = VL.parity_note(dg)  # green only beside a healthy verdict
    if note is not None:
        {"success": st.success, "warning": st.warning, "info": st.info}[note[0]](note[1])

    st.subheader("Drift against mismatch: mean |log-ratio| per token")
    st.caption("log(pi_theta/mu) = log(pi_theta/pi_old) + log(pi_old/mu): mean absolute value of each term per step, "
               "in nats per token (the Overview's chart plots KL(mu||pi_old), a smaller figure).")
    tasks = VK.choices(run.analysis)  # format v1.3 task labels: one task's drift and mismatch
    task = st.selectbox("Task", tasks, key="mm_task") if tasks else None
    st.plotly_chart(VC.drift_vs_mismatch(VK.mismatch_by_step(run.analysis, view.by_step, task)))
    left, right = st.columns(2)
    left.plotly_chart(VC.mismatch_by_prob(view.by_prob))
    left.caption("The low-probability-token pitfall (\"When Speed Kills Stability\"): tokens mu found unlikely "
                 "carry the largest mismatch.")
    pos = VM.at_centre(view.by_pos, "position")
    right.plotly_chart(lines(pos, "position", ["mismatch_abs", "drift_abs"], "By position in the completion",
                             log_x=bool(pos["position"].max() > 16), names=VC.MISMATCH_NAMES,
                             subtitle="mean over the tokens at that position"))
    if view.by_entropy is not None:
        ent = view.by_entropy.assign(entropy=(view.by_entropy["lo"] + view.by_entropy["hi"]) / 2)
        st.plotly_chart(lines(ent, "entropy", ["mismatch_abs", "drift_abs"], "By token entropy",
                              names=VC.MISMATCH_NAMES, subtitle="mean over the tokens in each entropy bin"))

def turns_section(run: D.Loaded) -> None:
    """Agentic runs: in which turn, and where in it, the engine and the trainer disagree."""
    turns = VT.view_of(D.analysis_of(run.path, run.keys))  # per-turn figures, read with the analysis
    if not turns.multi_turn:
        return
    st.subheader("Engine mismatch by turn")
    left, right = st.columns(2)
    left.plotly_chart(VT.mismatch_by_step(turns))
    right.plotly_chart(VT.start_vs_body(turns))
    st.dataframe(VT.table(turns), hide_index=True, width="stretch")


def routing_section(run: D.Loaded) -> None:
    """MoE runs: which layers the engine routes differently, and whether the mismatch sits on those tokens."""
    routing = VR.view_of(D.analysis_of(run.path, run.keys))  # MoE routes, read with the analysis
    if not routing.routed:
        return
    st.subheader("MoE routing: engine vs trainer experts")
    for c in VL.routing_causes(D.diagnosis(run)):  # the verdict's own finding first: layer, replay, limit
        (st.error if c.severity == "critical" else st.warning)(f"**{c.cause}**: {c.summary}")
    if not routing.compared:
        st.info(VR.headline(routing))
        return
    st.markdown(VR.headline(routing))
    left, right = st.columns(2)
    left.plotly_chart(VR.agreement_by_layer(routing))
    right.plotly_chart(VR.mismatch_by_side(routing))
    st.plotly_chart(VR.agreement_by_step(routing))
    st.dataframe(VR.table(routing), hide_index=True, width="stretch")


WHATIF_NAMES = {"tis_token": "token TIS (cap C)", "tis_seq": "sequence TIS (cap C)",
                "icepop": "IcePop / MIS (band [a, b])", "geo_rs": "geometric-mean sequence rejection [a, b]",
                "seq_mask_tis": "seq-mask-TIS ([a, b], cap C)", "opsm": "DeepSeek off-policy sequence mask (delta)",
                # issue 46: the 2026 corrections (kldiag/mismatch/corrections.py)
                "dppo_tv": "DPPO Binary-TV trust region (delta)", "dppo_kl": "DPPO Binary-KL trust region (delta)",
                "m2po": "M2PO second-moment mask (tau)", "seq_error": "sequence log-prob-error rejection (NeMo-RL)",
                "any_token": "any-token outlier rejection (SkyRL)"}


def _new_params(method: str) -> dict:
    """The thresholds of the 2026 corrections (defaults: WhatIf's, from each framework)."""
    if method == "dppo_tv":
        return {"tv_delta": st.slider("delta (|pi - b| in probability)", 0.01, 0.5, 0.2, 0.01, key="wi_tv")}
    if method == "dppo_kl":
        return {"kl_delta": st.select_slider("delta (binary KL)", [0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2], 0.05,
                                             key="wi_kl")}
    if method == "m2po":
        return {"tau": st.select_slider("tau (mean (log r)^2)", [0.005, 0.01, 0.02, 0.04, 0.08, 0.16], 0.04,
                                        key="wi_tau")}
    if method == "seq_error":
        return {"error_threshold": st.slider("threshold (mean exp|log r|)", 1.01, 5.0, 2.0, 0.01, key="wi_err")}
    if method == "any_token":
        lo = st.select_slider("low", [1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.1], 1e-4, key="wi_out_lo",
                              format_func=lambda v: f"{v:g}")
        hi = st.select_slider("high", [2.0, 5.0, 10.0, 100.0, 1000.0], 100.0, key="wi_out_hi")
        return {"outlier_low": lo, "outlier_high": hi}
    return {}


def whatif_section(run: D.Loaded, view: VM.MismatchView) -> None:
    """A correction replayed on the run's tokens: what it masks or clips, and the policy-gradient mass it removes."""
    with st.expander(WHATIF_TITLE, key="mm_whatif", on_change="rerun") as box:
        if box.open:
            whatif_body(run, view)


def whatif_body(run: D.Loaded, view: VM.MismatchView) -> None:
    """The what-if's controls, totals and per-step charts (inside its expander, once opened)."""
    c1, c2 = st.columns(2)
    method = c1.selectbox("Correction", W.METHODS, key="wi_method", format_func=WHATIF_NAMES.get)
    convention = c2.radio("\"old\" is", W.CONVENTIONS, horizontal=True, key="wi_conv",
                          index=0 if not view.has_sampler else 1,
                          format_func=lambda c: "the trainer's pi_old" if c == "trainer" else "the sampler's mu")
    if convention == "sampler" and not view.has_sampler:
        st.info("No sampler log-probs in this run: use the trainer's pi_old.")
        return
    params = {}
    if method in ("tis_token", "tis_seq", "seq_mask_tis"):
        params["cap"] = st.slider("cap C", 1.0, 10.0, 2.0, 0.1, key="wi_cap")
    if method in ("icepop", "geo_rs", "seq_mask_tis"):
        lo, hi = st.slider("band [a, b]", 0.05, 10.0, (0.5, 2.0), 0.05, key="wi_band")
        params.update(low=lo, high=hi)
    if method == "opsm":
        params["delta"] = st.select_slider("delta", [0.0, 1e-5, 1e-4, 1e-3, 1e-2, 0.1, 0.3, 1.0], value=1e-4,
                                           key="wi_delta", format_func=lambda v: f"{v:g}")
    params.update(_new_params(method))
    frame = _whatif(run.path, run.keys, method, convention, tuple(sorted(params.items())))
    if (why := VM.whatif_missing(frame)) is not None:  # no advantages: nothing to replay, no 0% or nan
        st.info(why)
        return
    tot = VM.whatif_totals(frame)
    m = st.columns(5)
    m[0].metric("Tokens masked or clipped", f"{tot['token_frac']:.2%}")
    m[1].metric("Sequences affected", f"{tot['seq_frac']:.2%}")
    m[2].metric("Mean ESS", VL.shown(tot["ess"], ".3f"))
    m[3].metric("PG mass removed, A > 0", f"{tot['mass_removed_pos_share']:.1%}")
    m[4].metric("PG mass removed, A < 0", f"{tot['mass_removed_neg_share']:.1%}")
    denom, source = CR.DENOMINATORS[method]
    st.caption(f"Loss denominator after rejection: **{denom}** tokens ({source}); gradient scale under it "
               f"{frame['grad_scale'].mean():.3f} (the corrected policy-gradient weight per token over the "
               "uncorrected, mean over steps).")
    left, right = st.columns(2)
    left.plotly_chart(lines(frame, "step", ["token_frac", "seq_frac", "ess"], "What the correction does per step",
                            y_title=SHARE, subtitle=WHATIF_NAMES[method]))
    right.plotly_chart(lines(frame, "step", ["mass_removed_pos_share", "mass_removed_neg_share"],
                             "Policy-gradient mass removed per step", y_title=SHARE,
                             subtitle="share of |weight x advantage|, by the sign of A"))


def crosswalk_section(run: D.Loaded) -> str:
    """The framework's own metrics recomputed from the run, once its expander is opened; returns the framework
    chosen (the run's own while the section is closed)."""
    own = VM.own_framework(read_manifest(run.path))
    with st.expander(CROSSWALK_TITLE, key="mm_crosswalk", on_change="rerun") as box:
        if not box.open:
            return own
        names = list(FRAMEWORKS)
        fw = st.selectbox("Framework", names, index=names.index(own), key="cw_fw")
        table, reasons = _crosswalk(run.path, run.keys, fw)
        st.dataframe(table, hide_index=True, width="stretch")
        for name, why in reasons.items():
            st.caption(f"`{name}` is null: {why}")
    return fw


@st.cache_data(max_entries=8, show_spinner="Auditing the trainer's logs ...")
def _audit(path: str, keys: str, logs: str, framework: str) -> VA.AuditView:
    return VA.audit_view(path, logs, framework)


def audit_section(run: D.Loaded, fw: str) -> None:
    """`kldiag dashboard RUN --logs SRC`: the trainer's logged metrics against kldiag's recomputation."""
    if (logs := VA.logs_for(run.path)) is None:
        return
    st.subheader("Logged vs recomputed (audit)")
    audited = _audit(run.path, run.keys, logs, fw)
    if audited.error:
        st.warning(f"Cannot audit {logs}: {audited.error}")
    st.dataframe(audited.summary, hide_index=True, width="stretch")
    for name in audited.summary["metric"]:
        st.plotly_chart(VA.overlay(audited.series, name))


def main() -> None:
    """The page, section by section: a new section is a function above and one line here. Its view is a
    local: the page's globals (kept alive by a widget's callback) never hold the run's Analysis."""
    run = D.page("Mismatch")
    # a first visit reads the token sample for the view (the what-if and the crosswalk too, once opened): one set
    with VM.held(run.analysis):
        view = D.mismatch_view(run.path, run.keys)
        if view.step_stride > 1 or view.group_share < 1:
            st.caption(VM.sample_caption(view))
        routing_section(run)  # an MoE run leads with its routing: the verdict's finding when it names one
        parity_section(run, view)
        turns_section(run)
        whatif_section(run, view)
        audit_section(run, crosswalk_section(run))


main()
