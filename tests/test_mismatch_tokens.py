"""The largest-mismatch and routed-differently tokens: against numpy, equal from one pass and from merged parts."""

from __future__ import annotations

import numpy as np

from kldiag.analysis import AnalysisConfig, analyze
from kldiag.analysis.reducers.mismatch_tokens import MismatchTokensReducer, select
from kldiag.analysis.runtime.runner import reduced
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
