"""The coverage table: per step the share of loss tokens with each optional input, against numpy; per input on
how many steps; in `kldiag analyze --json` and its text; the same from cached partials."""

from __future__ import annotations

import json

import pytest

from kldiag.analysis import AnalysisConfig, analyze
from kldiag.analysis.reducers.coverage_table import CoverageReducer, coverage_of, missing
from kldiag.analysis.reducers.topk import TopkReducer
from kldiag.analysis.runtime.runner import reduced
from kldiag.cli import main
from kldiag.diagnosis.core import reducers
from kldiag.tools.routing_runs import batches, write


def _run(tmp_path, drop=(), half_ref=False):
    data = batches()
    for i, d in enumerate(data):
        for k in drop:
            d.pop(k, None)
        if half_ref and i % 2:
            d.pop("logp_ref")
    return write(tmp_path / "run", data), data


def test_shares_per_step_equal_numpy(tmp_path):
    run, data = _run(tmp_path, half_ref=True)
    a = analyze(run, AnalysisConfig(), reducers())
    assert "topk_trainer" not in coverage_of(a)["inputs"]  # not read with the analysis: left out, not read again
    cov = coverage_of(a, reduced(a, TopkReducer()))
    for i, (row, d) in enumerate(zip(cov["steps"], data, strict=True)):
        assert row["step"] == d["step"] and row["tokens"] == int(d["mask"].sum())
        assert row["logp_ref"] == (0.0 if i % 2 else 1.0) and row["logp_sampler"] == 1.0
        routed = (d["experts"] >= 0).any(-1).any(-1)[d["mask"]].mean()
        assert row["routes_trainer"] == pytest.approx(routed) and row["routes_engine"] == pytest.approx(routed)
        assert row["advantage"] == row["policy_version"] == row["topk_trainer"] == 0.0
    n = len(data)
    assert cov["inputs"]["logp_ref"] == {"steps": n // 2, "of": n, "token_share": pytest.approx(
        sum(int(d["mask"].sum()) for i, d in enumerate(data) if not i % 2) / sum(int(d["mask"].sum()) for d in data))}
    assert "advantage" in missing(cov) and "logp_sampler" not in missing(cov) and cov["routes"] is None


def test_trainer_routes_only_and_cached_partials(tmp_path):
    run, _ = _run(tmp_path, drop=("experts_sampler",))
    first = coverage_of(analyze(run, AnalysisConfig(), reducers()))
    assert first["inputs"]["routes_trainer"]["steps"] == len(first["steps"])
    assert first["inputs"]["routes_engine"]["steps"] == 0
    again = coverage_of(analyze(run, AnalysisConfig(), [CoverageReducer()]))  # merged from the cache
    assert again == first


def test_analyze_json_and_text_carry_it(tmp_path, capsys):
    run, _ = _run(tmp_path, drop=("logp_ref",))
    assert main(["analyze", str(run), "--json"]) == 0
    cov = json.loads(capsys.readouterr().out)["coverage"]
    assert cov["inputs"]["logp_ref"]["steps"] == 0 and cov["inputs"]["logp_sampler"]["steps"] == len(cov["steps"])
    assert main(["analyze", str(run)]) == 0
    out = capsys.readouterr().out
    assert "coverage: every step has engine log-probs (logp_sampler)" in out
    assert "not recorded: reference log-probs (logp_ref)" in out
    # a run without logp_ref: the step table shows what it measured, not columns of dashes (issue 47 edge 6)
    head = next(line for line in out.splitlines() if line.lstrip().startswith("step "))
    assert "mismatch_kl" in head and "routed_differ" in head and "k3_mean" not in head
    assert "flagged: not measured" in out and "flagged: 0 of" not in out


def _reference_counts(batch):
    """batch_counts from its definition, in numpy: per step of the loss tokens, the non-null rows of each column."""
    import numpy as np

    from kldiag.analysis.reducers.coverage_table import COUNTED

    n = batch.num_rows
    mask = batch.column("mask").fill_null(False).to_numpy(zero_copy_only=False).astype(bool)
    step = batch.column("step").to_numpy(zero_copy_only=False)
    steps = np.unique(step[mask])
    tokens = [(mask & (step == s)).sum() for s in steps]
    out = {"step": steps.astype(np.int64), "n_tokens": np.asarray(tokens, np.int64)}
    for name, column in COUNTED.items():
        ok = (batch.column(column).is_valid().to_numpy(zero_copy_only=False) if column in batch.schema.names
              else np.zeros(n, bool))
        out[f"n_{name}"] = np.asarray([(mask & ok & (step == s)).sum() for s in steps], np.int64)
    return out


def test_batch_counts_equal_numpy_on_nulls_absent_columns_and_slices():
    import numpy as np
    import pyarrow as pa

    from kldiag.analysis.reducers.coverage_table import batch_counts

    rng = np.random.default_rng(0)
    n = 9000
    step = np.repeat(np.asarray([2, 5, 6, 1 << 40]), [3000, 2500, 3490, 10])  # a step past any offset range
    step[4000:4010] = 2  # a step back: rows out of order
    nulls = {k: rng.random(n) < 0.1 for k in ("mask", "logp_ref", "turn", "task", "route_differ")}
    task = pa.array(rng.choice(["a", "b"], n), mask=nulls["task"])
    cols = {"step": pa.array(step), "mask": pa.array(rng.random(n) < 0.8, mask=nulls["mask"]),
            "logp_sampler": pa.array(rng.normal(size=n).astype(np.float32)),
            "logp_ref": pa.array(rng.normal(size=n).astype(np.float32), mask=nulls["logp_ref"]),
            "logp_old": pa.nulls(n, pa.float32()), "turn": pa.array(np.zeros(n, np.int16), mask=nulls["turn"]),
            "route_differ": pa.array(np.ones(n, np.int16), mask=nulls["route_differ"]), "task": task}
    b = pa.RecordBatch.from_pydict(cols)
    variants = [b, b.slice(7, 5000), b.slice(3001, 17), b.slice(0, 0),
                b.set_column(b.schema.get_field_index("task"), "task", task.dictionary_encode()).slice(5, 8000),
                pa.RecordBatch.from_pydict({**cols, "mask": pa.array(np.zeros(n, bool))})]
    for v in variants:
        got, want = batch_counts(v), _reference_counts(v)
        assert got.keys() == want.keys()
        for k in want:
            assert got[k].dtype == np.int64 and np.array_equal(got[k], want[k]), (k, got[k], want[k])
