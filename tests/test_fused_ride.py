"""The Estimators page's reducer riding in the analysis's compiled pass (analysis/kernels/ride.py) gives the
partials the two give apart: the analysis's and the estimators' counts, maxima, histograms, kept rows and
token sample exactly, their sums to rounding (added in other chunks; the analysis's to a few ulp, see SUM_ULP)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from logp_batches import logp_columns

from kldiag.analysis import AnalysisConfig, analyze
from kldiag.analysis.core import stats
from kldiag.analysis.core.batch import Thresholds
from kldiag.analysis.core.partials import AnalysisReducer
from kldiag.analysis.pipeline import thresholds as run_thresholds
from kldiag.analysis.runtime import part_fold, runner
from kldiag.format import open_run, part_name, publish_part, rank_dir
from kldiag.tools.synth import SynthConfig, make_run
from kldiag.views import dashboard as VD
from kldiag.views import estimators as VE

# test_estimator_kernel's special values, -2000 for its -3e38: d of +-3e38 cancel in a sum to an order-dependent
# rounding error of 1e22 (to 1e-12 of the largest term); -2000 still overflows exp and expm1
SPECIAL = np.array([np.nan, np.inf, -np.inf, 0.5, 3.0, 0.0, -0.0, -1e-30, -80.0, -2000.0], np.float32)
SUMS = ("sum_", "value_sum/", "weight_abs_sum/", "weight_abs_flagged/", "k3_weight_lost")
# The analysis's sums come from one loop, fused.chunk_sums', in the ridden pass and in its own, and on the machine
# that built them they agree to the bit. But the two are two compiled loops, and their reductions are compiled
# with fastmath "reassoc" and "contract" for the host CPU (numba's target is the machine it runs on): LLVM may
# vectorise them with other widths or contract other products into FMAs on another instruction set. On an AMD
# EPYC the suite saw 1 ulp (relative 1.7e-16 to 3.6e-16 in sum_k2, sum_rho, sum_w, sum_k3_is, sum_mismatch);
# a few ulp is rounding, a wrong term is not (docs/scale.md, "What is bitwise reproducible").
SUM_ULP = 8


def assert_same(got: dict, want: dict, what: str, exact: bool = False) -> None:
    """Equal named arrays: exactly, sums (by name) to 1e-12 relative unless `exact` (the analysis's: its
    loop is fused.chunk_sums' own, its sums added in the same order: to SUM_ULP ulp, the rounding of
    another instruction set)."""
    assert list(got) == list(want), what
    for k in want:
        g, w = (np.concatenate(v) if isinstance(v, list) else np.asarray(v) for v in (got[k], want[k]))
        assert g.dtype == w.dtype and g.shape == w.shape, (what, k)
        is_sum = any(k.startswith(p) or f"/{p}" in f"/{k}" for p in SUMS) and g.dtype.kind == "f"
        if is_sum:
            rtol = SUM_ULP * np.finfo(g.dtype).eps if exact else 1e-12
            np.testing.assert_allclose(g, w, rtol=rtol, atol=1e-300, err_msg=f"{what} {k}")
        else:
            assert np.array_equal(g, w, equal_nan=g.dtype.kind == "f"), (what, k)


def full_batch(seed: int, n: int, absent: tuple[str, ...] = (), odd: float = 0.03, seq_len: int = 30,
               steps: int = 7) -> pa.RecordBatch:
    """Log-probs from ordinary to extreme, special values (NaN, +-inf, positive) at rate `odd` per column,
    nulls, mask holes, sequences of seq_len rows, `steps` sequences a step: every column the analysis reads."""
    cols = logp_columns(np.random.default_rng(seed), n, SPECIAL, odd, odd, absent)
    seq = np.arange(n) // seq_len
    ints = {"step": seq // steps, "seq": seq, "micro": np.zeros(n), "iteration": np.zeros(n), "group": seq // 4,
            "pos": np.arange(n) % seq_len, "token_id": (np.arange(n) * 7) % 1000}
    return pa.RecordBatch.from_pydict({**{k: pa.array(v.astype(np.int64)) for k, v in ints.items()}, **cols})


def thresholds(red: VE.EstimatorReducer) -> Thresholds:
    return Thresholds(red.tau, red.weight_limit, red.clamp, clip_low=0.2, clip_high=0.28, top_k=50)


def ridden(batch: pa.RecordBatch, red: VE.EstimatorReducer, seed: int):
    """(analysis BatchResult, estimator arrays) from the one ridden pass."""
    state = {"seed": seed, "parts": []}
    res = stats.batch_partials(batch, 3, thresholds(red), ride=red.ride(state))
    return res, state["parts"][0]


@pytest.mark.parametrize("seed", [0, 1, 3])
@pytest.mark.parametrize("absent", [(), ("logp_old",), ("logp_ref",), ("logp_old", "logp_sampler")])
@pytest.mark.parametrize("odd", [0.03, 0.0005])
def test_ridden_batch_equals_the_two_passes(seed, absent, odd):
    """Special values often (most chunks run the estimators' own loop) and rarely (most take the analysis's
    sums), sequences shorter and longer than a chunk."""
    batch = full_batch(seed, 6000, absent, odd, seq_len=[30, 700, 0, 257][seed])
    red = VE.EstimatorReducer(tau=[20.0, 5.0, 0, 100.0][seed], weight_limit=[10.0, 2.0, 0, 50.0][seed],
                              clamp=[10.0, 1.0, 0, 30.0][seed], sample_size=300)
    got_a, got_e = ridden(batch, red, seed)
    want_a = stats.batch_partials(batch, 3, thresholds(red))
    want_e = VE.batch_arrays(batch, red.config(), red.sample_size, seed)
    for t in ("steps", "seqs", "top", "bad"):
        assert_same(getattr(got_a, t), getattr(want_a, t), t, exact=True)
    assert_same(got_e, want_e, "estimators")
    assert want_e["tokens"][0] and want_e["flagged"][0] and want_e["clamp_saturated"][0] or "logp_ref" in absent


# ---- a run: parts read by the engine, cached, the two reducers together or apart ------------------------


@pytest.fixture(scope="module")
def odd_run(tmp_path_factory) -> Path:
    """2 ranks, 6 steps, 2 parts a rank; log-probs with NaN, +-inf, positive values and nulls scattered in,
    mask holes (what a dump holds), then published as the run's parts."""
    src, dst = tmp_path_factory.mktemp("ride") / "src", tmp_path_factory.mktemp("ride") / "run"
    make_run(src, SynthConfig(steps=6, seqs_per_step=8, seq_len=(5, 300), ranks=2, vocab_size=0))
    dst.mkdir()
    shutil.copy(src / "run.json", dst / "run.json")
    rng = np.random.default_rng(7)
    for part in open_run(src).parts():
        t = pq.read_table(part.path)
        for c, odd in (("logp", 0.002), ("logp_ref", 0.004), ("logp_old", 0.004), ("logp_sampler", 0.004)):
            v = t.column(c).to_numpy(zero_copy_only=False).astype(np.float32)
            hit = rng.random(len(v)) < odd
            v[hit] = rng.choice(SPECIAL, hit.sum())
            null = (rng.random(len(v)) < odd) & (c != "logp")
            t = t.set_column(t.schema.get_field_index(c), c, pa.array(v, t.schema.field(c).type, mask=null))
        mask = t.column("mask").to_numpy(zero_copy_only=False) & (rng.random(t.num_rows) > 0.05)
        t = t.set_column(t.schema.get_field_index("mask"), "mask", pa.array(mask))
        for i, start in enumerate((0, t.num_rows // 2)):
            chunk = t.slice(start, t.num_rows // 2 if i == 0 else None)
            step = chunk.column("step").to_numpy()
            publish_part(chunk, rank_dir(dst, part.rank), part_name(int(step[0]), int(step[-1]), i))
    return dst


def test_ridden_part_equals_each_reducer_alone(odd_run):
    """One part's fold of both (the estimators riding) equals each one's fold alone, on every part."""
    run = open_run(odd_run)
    cfg = AnalysisConfig()
    host, est = AnalysisReducer(run_thresholds(cfg, run.manifest)), VD.estimator_reducer(cfg)
    assert len(run.parts()) == 4 and len({p.rank for p in run.parts()}) == 2
    for part in run.parts():
        fold = part_fold.PartFold(part, [host, est])
        assert fold.carried == {1}
        both = part_fold.compute_part(part, [host, est], runner.KERNEL_ROWS)
        assert_same(both["analysis"], part_fold.compute_part(part, [host], runner.KERNEL_ROWS)["analysis"], "analysis",
                    exact=True)
        assert_same(both["estimators"], part_fold.compute_part(part, [est], runner.KERNEL_ROWS)["estimators"], "est")
        assert both["estimators"]["tokens"][0] > 1000 and both["estimators"]["flagged"][0] > 0


def test_other_thresholds_do_not_ride(odd_run):
    run = open_run(odd_run)
    host = AnalysisReducer(run_thresholds(AnalysisConfig(), run.manifest))
    est = VD.estimator_reducer(AnalysisConfig(clamp=3.0))
    assert part_fold.PartFold(run.parts()[0], [host, est]).carried == set()


def test_cache_serves_each_reducer_whichever_pass_made_it(odd_run, tmp_path):
    """A bare analyze then the dashboard's reducers (the estimators alone), or the two together: each partial
    cached under its own key, and every result the same (sums to rounding)."""
    one, two = tmp_path / "a", tmp_path / "b"
    shutil.copytree(odd_run, one)
    shutil.copytree(odd_run, two)
    est = [VD.estimator_reducer()]
    analyze(one, AnalysisConfig())
    first = analyze(one, AnalysisConfig(), est)  # the analysis from the cache, the estimators read alone
    together = analyze(two, AnalysisConfig(), est)  # riding
    again = analyze(two, AnalysisConfig(), est)  # both from the cache
    assert_same(first.reduced["estimators"], together.reduced["estimators"], "estimators")
    assert_same(again.reduced["estimators"], together.reduced["estimators"], "cached")
    pd.testing.assert_frame_equal(first.steps.to_pandas(), together.steps.to_pandas(), rtol=1e-12)
    assert len(list((two / ".kldiag" / "estimators").glob("*.part"))) == 4


def test_a_batch_the_analysis_sorts_or_an_empty_one_takes_the_estimators_own_pass():
    """Steps out of order (the analysis sorts the batch) or no rows: the estimators read the batch as stored,
    so their partial (the sample's token numbers, the per-batch seeds) is the standalone one exactly."""
    red = VE.EstimatorReducer(sample_size=100)
    batch = full_batch(5, 3000, odd=0.01)
    shuffled = batch.take(pa.array(np.r_[1500:3000, 0:1500]))
    for b in (shuffled, batch.slice(0, 0)):
        got_a, got_e = ridden(b, red, 4)
        assert_same(got_e, VE.batch_arrays(b, red.config(), red.sample_size, 4), "estimators", exact=True)
        want_a = stats.batch_partials(b, 3, thresholds(red))
        for t in ("steps", "seqs", "top", "bad"):
            assert_same(getattr(got_a, t), getattr(want_a, t), t, exact=True)
