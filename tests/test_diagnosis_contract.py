"""Parity contracts (kldiag.analysis.reducers.contract, kldiag.diagnosis.contract): exact counts on hand-built batches, the
causes on small known-truth runs, and the CI gate `kldiag report --set true_on_policy=true --fail-on parity_broken`."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pyarrow as pa
import pytest

from kldiag.analysis import AnalysisConfig, analyze
from kldiag.analysis.reducers import contract as K
from kldiag.cli import main
from kldiag.diagnosis import contract as DC
from kldiag.diagnosis import diagnose
from kldiag.diagnosis.core import reducers
from kldiag.format import Manifest
from kldiag.format.schema import RUN_SCHEMA
from kldiag.tools import truth as T


def _batch(**cols) -> pa.RecordBatch:
    """Rows with the recorded columns' own types (RUN_SCHEMA), as a run's parts hold them: the contract kernel
    is compiled once per array type it is called with, and these are the types every run gives it."""
    n = len(cols["logp"])
    base = {"step": [0] * n, "iteration": [0] * n, "micro": [0] * n, "seq": [0] * n, "pos": list(range(n)),
            "mask": [True] * n}
    return pa.RecordBatch.from_pydict({k: v if isinstance(v, pa.Array) else pa.array(v, RUN_SCHEMA.field(k).type)
                                       for k, v in {**base, **cols}.items()})


def test_parity_counts_tokens_off_and_the_first_one():
    f32 = np.float32
    old = [f32(-1.0), f32(-2.0), f32(-0.5), f32(-0.25)]
    mu = [f32(-1.0), np.nextafter(f32(-2.0), f32(0)), f32(-0.5), f32(-0.5)]  # one ulp off at pos 1; 0.25 at pos 3
    b = _batch(logp=old, logp_old=old, logp_sampler=mu, seq=[7, 7, 3, 3], pos=[0, 1, 0, 1])
    m = K.merge_partials([K.batch_partial(b, 0.0)])
    s = K.summary(m, K.PARITY)
    assert s["tokens"] == 4 and s["tokens_off"] == 2 and s["share_off"] == 0.5
    assert s["first"] == {"step": 0, "seq": 3, "pos": 1}  # the lowest (seq, pos) off
    assert s["max_abs"] == pytest.approx(0.25)
    assert K.summary(K.merge_partials([K.batch_partial(b, 0.3)]), K.PARITY)["tokens_off"] == 0


def test_parity_reads_pi_theta_at_iteration_0_where_pi_old_is_null_and_merges_parts_by_step():
    a = _batch(logp=[-1.0, -1.0], logp_old=pa.array([None, None], pa.float32()), logp_sampler=[-1.0, -1.1],
               step=[2, 2], seq=[5, 5])
    b = _batch(logp=[-1.0], logp_old=pa.array([None], pa.float32()), logp_sampler=[-1.2], step=[2], seq=[4])
    m = K.merge_partials([K.batch_partial(a, 0.0), K.batch_partial(b, 0.0)])
    s = K.summary(m, K.PARITY)
    assert s["tokens"] == 3 and s["tokens_off"] == 2 and s["first"] == {"step": 2, "seq": 4, "pos": 0}
    assert K.summary(m, K.BATCH) is None  # no logp_old: no batch-variance check


def test_batch_variance_counts_micro_0_of_iteration_0_and_the_fresh_share():
    b = _batch(logp=[-1.0, -1.1, -1.0, -1.0], logp_old=[-1.0, -1.0, -1.0, -1.2], logp_sampler=[-1.0] * 4,
               micro=[0, 0, 0, 1], iteration=[0, 0, 1, 0], step=[3, 3, 3, 3], policy_version=[3, 2, 3, 3])
    m = K.merge_partials([K.batch_partial(b, 0.0)])
    assert K.summary(m, K.BATCH)["tokens"] == 2 and K.summary(m, K.BATCH)["tokens_off"] == 1
    fresh = K.summary(m, K.BATCH_FRESH)  # the off token was sampled by version 2: not on-policy by the record
    assert fresh["tokens"] == 1 and fresh["tokens_off"] == 0


def test_declared_reads_the_manifest_flag():
    assert DC.declared(Manifest(config={"true_on_policy": True}))
    assert DC.declared(Manifest(config={"true_on_policy": "on"}))
    assert not DC.declared(Manifest(config={"true_on_policy": False})) and not DC.declared(Manifest(config={}))


SMALL = dict(steps=24, seqs=8, group=4, min_len=16, max_len=24)


def _diagnose(run):
    return diagnose(analyze(run, AnalysisConfig(), reducers()))


def _run(tmp_path, name, **kw):
    sc = replace(T.SCENARIOS[name], **{**SMALL, **kw})
    return sc, T.make_run(tmp_path / name, sc)


def test_parity_broken_and_its_twin(tmp_path):
    sc, run = _run(tmp_path, "parity_broken", parity_from=9, parity_off_frac=0.05)
    dg = _diagnose(run)
    assert [(c.cause, c.onset, c.severity) for c in dg.causes] == [("parity_broken", 9, "critical")]
    ev = dg.causes[0].evidence
    assert ev["first"]["step"] == 9 and ev["max_abs"] == pytest.approx(1e-3, rel=1e-3) and ev["tokens_off"] > 0
    twin, run2 = _run(tmp_path, "true_on_policy_exact")
    assert _diagnose(run2).causes == []


def test_batch_variance_and_its_twin(tmp_path):
    sc, run = _run(tmp_path, "batch_variance", batch_from=6)
    dg = _diagnose(run)
    assert [(c.cause, c.onset, c.severity) for c in dg.causes] == [("batch_variance", 6, "warning")]
    assert "policy_version = step" in dg.causes[0].evidence["scope"]
    _, run2 = _run(tmp_path, "onpolicy_versions_exact")
    assert _diagnose(run2).causes == []


def test_report_gates_ci_on_parity_broken_with_set(tmp_path, capsys):
    _, run = _run(tmp_path, "parity_broken", parity_from=4)
    manifest = run / "run.json"
    m = json.loads(manifest.read_text())
    m["config"].pop("true_on_policy")  # the run does not declare it: the command line does
    manifest.write_text(json.dumps(m))
    out = tmp_path / "r.html"
    assert main(["report", str(run), "-o", str(out), "--fail-on", "parity_broken"]) == 0
    capsys.readouterr()
    assert main(["report", str(run), "-o", str(out), "--set", "true_on_policy=true", "--fail-on", "parity_broken"]) == 1
    text, err = capsys.readouterr()
    assert "failing on cause parity_broken (critical, from step 4)" in err and "parity_broken" in text
