"""The largest-mismatch and routed-differently tokens: against numpy, equal from one pass and from merged parts."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from kldiag.analysis import AnalysisConfig, analyze
from kldiag.analysis.kernels.mismatch_top import INF32, top_candidates
from kldiag.analysis.reducers.mismatch_tokens import KEYS, PREFIXES, MismatchTokensReducer, batch_rows, select
from kldiag.analysis.runtime.runner import reduced
from kldiag.format import ROUTE_DIFFER, ROUTE_LAYERS
from kldiag.record.routes import compare
from kldiag.tools.routing_runs import batches, write


def test_lists_equal_numpy(tmp_path):
    data = batches(gap=1.5)
    run = write(tmp_path / "run", data)
    red = MismatchTokensReducer(keep=20)
    got = red.result(reduced(analyze(run, AnalysisConfig(), [red]), red))
    mism, differ = [], []
    for d in data:
        m = d["mask"]
        mism.append((d["logp"] - d["logp_sampler"])[m])  # logp_old null: pi_old = pi_theta
        differ.append((compare(d["experts"], d["experts_sampler"])["route_differ"] > 0)[m])
    mism, differ = np.concatenate(mism), np.concatenate(differ)
    expect = np.sort(np.abs(mism))[::-1][:20]
    assert np.allclose(np.abs(got["largest"]["mismatch"]), expect, rtol=1e-6)
    assert np.allclose(np.abs(got["routed"]["mismatch"]), np.sort(np.abs(mism[differ]))[::-1][:20], rtol=1e-6)
    assert (got["routed"]["route_differ"] > 0).all() and (got["routed"]["route_layers"] > 0).all()


def test_select_is_order_free():
    rng = np.random.default_rng(0)
    rows = {"step": rng.integers(0, 5, 300), "iteration": np.zeros(300, np.int64), "seq": rng.integers(0, 9, 300),
            "pos": np.arange(300), "token_id": np.arange(300), "logp_old": np.zeros(300), "logp_sampler": np.zeros(300),
            "mismatch": np.round(rng.normal(size=300), 1), "route_differ": np.zeros(300, np.int64),
            "route_layers": np.zeros(300, np.int64)}
    whole = select([rows], 25)
    halves = select([select([{k: v[:150] for k, v in rows.items()}], 25),
                     select([{k: v[150:] for k, v in rows.items()}], 25)], 25)
    assert all(np.array_equal(whole[k], halves[k]) for k in whole)  # ties broken by key, not by arrival


def _batch(rng, n, start, routes=True, mu_null=False):
    """A record batch of n rows from row `start` with ties (sizes rounded), nulls and non-finite log-probs."""
    logp = -np.round(rng.exponential(0.5, n), 1).astype(np.float32)
    old = np.where(rng.random(n) < 0.3, np.nan, logp + np.round(rng.normal(0, 0.2, n), 1)).astype(np.float32)
    mu = (logp + np.round(rng.normal(0, 0.3, n), 1)).astype(np.float32)
    mu[rng.random(n) < 0.01] = -np.inf  # a token the engine gave no probability: |mismatch| inf
    null_mu = np.full(n, True) if mu_null else rng.random(n) < 0.05
    cols = {"step": pa.array(np.arange(start, start + n) // 50, pa.int64()),
            "iteration": pa.array(np.zeros(n, np.int16)), "seq": pa.array(np.arange(start, start + n) // 10),
            "pos": pa.array((np.arange(start, start + n) % 10).astype(np.int32)),
            "token_id": pa.array(rng.integers(0, 100, n).astype(np.int32)),
            "mask": pa.array(rng.random(n) < 0.8), "logp": pa.array(logp),
            "logp_old": pa.array(old, mask=np.isnan(old)), "logp_sampler": pa.array(mu, mask=null_mu)}
    if routes:
        differ = rng.integers(0, 3, n).astype(np.int16)
        cols[ROUTE_DIFFER] = pa.array(differ, mask=rng.random(n) < 0.1)
        cols[ROUTE_LAYERS] = pa.array(np.full(n, 4, np.int16))
    return pa.RecordBatch.from_pydict(cols)


def _reference(batches, keep):
    """select over every qualifying row of every batch (no candidate cut): what the reducer must equal."""
    got = {"w_": [], "r_": []}
    for b in batches:
        def col(name, fill, b=b):
            return pc.fill_null(b.column(name), fill).to_numpy(zero_copy_only=False)

        lp, o = b.column("logp").to_numpy(zero_copy_only=False), b.column("logp_old").to_numpy(zero_copy_only=False)
        mu = b.column("logp_sampler").to_numpy(zero_copy_only=False)
        old = np.where(np.isnan(o), lp, o)
        with np.errstate(invalid="ignore"):
            mism = old - mu
        has_routes = ROUTE_DIFFER in b.schema.names
        differ = col(ROUTE_DIFFER, 0).astype(np.int64) if has_routes else np.zeros(len(lp), np.int64)
        mask = col("mask", False)
        for p, keep_rows in (("w_", mask & np.isfinite(mism)), ("r_", mask & (differ > 0))):
            i = np.flatnonzero(keep_rows)
            row = {k: col(k, -1).astype(np.int64)[i] for k in KEYS}
            row.update(logp_old=old[i].astype(np.float64), logp_sampler=mu[i].astype(np.float64),
                       mismatch=mism[i].astype(np.float64), route_differ=differ[i],
                       route_layers=(col(ROUTE_LAYERS, 0).astype(np.int64)[i] if has_routes
                                     else np.zeros(len(i), np.int64)))
            got[p].append(row)
    return {f"{p}{k}": v for p in PREFIXES for k, v in select(got[p], keep).items()}


def _fold(red, batches):
    state = red.start(None)
    for b in batches:
        red.add(state, b)
    return red.finish(state, 0)


@pytest.mark.parametrize(("keep", "routes", "mu_null"), [(5, True, False), (40, True, False), (7, False, False),
                                                        (6, True, True)])
def test_compiled_cut_equals_every_row(keep, routes, mu_null):
    """The compiled candidate cut (thresholds carried across batches, ties and inf ranked as `select` ranks
    them) keeps exactly what a selection over every row keeps, bit for bit, NaN where NaN."""
    rng = np.random.default_rng(keep)
    batches = [_batch(rng, n, s, routes, mu_null) for n, s in ((3000, 0), (1, 3000), (5000, 3001), (700, 8001))]
    got, want = _fold(MismatchTokensReducer(keep=keep), batches), _reference(batches, keep)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
        assert got[k].dtype == want[k].dtype, k
    assert len(got["w_step"]) == (0 if mu_null else keep) and len(got["r_step"]) == (keep if routes else 0)
    if routes and not mu_null:  # the engine's -inf log-probs: |mismatch| inf, first among the routed, never "largest"
        assert np.isinf(got["r_mismatch"][:1]).all() and np.isfinite(got["w_mismatch"]).all()


def test_no_sampler_or_routes_skips_the_batch():
    rng = np.random.default_rng(1)
    b = _batch(rng, 500, 0, routes=False, mu_null=True)
    assert batch_rows(b, 5) == {}


def test_candidates_hold_the_top_with_ties():
    """top_candidates: ascending rows, a superset of every row at or above the keep-th largest size."""
    rng = np.random.default_rng(3)
    n, keep = 100_000, 30
    lp = np.round(rng.normal(-1, 1, n), 2).astype(np.float32)
    mu = (lp + np.round(rng.normal(0, 0.05, n), 2)).astype(np.float32)
    lo = np.where(rng.random(n) < 0.5, np.nan, lp).astype(np.float32)
    mask = rng.random(n) < 0.7
    rows_w, rows_r = top_candidates(mask, lp, lo, mu, np.zeros(0, np.int16), False, keep, 0.0, -1.0, INF32)
    size = np.where(mask, np.abs(np.where(np.isnan(lo), lp, lo) - mu), -1.0)
    kth = np.sort(size)[::-1][keep - 1]
    assert len(rows_r) == 0 and (np.diff(rows_w) > 0).all()
    assert set(np.flatnonzero(size >= kth)) <= set(rows_w.tolist()) and (size[rows_w] >= 0).all()
