"""Format v1.3's policy_version and task: the recorder, the staleness and per-task figures, the causes.

Runs are the known-truth generator's (kldiag/tools/truth.py), small; figures are checked against numpy
recomputations from the rows as written.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pyarrow.parquet as pq
import pytest

import kldiag
from kldiag.analysis import AnalysisConfig, analyze
from kldiag.analysis.reducers import staleness as S
from kldiag.analysis.reducers import tasks as TK
from kldiag.diagnosis import diagnose
from kldiag.diagnosis.core import reducers
from kldiag.format import FORMAT_VERSION
from kldiag.record.recorder import Recorder
from kldiag.tools import truth as T

SMALL = dict(steps=30, seqs=8, group=4, min_len=8, max_len=16)


def test_format_version_is_1_3():
    assert FORMAT_VERSION == 1.3


def test_columns_round_trip_and_cost_nothing_unused(tmp_path):
    with Recorder(tmp_path / "r") as rec:
        rec.record(step=0, logp=-np.ones((3, 4)), policy_version=np.array([0, 0, 0]), task=["math", "code", "math"])
        rec.record(step=1, logp=-np.ones((2, 4)))
    t = kldiag.open_run(tmp_path / "r").read(columns=["step", "seq", "policy_version", "task"]).to_pandas()
    first = t[t.step == 0].drop_duplicates("seq")
    assert first.task.tolist() == ["math", "code", "math"] and first.policy_version.tolist() == [0, 0, 0]
    assert t[t.step == 1].policy_version.isna().all() and t[t.step == 1].task.isna().all()
    with Recorder(tmp_path / "plain") as rec:
        rec.record(step=0, logp=-np.ones((2, 4)))
    part = next((tmp_path / "plain" / "tokens").rglob("*.parquet"))
    assert {"policy_version", "task"}.isdisjoint(pq.read_schema(part).names)  # an unused column is not written


def test_older_runs_read_the_new_columns_as_null(tmp_path):
    with Recorder(tmp_path / "r") as rec:
        rec.record(step=0, logp=-np.ones((2, 4)))
    manifest = tmp_path / "r" / "run.json"
    d = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**d, "format_version": 1.2}))  # what a v1.2 writer left
    run = kldiag.open_run(tmp_path / "r")
    t = run.read(columns=["step", "policy_version", "task"])
    assert run.manifest.format_version == 1.2 and t.column("task").null_count == t.num_rows == 8
    assert S.summary(analyze(tmp_path / "r", AnalysisConfig(), [S.StalenessReducer()]).reduced["staleness"])[
        "versions"] is False


def test_task_is_dictionary_encoded(tmp_path):
    with Recorder(tmp_path / "r") as rec:
        rec.record(step=0, logp=-np.ones((4, 64)), task=["a-long-environment-name"] * 4)
    part = next((tmp_path / "r" / "tokens").rglob("*.parquet"))
    meta = pq.ParquetFile(part).metadata.row_group(0)
    col = next(meta.column(i) for i in range(meta.num_columns) if meta.column(i).path_in_schema == "task")
    assert "RLE_DICTIONARY" in col.encodings


@pytest.mark.parametrize("kw, match", [
    ({"policy_version": np.zeros(3, np.int64)}, r"policy_version has shape \(3,\).*with shape \(2,\)"),
    ({"policy_version": np.zeros(2)}, r"policy_version has dtype float64; pass one integer weight version"),
    ({"task": ["a"]}, r"task has shape \(1,\).*shape \(2,\)"),
    ({"task": ["a", 3]}, r"task holds int 3; pass one string label per sequence"),
])
def test_bad_input_refused_before_queueing(tmp_path, kw, match):
    with Recorder(tmp_path / "r") as rec:
        rec.record(step=0, logp=-np.ones((2, 4)), task=["x", "y"], policy_version=np.array([0, 0]))
        with pytest.raises(ValueError, match=match):
            rec.record(step=1, logp=-np.ones((2, 4)), **kw)
    t = kldiag.open_run(tmp_path / "r").read(columns=["step", "task"])
    assert t.num_rows == 8 and set(t.column("step").to_pylist()) == {0}  # what was recorded stays, nothing more


def _run(tmp_path, name, **kw):
    sc = replace(T.SCENARIOS[name], **{**SMALL, **kw})
    T.make_run(tmp_path / name, sc)
    return sc, analyze(tmp_path / name, AnalysisConfig(), reducers())


def test_staleness_figures_match_the_rows(tmp_path):
    sc, a = _run(tmp_path, "async_staleness")
    t = kldiag.open_run(tmp_path / sc.name).read(
        columns=["step", "seq", "mask", "logp", "logp_old", "policy_version"]).to_pandas()
    t = t[t["mask"]]
    stale = (t.step - t.policy_version).clip(upper=S.MAX_STALE)
    x = (t.logp.astype(float) - t.logp_old.astype(float))
    bb = S.by_bucket(a.reduced["staleness"])
    assert bb["stale"].tolist() == sorted(stale.unique().tolist()) == [0, 1, 2, 3, 4]
    for i, b in enumerate(bb["stale"]):
        sel = stale == b
        assert bb["tokens"][i] == sel.sum()
        assert bb["drift_abs_mean"][i] == pytest.approx(np.abs(x[sel]).mean(), rel=1e-9)
        rho = np.exp(x[sel])
        assert bb["rho_clip_frac"][i] == pytest.approx(((rho < 0.8) | (rho > 1.28)).mean(), rel=1e-9)
        assert bb["sequences"][i] == t[sel].drop_duplicates(["step", "seq"]).shape[0]
    ps = S.per_step(a.reduced["staleness"])
    assert ps["histogram"].sum() == t.drop_duplicates(["step", "seq"]).shape[0]
    assert (ps["staleness_max"] <= 4).all() and (ps["staleness_max"] >= 0).all()


def test_staleness_and_tasks_in_json(tmp_path):
    _run(tmp_path, "async_staleness")
    out = subprocess.run([sys.executable, "-m", "kldiag", "analyze", str(tmp_path / "async_staleness"), "--json"],
                         capture_output=True, text=True, check=False)
    d = json.loads(out.stdout)
    st = d["staleness"]
    assert st["versions"] is True and set(st["histogram"]) == {"0", "1", "2", "3", "4"}
    drift = [b["drift_abs_mean"] for b in st["by_staleness"]]
    assert drift == sorted(drift)  # drift grows with staleness, by construction
    cause = next(c for c in d["diagnosis"]["causes"] if c["cause"] == "async_staleness")
    assert cause["evidence"]["bound_key"] == "max_staleness"  # the truth runs are TRL runs
    assert d["tasks"] == {"tasks": [], "by_task": [], "steps": []}


def test_run_without_versions_reads_as_none(tmp_path):
    _, a = _run(tmp_path, "healthy_offpolicy_bf16")
    out = S.summary(a.reduced["staleness"])
    assert out["versions"] is False and out["histogram"] == {} and out["steps"] == []
    assert out["versions_spanned"] == {}


def _two_tasks(tmp_path) -> str:
    """Each step: a healthy batch labelled "math" and an engine-mismatch batch labelled "code"."""
    calm = T.generate(replace(T.SCENARIOS["healthy_offpolicy_bf16"], **SMALL))
    bad = T.generate(replace(T.SCENARIOS["engine_mismatch_jump"], **SMALL, mismatch_from=0, seed=1))
    run = tmp_path / "tasks"
    with Recorder(run, beta=0.04, estimator="k3", clip_range=(0.2, 0.28), trainer="trl") as rec:
        for s in range(SMALL["steps"]):
            r = slice(s * SMALL["seqs"], (s + 1) * SMALL["seqs"])
            for micro, (d, task) in enumerate(((calm, "math"), (bad, "code"))):
                rec.record(step=s, micro=micro, logp=d["logp"][r], logp_old=d["logp_old"][r], logp_ref=d["logp_ref"][r],
                           logp_sampler=d["logp_sampler"][r], mask=d["mask"][r], advantages=d["advantages"][r],
                           seq_ids=np.arange(SMALL["seqs"]) + 1000 * s + 100 * micro, task=[task] * SMALL["seqs"])
    return str(run)


def test_per_task_split_and_the_cause_names_its_task(tmp_path):
    run = _two_tasks(tmp_path)
    a = analyze(run, AnalysisConfig(), reducers())
    m = a.reduced["tasks"]
    assert list(m["labels"]) == ["code", "math"]
    t = kldiag.open_run(run).read(columns=["step", "mask", "logp_old", "logp_sampler", "task"]).to_pandas()
    t = t[t["mask"]]
    z = t.logp_old.astype(float) - t.logp_sampler.astype(float)
    bt = TK.by_task(m)
    for i, task in enumerate(bt["task"]):
        sel = t.task == task
        assert bt["tokens"][i] == sel.sum()
        assert bt["mismatch_kl"][i] == pytest.approx((np.expm1(z[sel]) - z[sel]).mean(), rel=1e-9)
    one = TK.task_steps(m, "code")
    assert list(one["step"]) == list(range(SMALL["steps"]))
    dg = diagnose(a)
    mism = [c for c in dg.causes if c.cause.startswith("engine_")]
    assert mism, [c.cause for c in dg.causes]
    assert mism[0].evidence["task"] == "code" and "code" in mism[0].summary


def test_views_split_the_pages_frames_by_task(tmp_path):
    from kldiag.views import tasks as VK

    run = _two_tasks(tmp_path)
    a = analyze(run, AnalysisConfig(), reducers())
    assert VK.choices(a) == [VK.ALL, "code", "math"]
    steps = a.steps.to_pandas()
    assert VK.overview_steps(a, steps, VK.ALL) is steps
    code = VK.overview_steps(a, steps, "code")
    assert list(code.columns) == list(steps.columns) and list(code["step"]) == list(steps["step"])
    math = VK.overview_steps(a, steps, "math")
    assert (code["mismatch_kl"] > 5 * math["mismatch_kl"]).all()  # the engine mismatch is the code task's
    assert code["tokens"].sum() + math["tokens"].sum() == steps["tokens"].sum()  # every token in the loss has a task
    assert code["clamp_saturated_count"].isna().all()  # a figure no task split gives: empty, not wrong
    mm = VK.mismatch_by_step(a, None, "code")
    assert list(mm.columns) == ["step", "drift_abs", "mismatch_abs"] and (mm["mismatch_abs"] > 0).all()


def test_app_pages_offer_the_task_selector(tmp_path, monkeypatch):
    from pathlib import Path

    from streamlit.testing.v1 import AppTest

    main = Path(__file__).resolve().parent.parent / "app" / "main.py"
    monkeypatch.setenv("KLDIAG_RUNS", _two_tasks(tmp_path))
    at = AppTest.from_file(str(main), default_timeout=120).run()
    for page, key in (("overview", "ov_task"), ("mismatch", "mm_task")):
        at = at.switch_page(f"app_pages/{page}.py").run()
        assert not at.exception, [e.value for e in at.exception]
        box = at.selectbox(key=key)
        assert box.options == ["all tasks", "code", "math"]
        box.set_value("code").run()
        assert not at.exception, [e.value for e in at.exception]


def test_slime_weight_versions_map_to_policy_version(tmp_path):
    from kldiag.importers import slime as dump
    from kldiag.importers.sink import pack

    assert dump.slime_policy_version(["3", "5"]) == 2  # the oldest call's weights; version r + 1 made rollout r
    assert dump.slime_policy_version(["default"]) is None and dump.slime_policy_version(None) is None
    sample = {"response_lengths": 3, "log_probs": [-0.1, -0.2, -0.3], "loss_masks": [1, 1, 1],
              "weight_versions": ["4", "4"]}
    args = pack([dump.to_sequence(sample, 5, 0, None, None), dump.to_sequence({**sample, "weight_versions": ["6"]},
                                                                              5, 1, None, None)])
    assert args["policy_version"].tolist() == [3, 5]
    with Recorder(tmp_path / "r") as rec:
        rec.record(step=5, **{("advantages" if k == "advantage" else k): v for k, v in args.items()})
    t = kldiag.open_run(tmp_path / "r").read(columns=["step", "policy_version"]).to_pandas()
    assert sorted(set(t.step - t.policy_version)) == [0, 2]


def test_versions_per_token_round_trip_and_count_changes(tmp_path):
    """policy_version [B, T]: stored per token; the staleness reducer counts each token at its own staleness and
    a sequence's version changes, with the mismatch before and from its first change (numpy on the rows)."""
    logp = -np.ones((3, 6))
    mu = logp.copy()
    mu[1, 3:] -= 0.5  # the straddling sequence's tokens after the change
    version = np.array([[4, 4, 4, 4, 4, 4], [3, 3, 3, 4, 4, 4], [2, 2, 2, 2, 2, 2]])
    with Recorder(tmp_path / "r") as rec:
        rec.record(step=5, logp=logp, logp_old=logp, logp_sampler=mu, policy_version=version)
        with pytest.raises(ValueError, match=r"policy_version has shape \(3, 5\).*\(3,\) or \(3, 6\)"):
            rec.record(step=6, logp=logp, policy_version=version[:, :5])
    t = kldiag.open_run(tmp_path / "r").read(columns=["seq", "pos", "policy_version"]).to_pandas()
    assert sorted(t.groupby("seq")["policy_version"].apply(list).tolist()) == sorted(version.tolist())
    m = analyze(tmp_path / "r", AnalysisConfig(), [S.StalenessReducer()]).reduced["staleness"]
    bb = S.by_bucket(m)
    assert dict(zip(bb["stale"].tolist(), bb["tokens"].tolist(), strict=True)) == {1: 9, 2: 3, 3: 6}
    vf = S.version_figures(m)
    assert (vf["mixed"], vf["single"], vf["versions_max"]) == (1, 2, 2)
    assert vf["mixed_mis"] == pytest.approx(0.25) and vf["single_mis"] == 0.0
    assert vf["mixed_mis_before"] == 0.0 and vf["mixed_mis_after"] == pytest.approx(0.5)
    ch = vf["changes"]
    assert ch["pos"].tolist() == [3] and ch["from"].tolist() == [3] and ch["to"].tolist() == [4]
    # a negative version is none, and a version change across tokens without one still counts
    gap = np.array([[4, 4, -1, -1, 5, 5], [-1, 3, 3, 3, 3, 3], [2, 2, 2, 2, 2, 2]])
    with Recorder(tmp_path / "g") as rec:
        rec.record(step=5, logp=logp, logp_old=logp, logp_sampler=mu, policy_version=gap)
    vg = S.version_figures(analyze(tmp_path / "g", AnalysisConfig(), [S.StalenessReducer()]).reduced["staleness"])
    assert (vg["mixed"], vg["single"]) == (1, 2) and vg["changes"]["pos"].tolist() == [4]
    ps = S.per_step(m)  # a sequence's staleness: its first token's (its oldest weights)
    assert ps["histogram"][0][[1, 2, 3]].tolist() == [1, 1, 1]
    assert S.summary(m)["versions_spanned"] == {"1": 2, "2": 1}
