"""The crosswalk's null reasons name the real reason: a metric null because a step's log-probs are
NaN/inf says "non-finite inputs at step S (...)", for every framework, never that the run lacks a
column it recorded; a run that lacks the column still says so."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from kldiag import crosswalk as X
from kldiag.tools.synth import SynthConfig, make_run

SMALL = {"steps": 4, "seqs_per_step": 8, "seq_len": (6, 12), "micro_batches": 1, "vocab_size": 0}


def _with_value(run, step: int, column: str, value: float) -> None:
    """Set `column` of the first trained token of `step` to `value`, in place (a broken copy)."""
    for f in sorted(run.rglob("*.parquet")):
        if "tokens" not in f.parts:
            continue
        t = pq.read_table(f)
        d = t.to_pydict()
        hit = [i for i, (s, m) in enumerate(zip(d["step"], d["mask"], strict=True)) if s == step and m]
        if hit:
            d[column][hit[0]] = value
            pq.write_table(pa.table(d, schema=t.schema), f)
            return
    raise AssertionError(f"no trained token at step {step}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("xw_nonfinite")
    make_run(root / "bad", SynthConfig(**SMALL, nonfinite=((1, "logp"),)))
    _with_value(root / "bad", 2, "logp_ref", float("inf"))
    make_run(root / "noref", SynthConfig(**SMALL, reference=False))
    return root


@pytest.mark.parametrize("framework", list(X.FRAMEWORKS))
def test_null_at_a_nonfinite_step_says_so(runs, framework):
    """The run records logp_ref and logp_sampler: no reason may claim it lacks them; a null at the
    +inf step names it."""
    rows = X.records(X.crosswalk(runs / "bad", framework))
    for row in rows:
        for name, why in row.get("null_reasons", {}).items():
            assert "has no logp_ref" not in why and "has no logp_sampler" not in why, (row["step"], name, why)
            if why.startswith("non-finite"):
                assert row["step"] in (1, 2), (name, why)
    at2 = next(r for r in rows if r["step"] == 2).get("null_reasons", {})
    for why in at2.values():
        if why.startswith("non-finite"):
            assert why == "non-finite inputs at step 2 (logp_ref: 1 inf)", why


def test_trl_kl_reason_names_the_step_and_the_value(runs):
    table = X.crosswalk(runs / "bad", "trl")
    assert table.column("kl").to_pylist()[1:3] == [None, None]
    assert X.null_reasons(table)["kl"].startswith("non-finite inputs at steps 1, 2 (")
    rows = X.records(table)
    assert rows[1]["null_reasons"] == {"kl": "non-finite inputs at step 1 (logp: 1 NaN)"}
    assert rows[2]["null_reasons"] == {"kl": "non-finite inputs at step 2 (logp_ref: 1 inf)"}


def test_a_run_without_logp_ref_still_says_so(runs):
    table = X.crosswalk(runs / "noref", "trl")
    assert X.null_reasons(table)["kl"] == X.FRAMEWORKS["trl"].NO_REF


def test_nonfinite_inputs_counts_each_column_once():
    from kldiag.crosswalk.batch import StepBatch

    nan, inf = float("nan"), float("inf")
    mask = np.array([[True, True, False]])
    grid = lambda *v: np.array([v], dtype=np.float64)  # noqa: E731
    b = StepBatch(step=7, seq=np.zeros(1, np.int64), mask=mask, logp=grid(-1.0, nan, 0.0),
                  logp_old=grid(-1.0, nan, 0.0), logp_ref=grid(-1.0, -inf, 0.0), logp_sampler=grid(nan, nan, 0.0),
                  advantage=grid(1.0, 1.0, 0.0), micro=np.zeros(1, np.int64), iteration=np.zeros(1, np.int64))
    # logp_old equal to logp: not recorded; logp_sampler all NaN: not recorded
    assert X.nonfinite_inputs([b]) == "logp: 1 NaN; logp_ref: 1 inf"

