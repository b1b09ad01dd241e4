"""The routing reducer's figures against numpy, the routing causes, and the CLI (--json, --set, --fail-on)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kldiag.analysis import AnalysisConfig, analyze
from kldiag.analysis.reducers.routing import RoutingReducer, routing_of
from kldiag.cli import main
from kldiag.diagnosis import diagnose
from kldiag.diagnosis.core import reducers
from kldiag.tools.routing_runs import STEPS
from kldiag.tools.routing_runs import batches as _data
from kldiag.tools.routing_runs import write as _write


def _numpy_figures(data):
    from kldiag.record.routes import compare

    rows = []
    for d in data:
        c = compare(d["experts"], d["experts_sampler"])
        m = d["mask"]
        rows.append({"dis": (c["route_differ"] > 0)[m], "miss": (c["route_missing"] > 0)[m],
                     "log_r": (d["logp"] - d["logp_sampler"])[m], "layer2": c["route_differ_at"][..., 2][m],
                     "d": (d["logp"] - d["logp_sampler"])[m], "ov": c["route_overlap"][m]})
    cat = {k: np.concatenate([r[k] for r in rows]) for k in rows[0]}
    k3 = np.exp(cat["log_r"]) - cat["log_r"] - 1
    return cat, k3


def test_reducer_figures_equal_numpy(tmp_path):
    data = _data()
    run = _write(tmp_path / "run", data)
    a = analyze(run, AnalysisConfig(), reducers())
    r = routing_of(a)
    cat, k3 = _numpy_figures(data)
    dis = cat["dis"]
    assert r["routed"] and r["routed_tokens"] == len(dis)
    assert r["differ_share"] == pytest.approx(dis.mean())
    assert r["agreement"] == pytest.approx(1 - dis.mean())
    assert r["disagree"]["mismatch_abs_mean"] == pytest.approx(np.abs(cat["log_r"][dis]).mean())
    assert r["agree"]["mismatch_abs_mean"] == pytest.approx(np.abs(cat["log_r"][~dis]).mean())
    assert r["disagree"]["k3_mean"] == pytest.approx(k3[dis].mean())
    assert r["agree"]["is_max"] == pytest.approx(np.exp(cat["log_r"][~dis]).max())
    assert r["kl_share_disagree"] == pytest.approx(k3[dis].sum() / k3.sum())
    d = cat["d"]
    assert r["areal_k3_mean"] == pytest.approx((np.expm1(d) - d).mean())
    assert r["areal_extreme_frac"] == pytest.approx((np.abs(d) > np.log(2)).mean())
    assert r["overlap_mean"] == pytest.approx(np.nanmean(cat["ov"]), rel=1e-6)
    assert [x["layer"] for x in r["layers"]] == [0, 1, 2]  # the widest layer listed
    assert r["layers"][2]["differ_share"] == pytest.approx(cat["layer2"].mean())
    assert len(r["steps"]) == STEPS and r["steps"][0]["differ_share_by_layer"][:2] == [0.0, 0.0]
    # a second pass (cached partials, merged again) gives the same figures
    again = routing_of(analyze(run, AnalysisConfig(), [RoutingReducer()]))
    assert again == r


def test_moe_routing_mismatch_named_instead_of_engine_mismatch(tmp_path):
    run = _write(tmp_path / "run", _data(gap=1.5))
    dg = diagnose(analyze(run, AnalysisConfig(), reducers()))
    names = [c.cause for c in dg.causes]
    assert "moe_routing_mismatch" in names and "engine_mismatch" not in names and "engine_precision" not in names
    c = dg.causes[names.index("moe_routing_mismatch")]
    assert c.evidence["layers"][0]["layer"] == 2 and c.evidence["kl_share_disagree"] > 0.75
    assert "enable_rollout_routing_replay" in c.fix  # verl's own key


def test_no_cause_when_routes_agree_or_mismatch_is_spread(tmp_path):
    same = _write(tmp_path / "same", _data(differ=0.0))
    assert not {c.cause for c in diagnose(analyze(same, AnalysisConfig(), reducers())).causes} & {
        "moe_routing_mismatch", "routing_replay_broken"}
    spread = _write(tmp_path / "spread", _data(gap=0.0))  # routes differ, the log-probs do not care
    causes = {c.cause for c in diagnose(analyze(spread, AnalysisConfig(), reducers())).causes}
    assert "moe_routing_mismatch" not in causes


def test_routing_replay_broken_from_the_manifest_or_set(tmp_path):
    run = _write(tmp_path / "run", _data(differ=0.05), config={"routing_replay": "R3"})
    dg = diagnose(analyze(run, AnalysisConfig(), reducers()))
    c = {c.cause: c for c in dg.causes}["routing_replay_broken"]
    assert dg.verdict == "unstable" and c.severity == "critical" and "moe_routing_mismatch" not in {
        x.cause for x in dg.causes}
    assert c.evidence["layers"][0]["layer"] == 2 and c.evidence["steps"] == list(range(STEPS))
    off = _write(tmp_path / "off", _data(differ=0.05), config={"routing_replay": "disabled"})
    assert "routing_replay_broken" not in {c.cause for c in diagnose(analyze(off, AnalysisConfig(), reducers())).causes}
    # missing engine routes on a layer from step 3: named with the layer and the steps
    gone = _write(tmp_path / "gone", _data(differ=0.0, missing_from=3), config={"routing_replay": True})
    c = {c.cause: c for c in diagnose(analyze(gone, AnalysisConfig(), reducers())).causes}["routing_replay_broken"]
    assert c.evidence["missing_layers"][0]["layer"] == 3 and c.evidence["steps"] == [3, 4, 5]


def test_cli_json_set_and_fail_on(tmp_path, capsys):
    run = _write(tmp_path / "run", _data(differ=0.05))
    assert main(["analyze", str(run), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["routing"]["routed"] and "routing_replay_broken" not in [c["cause"] for c in out["diagnosis"]["causes"]]
    assert main(["analyze", str(run), "--json", "--set", "routing_replay=R3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "routing_replay_broken" in [c["cause"] for c in out["diagnosis"]["causes"]]
    assert main(["report", str(run), "-o", str(tmp_path / "r.html"), "--set", "routing_replay=true",
                 "--fail-on", "routing_replay_broken"]) == 1
    capsys.readouterr()
    assert main(["analyze", str(run), "--set", "beta=3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kldiag: error: --set 'beta=3'") and "routing_replay" in err and "Traceback" not in err


def test_views_and_report_section(tmp_path, capsys):
    from kldiag.report.routing import section_html, text_lines
    from kldiag.views import routing as VR

    run = _write(tmp_path / "run", _data(gap=1.5))
    a = analyze(run, AnalysisConfig(), reducers())
    view = VR.view_of(a)
    assert view.routed and "routed differently carry" in VR.headline(view)
    assert VR.table(view).shape == (2, len(VR.TABLE_COLUMNS))
    heat = VR.agreement_by_layer(view)
    assert len(heat.data[0].y) == STEPS and len(heat.data[0].x) == 3 and heat.data[0].z[0][0] == 0.0
    assert [t.name for t in VR.mismatch_by_side(view).data] == ["routed alike", "routed differently"]
    assert text_lines(a)[0].startswith("routing: agreement") and "2 (" in text_lines(a)[1]
    assert "MoE routing: engine vs trainer experts" in section_html(a)
    dense = _write(tmp_path / "dense", [{k: v for k, v in d.items() if not k.startswith("experts")} for d in _data()])
    a = analyze(dense, AnalysisConfig(), reducers())
    assert not VR.view_of(a).routed and text_lines(a) == [] and section_html(a) == ""
    assert main(["report", str(run), "-o", str(tmp_path / "r.html")]) == 0
    assert "routing: agreement" in capsys.readouterr().out
    assert "MoE routing" in (tmp_path / "r.html").read_text()


def test_trainer_routes_only_compare_nothing(tmp_path, capsys):
    """A run that recorded the trainer's routes alone (TRL): no agreement, no shares, a sentence naming the
    missing side and how to record it; never 'agreement 100%, missing 0%'."""
    from kldiag.views import routing as VR

    data = [{k: v for k, v in d.items() if k != "experts_sampler"} for d in _data()]
    run = _write(tmp_path / "trainer_only", data)
    a = analyze(run, AnalysisConfig(), reducers())
    r = routing_of(a)
    assert r["routed"] and r["routed_tokens"] > 0 and r["compared_tokens"] == 0
    assert r["sides"] == {"trainer": True, "engine": False}
    assert r["agreement"] is None and r["missing_share"] is None and r["differ_share"] is None
    assert "experts_sampler" in r["not_compared"] and "not measured" in r["not_compared"]
    view = VR.view_of(a)
    assert not view.compared and "100" not in VR.headline(view) and "experts_sampler" in VR.headline(view)
    assert main(["analyze", str(run), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["routing"]
    assert out["agreement"] is None and out["missing_share"] is None


def test_heatmap_shows_every_routed_layer(tmp_path):
    """A layer where no token differs is still on the layer axis, and the scale reaches the replay limit."""
    from kldiag.views import routing as VR

    data = _data(layer=1)  # only layer 1 differs; layer 3 never does
    for d in data:  # every layer routed (layer 0 as layer 2), and layer 2 never differs either
        for side in ("experts", "experts_sampler"):
            d[side][..., 0, :] = d["experts"][..., 2, :]
        d["experts_sampler"][..., 2, :] = d["experts"][..., 2, :]
    a = analyze(_write(tmp_path / "run", data), AnalysisConfig(), reducers())
    view = VR.view_of(a)
    heat = VR.agreement_by_layer(view).data[0]
    assert list(heat.x) == [0, 1, 2, 3] and all(row[2] == row[3] == 0.0 for row in heat.z)
    assert heat.zmin == 0 and heat.zmax >= 2 * VR.REPLAY_LIMIT


def test_set_values_are_checked_per_key_before_any_work():
    """Each `--set` key takes its own values: replay modes for routing_replay only, a dtype name for rollout_dtype."""
    from kldiag.diagnosis.routing import check_settings
    from kldiag.errors import KldiagError

    assert check_settings(["rollout_dtype=fp8", "true_on_policy=yes", "routing_replay=R3"]) == {
        "rollout_dtype": "fp8", "true_on_policy": True, "routing_replay": "R3"}
    for bad in ("true_on_policy=R3", "routing_replay=maybe", "rollout_dtype=", "rollout_dtype=8?", "routing_replay"):
        with pytest.raises(KldiagError, match="--set"):
            check_settings([bad])
