"""kldiag.analysis.reducers.route_margin: the trainer router's margins on flipped / kept tokens, written by the Recorder
(route_margin_trainer, route_margin_layer) and read back through the analysis; the histogram median against
numpy's exact one; merging partials equals one pass."""

from __future__ import annotations

import numpy as np
import pytest

import kldiag
from kldiag.analysis import AnalysisConfig, analyze
from kldiag.analysis.reducers.route_margin import (
    EDGES,
    RouteMarginReducer,
    batch_partial,
    hist_median,
    merge_partials,
    summary,
)
from kldiag.analysis.runtime.runner import reduced


def _routes(rng, b, t, flip, layers=3, k=2):
    """Trainer routes, and the engine's: the same but another set on layer 1 where `flip`."""
    trainer = np.stack([rng.permutation(8)[:k] for _ in range(b * t * layers)]).reshape(b, t, layers, k)
    engine = trainer.copy()
    for bi, ti in zip(*np.nonzero(flip), strict=True):
        engine[bi, ti, 1] = [e for e in range(8) if e not in trainer[bi, ti, 1]][:k]
    return trainer, engine


def test_recorded_margins_split_flipped_and_kept(tmp_path):
    rng = np.random.default_rng(0)
    b, t = 4, 50
    flip = rng.random((b, t)) < 0.2
    trainer, engine = _routes(rng, b, t, flip)
    margin = np.where(flip, rng.uniform(0.001, 0.01, (b, t)), rng.uniform(0.1, 1.0, (b, t))).astype(np.float32)
    layer = rng.integers(0, 3, (b, t)).astype(np.int16)
    margin[0, 0], layer[0, 0] = np.nan, -1  # not measured on this token
    with kldiag.Recorder(tmp_path) as rec:
        rec.record(step=0, logp=np.full((b, t), -1.0), logp_sampler=np.full((b, t), -1.1), experts=trainer,
                   experts_sampler=engine, route_margin_trainer=margin, route_margin_layer=layer)
    cols = kldiag.open_run(tmp_path).read(["route_margin_trainer", "route_margin_layer", "route_differ"]).to_pandas()
    assert cols.route_margin_trainer.isna().sum() == 1 and (cols.route_differ > 0).sum() == flip.sum()
    m = summary(reduced(analyze(tmp_path, AnalysisConfig()), RouteMarginReducer()))
    assert m["measured"] and m["all"]["tokens"] == b * t - 1
    assert m["flipped"]["tokens"] == flip.sum() - flip[0, 0]
    ok = ~np.isnan(margin)
    for group, sel in (("flipped", flip & ok), ("kept", ~flip & ok)):
        exact = float(np.median(margin[sel]))
        assert m[group]["median"] == pytest.approx(exact, rel=0.13)
        assert m[group]["mean"] == pytest.approx(float(margin[sel].astype(np.float64).mean()), rel=1e-6)
    assert [r["layer"] for r in m["by_layer"]] == [0, 1, 2]
    assert sum(r["tokens"] for r in m["by_layer"]) == b * t - 1


def test_merge_equals_one_pass_and_a_run_without_margins_measures_nothing():
    import pyarrow as pa

    rng = np.random.default_rng(1)
    x = np.concatenate([np.abs(rng.normal(0.0, 0.3, 180)), -np.abs(rng.normal(0.0, 0.1, 21))])  # 201 margins
    batch = pa.RecordBatch.from_pydict({"mask": np.ones(201, bool), "route_margin_trainer": x.astype(np.float32),
                                        "route_margin_layer": rng.integers(0, 4, 201).astype(np.int16)})
    whole = batch_partial(batch)
    parts = merge_partials([batch_partial(batch.slice(0, 70)), batch_partial(batch.slice(70))])
    for key in whole:
        assert np.array_equal(whole[key], parts[key]), key
    assert hist_median(whole["all_hist"]) == pytest.approx(float(np.median(x.astype(np.float32))), rel=0.13)
    empty = summary(merge_partials([]))
    assert not empty["measured"] and empty["flipped"]["median"] is None and empty["by_layer"] == []
    assert EDGES[0] < 0 < EDGES[-1]
