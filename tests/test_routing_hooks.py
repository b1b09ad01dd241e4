"""The engine's routes from verl's and slime's batches (format v1.3 `experts_sampler`), and the replay mode
the hooks write to the manifest (config["routing_replay"])."""

from __future__ import annotations

import numpy as np
import pytest

import kldiag
from kldiag.importers.sink import Sequence, pack
from kldiag.importers.slime import response_routes


def test_slime_rollout_routed_experts_are_the_response_rows(tmp_path):
    n_tokens, n, layers, k = 9, 4, 3, 2
    routes = np.arange((n_tokens - 1) * layers * k).reshape(n_tokens - 1, layers, k)  # [T - 1, L, k]
    got = response_routes(routes, n)
    # response token j sits at n_tokens - n + j; its log-prob comes from the position before it
    assert np.array_equal(got, routes[n_tokens - n - 1:n_tokens - 1])
    assert response_routes(None, n) is None and response_routes(routes[:2], n) is None
    seqs = [Sequence(step=0, rank=0, seq=0, logp=np.full(n, -0.5), mask=np.ones(n, bool), experts_sampler=got),
            Sequence(step=0, rank=0, seq=1, logp=np.full(2, -0.5), mask=np.ones(2, bool))]
    args = pack(seqs)
    assert args["experts_sampler"].shape == (2, n, layers, k) and (args["experts_sampler"][1] == -1).all()
    with kldiag.Recorder(tmp_path, full_routes=True) as rec:
        rec.record(step=0, **{("advantages" if a == "advantage" else a): v for a, v in args.items()})
    t = kldiag.open_run(tmp_path).read(["seq", "pos", "experts_sampler"]).to_pandas()
    assert list(t.experts_sampler.iloc[0]) == got[0].ravel().tolist()


def test_verl_engine_routes_and_replay_mode():
    torch = pytest.importorskip("torch")
    pytest.importorskip("verl")
    from kldiag.integrations import verl as kv

    b, p, r, layers, k = 2, 3, 4, 2, 2
    routed = torch.arange(b * (p + r) * layers * k, dtype=torch.int16).reshape(b, p + r, layers, k)
    got = kv.engine_routes(routed, r)
    assert got.dtype == torch.long and torch.equal(got, routed[:, p - 1:p + r - 1].long())
    actor = {"megatron": {"router_replay": {"mode": "R3"}}}
    assert kv.routing_replay(actor, {"enable_rollout_routing_replay": True}) == "R3"
    assert kv.routing_replay(actor, {"enable_rollout_routing_replay": False}) is None
    assert kv.routing_replay({"megatron": {"router_replay": {"mode": "R2"}}}) == "R2"
    assert kv.routing_replay({"megatron": {"router_replay": {"mode": "disabled"}}}) is None
    assert kv.routing_replay({}) is None


def test_verl_manifest_says_which_side_of_the_routes_it_records():
    pytest.importorskip("verl")
    from kldiag.integrations import verl as kv

    r3 = kv.settings({"megatron": {"router_replay": {"mode": "R3"}}}, rollout={"enable_rollout_routing_replay": True})
    assert r3["routes"]["captured"] == "engine" and "update's forward" in r3["routes"]["missing"]["trainer"]
    r2 = kv.settings({"megatron": {"router_replay": {"mode": "R2"}}})
    assert r2["routes"]["captured"] == "trainer" and "engine" in r2["routes"]["missing"]
    off = kv.settings({})
    assert off["routes"]["captured"] == "none" and set(off["routes"]["missing"]) == {"engine", "trainer"}


def test_verl_r2_routes_are_recorded_as_the_trainers(tmp_path):
    """Under R2, verl's `routed_experts` is the trainer's own old-log-prob record: the hook writes it as
    `experts` (the trainer's side), never as the engine's."""
    pytest.importorskip("torch")
    pytest.importorskip("verl")
    from kldiag.integrations import verl as kv

    kv.close()
    cfg = kv.settings({"megatron": {"router_replay": {"mode": "R2"}}})
    kv._recorder(None, None, str(tmp_path / "run"), cfg)
    assert kv.STATE.route_side == "experts"
    kv.close()
    kv._recorder(None, None, str(tmp_path / "run2"), kv.settings({}))
    assert kv.STATE.route_side == "experts_sampler"
    kv.close()
    assert kldiag.open_run(tmp_path / "run").manifest.config["routes"]["captured"] == "trainer"


def test_slime_manifest_says_which_side_of_the_routes_it_records():
    from pathlib import Path
    from types import SimpleNamespace

    from kldiag.integrations import slime as ks

    r3 = ks.routes_sides(SimpleNamespace(use_rollout_routing_replay=True))
    assert r3["captured"] == "none" and "fill_routing_replay" in r3["missing"]["engine"]
    assert "RoutingReplay" in r3["missing"]["trainer"]
    plain = ks.routes_sides(SimpleNamespace())
    assert plain["captured"] == "engine" and set(plain["missing"]) == {"trainer"}
    # the slime code the R3 claim rests on (golden excerpt, THUDM/slime@624b824a)
    golden = (Path(__file__).parent / "golden" / "slime_routing_replay_624b824a.txt").read_text()
    assert 'del rollout_data["rollout_routed_experts"]' in golden
    lines = [int(x.split(":")[0]) for x in golden.splitlines() if x[:1].isdigit()]
    fill_call = next(int(x.split(":")[0]) for x in golden.splitlines() if "self.fill_routing_replay(" in x)
    post_call = next(int(x.split(":")[0]) for x in golden.splitlines() if "self.rollout_data_postprocess(" in x)
    assert lines and fill_call < post_call
