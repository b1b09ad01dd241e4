"""What a page leads with: green only beside a healthy verdict, tiles that never read nan, the sentence that names a
missing column and how to record it, the charts a run without logp_ref cannot draw."""

from __future__ import annotations

import numpy as np
import pandas as pd

from kldiag.diagnosis.types import Cause, Diagnosis
from kldiag.views import charts as VC
from kldiag.views import diagnosis as DV
from kldiag.views import leads as VL
from kldiag.views import mismatch as VM
from kldiag.views import numbers as VN


def _cause(name, severity="warning"):
    return Cause(name, 0, severity, {}, "fix it", f"{name} summary")


def test_parity_note_is_green_only_on_a_healthy_verdict():
    assert VL.parity_note(Diagnosis("healthy"))[0] == "success"
    kind, text = VL.parity_note(Diagnosis("unstable", [_cause("routing_replay_broken", "critical")]))
    assert kind == "warning" and "routing_replay_broken" in text and "float noise" not in text
    assert VL.parity_note(Diagnosis("warning", [_cause("k3_weight_blowup")]))[0] == "info"
    assert VL.parity_note(Diagnosis("warning", [_cause("engine_precision")])) is None  # the page lists it


def test_tiles_without_logp_ref_show_what_was_measured():
    steps = pd.DataFrame({"step": [0, 1], "tokens": [10, 10], "k3_mean": [np.nan, np.nan],
                          "mismatch_kl": [0.01, 0.02], "rho_max": [1.0, 1.5], "drift_abs_mean": [0.0, 0.1]})
    tiles = VL.overview_tiles({"k3_mean": float("nan")}, steps, {"routed": True, "differ_share": None})
    assert all("nan" not in value for _, value, _ in tiles)
    by_label = {label: (value, hint) for label, value, hint in tiles}
    assert by_label["Latest KL(mu||pi_old)"][0] == "0.02" and by_label["Max rho"][0] == "1.5"
    assert by_label["Routed differently"][0] == "n/a" and "experts_sampler" in by_label["Routed differently"][1]
    assert by_label["Flagged tokens"][0] == "n/a" and "logp_ref" in by_label["Flagged tokens"][1]
    assert VL.shown(float("nan")) == VL.shown(None) == "n/a" and VL.shown(0.5, ".0%") == "50%"


def test_trends_leave_out_what_was_not_measured():
    n = 5
    steps = pd.DataFrame({"step": np.arange(n), "tokens": np.full(n, 10),
                          **{c: np.full(n, np.nan) for s in VC.STEP_TRENDS for c in s.columns}})
    steps[["theta_ll_ref_count", "weight_blowup_count", "clamp_saturated_count", "nonfinite_count",
           "invalid_count"]] = 0
    steps["rho_max"] = steps["rho_mean"] = steps["rho_min"] = 1.0
    steps["mismatch_kl"], steps["drift_abs_mean"], steps["rho_clip_frac"] = 0.01, 0.0, 0.0
    figs = VC.step_trends(steps)
    titles = [f.layout.title.text for f in figs]
    assert all(any(np.isfinite(np.asarray(t.y, float)).any() for t in f.data) for f in figs)
    assert not any("KL estimate" in t or "gradient weight" in t or "Flagged tokens" in t for t in titles)
    gaps = " ".join(VC.trend_gaps(steps))
    assert "KL estimate" in gaps and "needs logp_ref" in gaps and "non-finite log-prob" in gaps
    assert "is 0 on every step" in gaps and not any("shares" in t for t in titles)  # rho_clip_frac 0: said
    steps["rho_clip_frac"] = 0.1
    share = next(f for f in VC.step_trends(steps) if "shares" in f.layout.title.text)
    assert [t.name for t in share.data] == [VC.name_of("rho_clip_frac")]  # the flag shares left out


def test_edges_of_issue_47():
    alerts = pd.DataFrame({"step": [1], "kind": ["mismatch"], "metric": ["mismatch_kl"], "value": [0.1],
                           "baseline": [0.0], "message": ["m"], "start": [1], "end": [None], "peak_step": [2],
                           "peak_value": [0.2], "severity": ["warning"], "steps": [3]})
    frame = DV.alerts_frame(alerts)
    assert frame["end"].tolist() == ["ongoing"] and list(frame.columns).index("message") < 5
    assert VN.loss_caption({"beta": 0.0, "estimator": "k3"}) == "no KL term in the loss (beta = 0)"
    assert VN.loss_caption({"beta": 0.04, "estimator": "k3_is"}) == "loss estimator: k3_is"
    assert VN.metric_label("mismatch_kl") == "engine mismatch KL(mu||pi_old) (mismatch_kl)"
    assert VN.metric_axis("mismatch_kl").endswith("(nats per token)")
    bins = pd.DataFrame({"lo": [0.0, 1.0, 2.0, 4.0, 16384.0], "hi": [1.0, 2.0, 4.0, 8.0, float(1 << 40)]})
    assert VM.at_centre(bins, "position")["position"].tolist() == [0.0, 1.0, 2.5, 5.5, 16384.0]
    titles = [s.title for s in VC.STEP_TRENDS]
    assert "KL(mu||pi_old)" in titles[-1] and "against" not in titles[-1]  # not the Mismatch page's title
    assert VM.whatif_missing(pd.DataFrame({"tokens": [0, 0]})).startswith("A correction's replay")
    assert VM.whatif_missing(pd.DataFrame({"tokens": [3]})) is None
