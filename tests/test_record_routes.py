"""Format v1.3 MoE routes: the recorder's per-token comparison, the full lists on request, refused input."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

import kldiag
from kldiag import format as F
from kldiag.format import open_run
from kldiag.record import routes as RT

B, T, L, K = 2, 5, 3, 2
COLS = ["seq", "pos", "route_layers", "route_differ", "route_missing", "route_overlap", "route_differ_at",
        "route_missing_at", "experts", "experts_sampler"]


def _routes(seed: int = 0):
    rng = np.random.default_rng(seed)
    e = np.stack([rng.permutation(8)[:K] for _ in range(B * T * L)]).reshape(B, T, L, K)
    s = e.copy()
    s[0, 1, 2] = s[0, 1, 2, ::-1]  # the same set in another order: agrees
    s[1, 2, 0, 0] = next(v for v in range(8) if v not in e[1, 2, 0])  # one expert of two differs
    e[:, :, 1] = s[:, :, 1] = -1  # a dense layer
    s[:, -1] = -1  # the engine's missing last row
    return e, s


def test_compare_is_a_set_comparison():
    e, s = _routes()
    c = RT.compare(e, s)
    assert c["route_layers"].tolist() == [[2] * T] * B
    assert c["route_differ"][1, 2] == 1 and c["route_differ"].sum() == 1  # the swapped order agrees
    assert c["route_differ_at"][1, 2].tolist() == [True, False, False]
    assert c["route_missing"][:, -1].tolist() == [2, 2] and c["route_missing"][:, :-1].sum() == 0
    assert c["route_overlap"][1, 2] == pytest.approx((0.5 + 1.0) / 2)
    assert np.isnan(c["route_overlap"][:, -1]).all() and (c["route_overlap"][0] [:-1] == 1).all()


@pytest.mark.parametrize("full", [False, True])
def test_recorder_stores_the_summary_and_the_lists_when_asked(tmp_path, full):
    e, s = _routes()
    with kldiag.Recorder(tmp_path, full_routes=full) as rec:
        rec.record(step=0, logp=np.full((B, T), -0.5), experts=e, experts_sampler=s)
        rec.record(step=1, logp=np.full((B, T), -0.5))  # no routes: nulls, no cost
    run = open_run(tmp_path)
    assert run.manifest.format_version == F.FORMAT_VERSION == 1.3
    d = run.read(columns=COLS).to_pandas()
    first, second = d.iloc[:B * T], d.iloc[B * T:]
    assert first.route_differ.tolist() == [0] * 7 + [1] + [0] * 2
    assert list(first.route_differ_at.iloc[7]) == [0] and list(first.route_missing_at.iloc[4]) == [0, 2]
    assert second.route_layers.isna().all()
    if full:
        assert list(first.experts.iloc[0]) == e[0, 0].ravel().tolist()
        assert list(first.experts_sampler.iloc[9]) == [-1] * (L * K)
    else:
        assert first.experts.isna().all()
        names = {n for p in tmp_path.rglob("*.parquet") if "tokens" in p.parts for n in pq.read_schema(p).names}
        assert "route_differ" in names and "experts" not in names


def test_runs_without_routes_write_no_route_column(tmp_path):
    with kldiag.Recorder(tmp_path) as rec:
        rec.record(step=0, logp=np.full((B, T), -0.5))
    for path in tmp_path.rglob("*.parquet"):
        if "tokens" in path.parts:
            assert not set(F.ROUTE_COLUMNS) & set(pq.read_schema(path).names)


def test_bad_routes_are_refused_before_anything_is_queued(tmp_path):
    e, s = _routes()
    with kldiag.Recorder(tmp_path) as rec:
        rec.record(step=0, logp=np.full((B, T), -0.5), experts=e, experts_sampler=s)
        bad = [({"experts": e[:, :4]}, r"experts has shape \(2, 4, 3, 2\), but logp has shape \(2, 5\); pass "
                 r"experts with shape \(2, 5, L, k\)"),
               ({"experts": e, "experts_sampler": s[..., :1]}, r"same layers L and top-k"),
               ({"experts": e, "experts_sampler": s[:, :, :2]}, r"same layers L and top-k"),
               ({"experts": e - 2}, r"expert id -3; pass ids in \[0, 32767\], -1 where"),
               ({"experts_sampler": s.astype(float)}, r"integer expert ids")]
        for kwargs, message in bad:
            with pytest.raises(ValueError, match=message):
                rec.record(step=1, logp=np.full((B, T), -0.5), **kwargs)
        assert rec._queued == 1
    d = open_run(tmp_path).read(columns=["step", "route_differ"]).to_pandas()
    assert d.step.tolist() == [0] * (B * T) and d.route_differ.sum() == 1


def test_torch_routes_on_the_training_thread(tmp_path):
    torch = pytest.importorskip("torch")
    e, s = _routes()
    with kldiag.Recorder(tmp_path) as rec:
        rec.record(step=0, logp=torch.full((B, T), -0.5), experts=torch.from_numpy(e),
                   experts_sampler=torch.from_numpy(s).to(torch.int16))
        with pytest.raises(ValueError, match="integer expert ids"):
            rec.record(step=0, logp=torch.full((B, T), -0.5), experts=torch.from_numpy(e).float())
    assert open_run(tmp_path).read(columns=["route_differ"]).to_pandas().route_differ.sum() == 1
