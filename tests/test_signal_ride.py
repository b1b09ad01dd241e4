"""The learning-signal reducer riding in the analysis's compiled pass beside the Estimators page's
(analysis/kernels/ride.py, signal_kernel.ride_sums): each batch's rows equal its own pass's, keys and counts
exactly and sums to rounding; a batch it cannot read there (a null, a sequence of two groups, a batch the
analysis sorts, no pi_ref or advantage, no estimators riding) goes to its own pass, exactly."""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from logp_batches import logp_columns

from kldiag.analysis import AnalysisConfig
from kldiag.analysis.core import stats
from kldiag.analysis.core.batch import Thresholds
from kldiag.analysis.core.partials import AnalysisReducer
from kldiag.analysis.pipeline import thresholds as run_thresholds
from kldiag.analysis.reducers.signal import SignalReducer
from kldiag.analysis.runtime import part_fold, runner
from kldiag.format import open_run
from kldiag.tools.synth import SynthConfig, make_run
from kldiag.views import dashboard as VD
from kldiag.views import estimators as VE

SPECIAL = np.array([np.nan, np.inf, -np.inf, 0.5, 3.0, 0.0, -0.0, -1e-30, -80.0, -2000.0], np.float32)
# Sums over other chunks, in another order, and exp(-d) as 1 + expm1(-d) (ride_sums): rounding, not a wrong term
RTOL = 1e-12


def signal_batch(seed: int, n: int, odd: float, nulls: float = 0.0, seq_len: int = 37) -> pa.RecordBatch:
    """Log-probs with special values at rate `odd` (values, not nulls), nulls at rate `nulls`, NaN advantages,
    mask holes; four sequences a group, five a step."""
    rng = np.random.default_rng(seed)
    cols = logp_columns(rng, n, SPECIAL, odd, nulls)
    if not nulls:
        cols["mask"] = pa.array(np.asarray(cols["mask"].fill_null(False)))
    seq = np.arange(n) // seq_len
    ints = {"step": seq // 5, "seq": seq, "group": seq // 4, "pos": np.arange(n) % seq_len, "micro": np.zeros(n),
            "iteration": np.zeros(n), "token_id": np.arange(n) % 100}
    return pa.RecordBatch.from_pydict({**{k: pa.array(v.astype(np.int64)) for k, v in ints.items()}, **cols})


def ridden(batch: pa.RecordBatch, with_estimators: bool = True) -> tuple[dict | None, int]:
    """(the signal's partial of the batch from the ridden pass, how many batches it read alone)."""
    red, est = SignalReducer(), VE.EstimatorReducer(sample_size=100)
    th = Thresholds(est.tau, est.weight_limit, est.clamp, clip_low=0.2, clip_high=0.28, top_k=20)
    state, alone = [], []
    own = red.ride(state)
    ride = dataclasses.replace(own, alone=lambda b: (alone.append(1), own.alone(b)))
    stats.batch_partials(batch, 0, th, ride=est.ride({"seed": 0, "parts": []}) if with_estimators else None,
                         signal=ride)
    return (state[0] if state else None), len(alone)


def assert_rows(got: dict | None, want: dict | None, exact: bool = False) -> None:
    assert (got is None) == (want is None)
    if want is None:
        return
    assert list(got) == list(want)
    for k, w in want.items():
        g = got[k]
        assert g.dtype == w.dtype and g.shape == w.shape, k
        if g.dtype.kind == "f" and not exact:
            np.testing.assert_allclose(g, w, rtol=RTOL, atol=1e-300, err_msg=k)
        else:
            assert np.array_equal(g, w, equal_nan=g.dtype.kind == "f"), k


@pytest.mark.parametrize("odd", [0.0, 0.001, 0.03])
@pytest.mark.parametrize("seq_len", [37, 700])
def test_ridden_rows_equal_the_signals_own_pass(odd, seq_len):
    """Special values never, in a few chunks (their rows summed by run_sums) and in most; sequences shorter and
    longer than a chunk."""
    batch = signal_batch(int(odd * 1000) + seq_len, 9000, odd, seq_len=seq_len)
    got, n_alone = ridden(batch)
    want = SignalReducer().partial(batch)
    assert n_alone == 0 and len(want["step"]) > 10
    assert_rows(got, want)
    assert want["n_kl_alone"].sum() == 0 or odd > 0  # |A| <= tol only by chance of a special value
    assert np.isfinite(want["sum_w_kl_rev"]).all() and want["sum_w_k3_is"].max() > 0


def test_the_estimators_partial_is_unchanged_by_a_rider():
    batch = signal_batch(5, 6000, 0.01)
    est, th = VE.EstimatorReducer(sample_size=100), Thresholds(10.0, 10.0, 10.0, 0.2, 0.28, 20)
    alone, both = {"seed": 0, "parts": []}, {"seed": 0, "parts": []}
    want = stats.batch_partials(batch, 0, th, ride=est.ride(alone))
    got = stats.batch_partials(batch, 0, th, ride=est.ride(both), signal=SignalReducer().ride([]))
    for k, w in alone["parts"][0].items():
        assert np.array_equal(both["parts"][0][k], w, equal_nan=True), k
    for t in ("steps", "seqs"):
        for k, w in getattr(want, t).items():
            assert np.array_equal(getattr(got, t)[k], w, equal_nan=True), (t, k)


def _two_groups(b: pa.RecordBatch) -> pa.RecordBatch:
    group = b.column("group").to_numpy().copy()
    group[5] += 1  # the first sequence holds two groups
    return b.set_column(b.schema.get_field_index("group"), "group", pa.array(group))


@pytest.mark.parametrize("case", ["nulls", "two groups", "sorted", "empty", "no ref", "no advantage",
                                  "no estimators"])
def test_a_batch_the_ride_cannot_read_takes_the_signals_own_pass(case):
    b = signal_batch(9, 3000, 0.01, nulls=0.05 if case == "nulls" else 0.0)
    if case == "two groups":
        b = _two_groups(b)
    elif case == "sorted":
        b = b.take(pa.array(np.r_[1500:3000, 0:1500]))
    elif case == "empty":
        b = b.slice(0, 0)
    elif case in ("no ref", "no advantage"):
        name = "logp_ref" if case == "no ref" else "advantage"  # a column the writer never filled: all null
        i = b.schema.get_field_index(name)
        b = b.set_column(i, name, pa.nulls(b.num_rows, b.schema.field(i).type))
    got, n_alone = ridden(b, with_estimators=case != "no estimators")
    assert n_alone == 1
    assert_rows(got, SignalReducer().partial(b) if b.num_rows else None, exact=True)


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    """A run without nulls (the signal rides on every batch), a few special values."""
    src, dst = tmp_path_factory.mktemp("sig") / "src", tmp_path_factory.mktemp("sig") / "run"
    make_run(src, SynthConfig(steps=5, seqs_per_step=8, seq_len=(5, 400), ranks=1, vocab_size=0))
    shutil.copytree(src, dst)
    rng = np.random.default_rng(3)
    for part in open_run(dst).parts():
        t = pq.read_table(part.path)
        v = t.column("logp_ref").to_numpy(zero_copy_only=False).astype(np.float32)
        hit = rng.random(len(v)) < 0.002
        v[hit] = rng.choice(SPECIAL, hit.sum())
        t = t.set_column(t.schema.get_field_index("logp_ref"), "logp_ref", pa.array(v, t.schema.field("logp_ref").type))
        pq.write_table(t, part.path)
    return dst


def test_the_dashboards_first_pass_carries_the_signal_and_gives_its_rows(clean_run):
    run = open_run(clean_run)
    cfg = AnalysisConfig()
    host = AnalysisReducer(run_thresholds(cfg, run.manifest))
    first = [host, *(runner.bound(r, run.parts()) for r in VD.reducers())]
    names = [r.name for r in first]
    sig = first[names.index("signal")]
    for part in run.parts():
        fold = part_fold.PartFold(part, first)
        assert {names.index("signal"), names.index("estimators")} <= fold.carried
        got = part_fold.compute_part(part, first, runner.KERNEL_ROWS)["signal"]
        want = part_fold.compute_part(part, [sig], runner.KERNEL_ROWS)["signal"]
        assert_rows(got, want)
        assert got["n_tokens"].sum() > 100


@pytest.mark.parametrize("group", ["recorded", "null", "absent"])
def test_the_ridden_inputs_are_read_only_whatever_the_group_column_holds(group):
    """One compiled variant of the ridden pass for every run: numba compiles one per writeable flag."""
    from kldiag.analysis.reducers.signal import ride_inputs

    b = signal_batch(1, 100, 0.0)
    if group != "recorded":
        b = b.drop_columns(["group"]) if group == "absent" else b.set_column(
            b.schema.get_field_index("group"), "group", pa.nulls(b.num_rows, pa.int64()))
    g, ok = ride_inputs(b)
    assert g.dtype == np.int64 and not g.flags.writeable and not ok.flags.writeable and ok.all()
    assert (g == -1).all() if group != "recorded" else (g == b.column("group").to_numpy()).all()


def test_the_ridden_pass_is_compiled_once_with_or_without_the_signal():
    """The signal's arrays when it does not ride have the types (read-only) of those when it does, and a batch's null
    masks are read-only whether it holds nulls or not: one variant of the pass (each costs a compile)."""
    from kldiag.analysis.kernels import ride as R

    before = len(R.fused_pass_est.signatures)
    ridden(signal_batch(2, 500, 0.0))
    ridden(signal_batch(3, 500, 0.0, nulls=0.05))  # cannot ride: the pass without the signal's rows
    b = signal_batch(4, 500, 0.0)
    ridden(b.set_column(b.schema.get_field_index("group"), "group", pa.nulls(b.num_rows, pa.int64())))
    assert len(R.fused_pass_est.signatures) - before <= 1
