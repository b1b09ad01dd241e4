"""Early warning (issue 24 item 4): leading indicators raise a warning episode before the critical one,
healthy runs get none, no verdict changes, and the new kinds reach `kldiag analyze --json` and `kldiag watch`."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from kldiag.analysis import AnalysisConfig, analyze
from kldiag.analysis.rules import early as W
from kldiag.analysis.rules import episodes as EP
from kldiag.cli import main
from kldiag.diagnosis import diagnose
from kldiag.diagnosis.core import reducers, verdict
from kldiag.diagnosis.text import verdict_line
from kldiag.diagnosis.types import Diagnosis
from kldiag.live.watch import Watcher, render
from kldiag.record.recorder import Recorder
from kldiag.tools import truth as T
from kldiag.tools.synth import SynthConfig, make_run

RAMP = T.small(T.RAMP_SCENARIOS["k3_blowup_ramp100"])  # K3's weight climbs from step 100, blows up later


@pytest.fixture(scope="module")
def ramp_run(tmp_path_factory):
    return T.make_run(tmp_path_factory.mktemp("ramp") / "run", RAMP)


def record_steps(rec, data, sc: T.Scenario, steps: range) -> None:
    """Record `steps` of a known-truth run's data, one micro-batch per step (T.make_run's columns)."""
    for s in steps:
        r = slice(s * sc.seqs, (s + 1) * sc.seqs)
        rec.record(step=s, logp=data["logp"][r], logp_old=data["logp_old"][r], logp_ref=data["logp_ref"][r],
                   logp_sampler=data["logp_sampler"][r], advantages=data["advantages"][r], mask=data["mask"][r],
                   token_ids=data["token_ids"][r], group_ids=data["group_ids"][r], entropy=data["entropy"][r])


def diagnosed(run):
    a = analyze(run, AnalysisConfig(), reducers())
    return a, diagnose(a)


def early(dg, severity: str | None = "warning"):
    return [e for e in dg.episodes if e.kind in W.EARLY_KINDS and (severity is None or e.severity == severity)]


def first_critical(dg) -> int:
    return min(e.start for e in dg.episodes if e.severity == "critical")


# ---- the rules on hand-made columns ---------------------------------------------------------------


def test_levels_are_the_recent_median_against_the_trailing_baseline():
    ew = W.EarlyWarning()
    v = np.r_[np.ones(30), np.full(10, 4.0)]
    recent, base = W.levels(v, ew)
    assert np.isnan(base[: ew.recent + ew.min_history - 1]).all() and base[ew.recent + ew.min_history - 1] == 1.0
    assert recent[31] == 1.0 and recent[32] == 4.0  # 3 of the last 5 steps high: the median is high
    assert base[34] == 1.0 and base[39] == 1.0  # the baseline ends `recent` steps back


def test_rolling_median_matches_its_definition():
    rng = np.random.default_rng(0)
    v = rng.random(300)
    v[rng.random(300) < 0.2] = np.nan
    for width, lag, need in ((5, 0, 3), (50, 5, 10), (3, 2, 1)):
        want = np.full(len(v), np.nan)
        for i in range(len(v)):
            w = v[max(0, i - lag - width + 1):max(0, i - lag + 1)]
            w = w[np.isfinite(w)]
            want[i] = np.median(w) if len(w) >= need else np.nan
        np.testing.assert_allclose(W.rolling_median(v, width, lag, need), want)


def test_a_single_spike_is_no_trend():
    n = 200
    cols = {"step": np.arange(n), "tokens": np.full(n, 1000.0), "weight_k3_abs_p99": np.full(n, 0.5),
            "weight_k3_abs_p999": np.full(n, 0.8), "blame_share": np.zeros(n), "flagged_frac": np.zeros(n)}
    for k in ("weight_k3_abs_p99", "weight_k3_abs_p999"):
        cols[k][[50, 120, 121]] = 40.0  # an isolated step and two in a row: not 3 of 5
    cols["blame_share"][[50, 120, 121]] = 0.9
    cols["flagged_frac"][[50, 120, 121]] = 0.1
    assert not [e for e in EP.episodes(cols, EP.RuleContext()) if e.kind in W.EARLY_KINDS]


def test_early_is_an_alias_and_warnings_make_no_verdict():
    assert EP.parse_kinds("early") == W.EARLY_KINDS and set(W.EARLY_KINDS) <= set(EP.parse_kinds("all"))
    e = EP.Episode("early_weight_trend", 10, None, 12, 30.0, "warning", "m")
    assert verdict([], [e]) == "healthy"
    line = verdict_line(Diagnosis("healthy", [], [e]))
    assert line.startswith("verdict: HEALTHY") and line.endswith("; early warning: early_weight_trend from step 10 "
                                                                  "(ongoing)")
    assert "early warning" not in verdict_line(Diagnosis("unstable", [], [e]))


# ---- runs ---------------------------------------------------------------------------------------


def test_synthetic_blowup_is_warned_before_its_critical_onset(ramp_run):
    a, dg = diagnosed(ramp_run)
    assert T.check(RAMP, dg) == [] and dg.verdict == "unstable"
    warned, crit = min(e.start for e in early(dg)), first_critical(dg)
    cause = next(c for c in dg.causes if c.cause == "k3_weight_blowup")
    assert RAMP.collapse_from < warned < cause.onset <= crit, [(e.kind, e.start, e.severity) for e in dg.episodes]
    assert verdict(dg.causes, [e for e in dg.episodes if e.kind not in W.EARLY_KINDS]) == dg.verdict
    alerts = a.alerts.to_pylist()  # the analysis's alerts table has them too (all but the entropy rule)
    assert {r["kind"] for r in alerts if r["kind"] in W.EARLY_KINDS} == {e.kind for e in early(dg, None)}
    assert {r["baseline"] for r in alerts if r["kind"] == "early_weight_trend"} == {5.0}  # the floor, 0.5 x W


def test_a_step_blowup_has_nothing_to_lead_and_no_late_warning(tmp_path):
    make_run(tmp_path, SynthConfig(steps=120, blowup_step=80, seqs_per_step=16, vocab_size=0))
    _, dg = diagnosed(tmp_path)
    assert first_critical(dg) == 80 and not [e for e in early(dg, None) if e.start <= 90]


def test_entropy_drop_warns_before_the_collapse_is_confirmed(tmp_path):
    sc = T.small(T.SCENARIOS["entropy_collapse"])
    run = T.make_run(tmp_path / "run", sc)
    a, dg = diagnosed(run)
    assert T.check(sc, dg) == []
    (drop,) = [e for e in early(dg) if e.kind == "early_entropy_drop"]
    cause = next(c for c in dg.causes if c.cause == "entropy_collapse")
    assert cause.onset <= drop.start < cause.evidence["confirmed_step"] and drop.peak_value >= 0.2
    assert "early_entropy_drop" not in a.alerts.column("kind").to_pylist()  # the side scan is the diagnosis's


@pytest.mark.parametrize("name", ["healthy_offpolicy_bf16", "healthy_long_hard"])
def test_healthy_truth_controls_get_no_early_warning(tmp_path, name):
    sc = T.small(T.SCENARIOS[name])
    sc = replace(sc, steps=min(sc.steps, 600))
    dg = T.run_and_diagnose(sc, tmp_path / "run")
    assert early(dg, None) == [] and dg.verdict == "healthy"


def test_healthy_synthetic_control_gets_no_early_warning(tmp_path):
    make_run(tmp_path, SynthConfig(steps=400, seqs_per_step=16, vocab_size=0))
    _, dg = diagnosed(tmp_path)
    assert early(dg, None) == [] and dg.verdict == "healthy"


def test_k3_trends_are_notes_when_the_loss_is_not_k3(tmp_path):
    sc = replace(RAMP, manifest="verl_hook")  # the loss is verl's clamped low_var_kl, not K3
    dg = T.run_and_diagnose(sc, tmp_path / "run")
    found = [e for e in early(dg, None) if e.kind in W.EARLY_K3]
    assert found and all(e.severity == "info" for e in found)


# ---- faces --------------------------------------------------------------------------------------


def test_analyze_json_lists_the_early_warnings(ramp_run, capsys):
    assert main(["analyze", str(ramp_run), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    kinds = {a["kind"]: a for a in out["alerts"]}
    assert "early_weight_trend" in kinds and kinds["early_weight_trend"]["severity"] == "warning"
    assert kinds["early_weight_trend"]["start"] < min(a["start"] for a in out["alerts"] if a["kind"] == "blowup")
    assert kinds["early_weight_trend"]["evidence"]["tokens"]
    assert main(["analyze", str(ramp_run)]) == 0
    assert "[warning] early_weight_trend: steps" in capsys.readouterr().out


def test_watch_prints_the_early_warning_before_the_blowup(tmp_path, capsys):
    data, run = T.generate(RAMP), tmp_path / "run"
    m = T.MANIFESTS[RAMP.manifest]
    lines, last = [], None
    with Recorder(run, beta=m["beta"], estimator=m["estimator"], rotate_seconds=None) as rec:
        record_steps(rec, data, RAMP, range(0, 100))
        rec.flush()
        w = Watcher(str(run))
        for s in range(100, RAMP.steps, 10):
            record_steps(rec, data, RAMP, range(s, s + 10))
            rec.flush()
            up = w.poll()
            lines += render(up, last)
            last = up.diagnosis.verdict if up.diagnosis else last
    started = [ln for ln in lines if ln.startswith(">> started")]
    warn = next(i for i, ln in enumerate(started) if "[warning] early_weight_trend:" in ln)
    crit = next(i for i, ln in enumerate(started) if "[critical] blowup:" in ln)
    assert warn < crit, started
    assert main(["watch", str(run), "--once", "--fail-on", "early"]) == 1
    assert "failing on early_" in capsys.readouterr().err
