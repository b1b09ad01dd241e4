"""Known-truth runs of a real tiny mixture-of-experts model: routing mismatch and routing replay.

    python -m kldiag.tools.truth_moe runs/moe            # every scenario, one run each under runs/moe/NAME
    from kldiag.tools.truth_moe import MOE_SCENARIOS, make_run
    make_run("runs/moe", MOE_SCENARIOS["moe_no_replay"])   # then kldiag analyze runs/moe

The model is transformers' Qwen3-MoE built from a config (no download): `layers` decoder layers, 8
experts, top-2, vocab 64, seeded weights. The trainer is that model in float32. The engine is the same
weights with each router's weight rounded to `router_bits` mantissa bits (fp8 e4m3 keeps 3), as a
low-precision router does, and its logits rounded to bf16 plus `engine_noise` * N(0, 1): tokens whose
router scores are near a tie go to other experts in the engine. The engine samples every completion
(autoregressively, from softmax of its logits); the trainer scores the sampled tokens (teacher forcing).

Routes are read with a forward hook on each layer's `mlp.gate` (transformers 5.x: the router returns
(logits, scores, indices); `indices` [B * S, k]). The route stored with a token is the route of the
position that produced its log-prob (the input position before it), so the engine's missing last row
(it never feeds the last sampled token) touches no recorded token. Replay forces the engine's indices in
the trainer's routers, as Miles' HF router replay does (radixark/miles@31f1ca96
`miles/backends/fsdp_utils/models/replay_routers.py`: linear, softmax, gather at the given experts,
renormalise).

The trainer's router margin (kldiag.analysis.reducers.route_margin) is recorded with each routed token: its chosen
experts' lowest router logit minus the others' highest, the minimum over layers (`--margins` prints its
median on the tokens routed differently and on the others, per run).

Scenarios (MOE_LIST): no replay (moe_routing_mismatch); replay applied (healthy, agreement 1); replay
configured but not applied on one layer (routing_replay_broken naming it); a dense model (no routing
cause); identical routing with engine logit noise (an engine mismatch, no routing cause).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from kldiag.analysis import AnalysisConfig, analyze
from kldiag.analysis.reducers.route_margin import RouteMarginReducer, summary
from kldiag.analysis.runtime.runner import reduced
from kldiag.diagnosis import diagnose
from kldiag.diagnosis.core import reducers as diagnosis_reducers
from kldiag.integrations.common.moe_capture import layer_margin, min_over_layers
from kldiag.record.recorder import Recorder
from kldiag.tools import truth as T
from kldiag.tools.truth import Expect, bf16


@dataclass(frozen=True)
class MoeScenario:
    """One tiny-MoE run with a known truth (defaults: no replay, a low-precision engine router)."""

    name: str = "moe_no_replay"
    steps: int = 16
    seqs: int = 8  # completions per step
    prompt_len: int = 4
    completion_len: int = 20
    layers: int = 3
    experts: int = 8
    top_k: int = 2
    vocab: int = 64
    dense: bool = False  # every layer a dense MLP (no router)
    init_scale: float = 0.25  # std of the weights (transformers' initializer_range): a peaked policy
    router_bits: int | None = 3  # mantissa bits of the engine's router weights (None: the trainer's)
    engine_noise: float = 0.02  # std of the engine's logit noise on top of bf16 rounding
    replay: bool = False  # the engine's routes forced in the trainer's routers
    replay_skip_layer: int | None = None  # ... except on this layer (replay configured, not applied there)
    routing_replay: Any = None  # the manifest's config["routing_replay"]
    seed: int = 0
    verdict: str = "healthy"
    expect: tuple[Expect, ...] = ()
    layer: int | None = None  # the layer a routing_replay_broken cause must name first


def _s(name: str, verdict: str = "healthy", expect: tuple[Expect, ...] = (), **kw: Any) -> MoeScenario:
    return replace(MoeScenario(), name=name, verdict=verdict, expect=expect, **kw)


MOE_LIST: tuple[MoeScenario, ...] = (
    _s("moe_no_replay", "warning", (Expect("moe_routing_mismatch", 0, 2),)),
    _s("moe_replay", replay=True, routing_replay="R3"),
    _s("moe_replay_broken_layer1", "unstable", (Expect("routing_replay_broken", 0, 2),), replay=True,
       replay_skip_layer=1, routing_replay="R3", layer=1),
    _s("moe_dense", dense=True, router_bits=None),
    _s("moe_same_routes_logit_noise", "warning", (Expect("engine_mismatch", 0, 2),), router_bits=None,
       engine_noise=0.4),
)
MOE_SCENARIOS: dict[str, MoeScenario] = {s.name: s for s in MOE_LIST}


def round_mantissa(w: Any, bits: int) -> Any:
    """w rounded to `bits` mantissa bits (round to nearest; exponent range kept): a low-precision weight."""
    import torch

    m, e = torch.frexp(w)
    scale = float(2 ** (bits + 1))
    return torch.ldexp(torch.round(m * scale) / scale, e)


def build(sc: MoeScenario):
    """(trainer, engine) Qwen3-MoE models from a config, seeded; the engine's routers rounded."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(sc.seed)
    cfg = Qwen3MoeConfig(vocab_size=sc.vocab, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                         num_hidden_layers=sc.layers, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         num_experts=sc.experts, num_experts_per_tok=sc.top_k, norm_topk_prob=True,
                         initializer_range=sc.init_scale, max_position_embeddings=128,
                         mlp_only_layers=list(range(sc.layers)) if sc.dense else [])
    trainer = Qwen3MoeForCausalLM(cfg).eval()
    engine = copy.deepcopy(trainer)
    if sc.router_bits is not None:
        with torch.no_grad():
            for layer in engine.model.layers:
                gate = getattr(layer.mlp, "gate", None)
                if gate is not None:
                    gate.weight.copy_(round_mantissa(gate.weight, sc.router_bits))
    return trainer, engine


class Routes:
    """Forward hooks on every layer's `mlp.gate` keeping its indices; `forced` replays given indices."""

    def __init__(self, model: Any):
        self.gates = {i: l.mlp.gate for i, l in enumerate(model.model.layers) if hasattr(l.mlp, "gate")}
        self.layers = len(model.model.layers)
        self.seen: dict[int, Any] = {}
        self.logits: dict[int, Any] = {}
        self.forced: dict[int, Any] = {}
        for i, gate in self.gates.items():
            gate.register_forward_hook(lambda mod, args, out, i=i: self.seen.__setitem__(i, out[2]))
            gate.register_forward_hook(lambda mod, args, out, i=i: self.logits.__setitem__(i, out[0]))
            gate.forward = self._forward(gate, i)

    def _forward(self, gate: Any, i: int):
        import torch
        import torch.nn.functional as F

        native = gate.forward

        def forward(hidden):
            if i not in self.forced:
                return native(hidden)
            hidden = hidden.reshape(-1, gate.hidden_dim)
            logits = F.linear(hidden, gate.weight)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            idx = self.forced[i]
            top = probs.gather(1, idx)
            if gate.norm_topk_prob:
                top = top / top.sum(-1, keepdim=True)
            return logits, top.to(logits.dtype), idx

        return forward

    def margin(self, batch: int, seq: int) -> tuple[np.ndarray, np.ndarray] | None:
        """([B, S] float32, [B, S] int16) of the last forward: the minimum over layers of the router's margin
        (its chosen experts' lowest logit minus the others' highest) and the layer giving it; None when dense.
        Under replay the chosen experts are the forced ones: a negative margin is a token the replay moved."""

        layers = sorted(i for i in self.seen if i in self.logits)
        if not layers:
            return None
        low, at = min_over_layers([layer_margin(self.logits[i].double(), self.seen[i]) for i in layers], layers)
        return low.reshape(batch, seq).numpy(), at.reshape(batch, seq).numpy()

    def stacked(self, batch: int, seq: int, k: int) -> np.ndarray:
        """[B, S, L, k] of the last forward (-1 on layers without a router)."""
        out = np.full((batch, seq, self.layers, k), -1, np.int64)
        for i, idx in self.seen.items():
            out[:, :, i] = idx.reshape(batch, seq, k).numpy()
        return out


def _sample(sc: MoeScenario, engine: Any, routes: Routes, prompts: Any, rng: np.random.Generator):
    """Completions drawn from the engine: (ids [B, P + C], engine log-probs [B, C], engine routes [B, P+C, L, k])."""
    import torch

    ids = prompts
    for _ in range(sc.completion_len):
        logits = _engine_logits(sc, engine, ids, rng)[:, -1]
        p = torch.softmax(logits, -1)
        gen = torch.Generator().manual_seed(int(rng.integers(1 << 31)))
        ids = torch.cat([ids, torch.multinomial(p, 1, generator=gen)], 1)
    logits = _engine_logits(sc, engine, ids, rng)  # the engine's scores of what it sampled: one pass, as vLLM logs
    b, s = ids.shape
    return ids, logits, routes.stacked(b, s, sc.top_k)


def _engine_logits(sc: MoeScenario, engine: Any, ids: Any, rng: np.random.Generator) -> Any:
    import torch

    with torch.no_grad():
        z = engine(input_ids=ids).logits.double().numpy()
    z = bf16(z) + sc.engine_noise * rng.standard_normal(z.shape)
    return torch.from_numpy(z)


def _logp_of(logits: Any, ids: Any, start: int) -> np.ndarray:
    """log-softmax at positions start-1 .. S-2 of the tokens at start .. S-1: [B, S - start]."""
    import torch

    lp = torch.log_softmax(logits.double(), -1)[:, start - 1:-1]
    return lp.gather(-1, ids[:, start:, None])[..., 0].numpy()


def _aligned(routes: np.ndarray, start: int) -> np.ndarray:
    """The route of the position that produced each completion token's log-prob: [B, C, L, k]."""
    return routes[:, start - 1:-1]


def step_data(sc: MoeScenario, trainer: Any, engine: Any, r_t: Routes, r_e: Routes, step: int,
              rng: np.random.Generator) -> dict[str, np.ndarray]:
    """One step's completions: trainer and engine log-probs and routes of the completion tokens."""
    import torch

    prompts = torch.from_numpy(rng.integers(0, sc.vocab, (sc.seqs, sc.prompt_len)))
    ids, e_logits, e_routes = _sample(sc, engine, r_e, prompts, rng)
    r_t.forced = {}
    if sc.replay:  # the engine's routes of the scored sequence, forced in the trainer's routers
        flat = torch.from_numpy(e_routes)
        r_t.forced = {i: flat[:, :, i].reshape(-1, sc.top_k) for i in r_t.gates if i != sc.replay_skip_layer}
    with torch.no_grad():
        t_logits = trainer(input_ids=ids).logits
    t_routes = r_t.stacked(*ids.shape, sc.top_k)
    margin = r_t.margin(*ids.shape)
    start = sc.prompt_len
    logp = _logp_of(t_logits, ids, start)
    out = {"logp": logp, "logp_old": logp, "logp_sampler": _logp_of(e_logits, ids, start),
           "token_ids": ids[:, start:].numpy(), "experts": _aligned(t_routes, start),
           "experts_sampler": _aligned(e_routes, start)}
    if margin is not None:  # the trainer router's confidence at each completion token
        out["route_margin_trainer"], out["route_margin_layer"] = (_aligned(x, start) for x in margin)
    return out


def make_run(run_dir: str | Path, sc: MoeScenario) -> Path:
    """Write the scenario's run with kldiag.Recorder (one record() per step); returns run_dir.

    Runs torch on one thread meanwhile: a tiny model's forward is a few ms, and thread hand-offs on a busy
    machine made it 10x slower."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _write(run_dir, sc)
    finally:
        torch.set_num_threads(threads)


def _write(run_dir: str | Path, sc: MoeScenario) -> Path:
    trainer, engine = build(sc)
    r_t, r_e = Routes(trainer), Routes(engine)
    rng = np.random.default_rng(sc.seed)
    config = {"truth_scenario": sc.name, **({"routing_replay": sc.routing_replay} if sc.routing_replay else {})}
    with Recorder(run_dir, beta=0.0, estimator="k3", clip_range=(0.2, 0.28), trainer="plain", config=config,
                  tags=["kldiag.tools.truth_moe"]) as rec:
        for step in range(sc.steps):
            d = step_data(sc, trainer, engine, r_t, r_e, step, rng)
            routes = {} if sc.dense else {k: d[k] for k in ("experts", "experts_sampler", "route_margin_trainer",
                                                             "route_margin_layer") if k in d}
            rec.record(step=step, logp=d["logp"], logp_old=d["logp_old"], logp_sampler=d["logp_sampler"],
                       token_ids=d["token_ids"], group_ids=np.arange(sc.seqs) + step * sc.seqs, **routes)
    return Path(run_dir)


def run_and_diagnose(sc: MoeScenario, run_dir: str | Path):
    """make_run, analyze (with the diagnosis's reducers), diagnose: returns (Analysis, Diagnosis)."""
    make_run(run_dir, sc)
    a = analyze(run_dir, AnalysisConfig(), diagnosis_reducers())
    return a, diagnose(a)


def small(sc: MoeScenario) -> MoeScenario:
    """The scenario as the tests run it (already small: the truth suite's interface)."""
    return sc


def check(sc: MoeScenario, diagnosis) -> list[str]:
    """truth.check (verdict, causes, onsets), and the layer a routing_replay_broken cause must name first."""
    wrong = T.check(sc, diagnosis)
    if sc.layer is not None:
        broken = [c for c in diagnosis.causes if c.cause == "routing_replay_broken"]
        named = [r["layer"] for r in broken[0].evidence["layers"]] if broken else []
        if named[:1] != [sc.layer]:
            wrong.append(f"routing_replay_broken names layers {named}, expected {sc.layer} first")
    return wrong


SCENARIOS = MOE_SCENARIOS  # the truth suite's interface (bench/truth_table.py --moe)


def main(argv: list[str] | None = None) -> None:
    """python -m kldiag.tools.truth_moe OUT [--scenario NAME ...]: write the runs under OUT/NAME."""
    import argparse

    ap = argparse.ArgumentParser(description="write the tiny-MoE known-truth runs (kldiag/tools/truth_moe.py)")
    ap.add_argument("out", type=Path)
    ap.add_argument("--scenario", nargs="*", choices=list(MOE_SCENARIOS), help="default: all")
    ap.add_argument("--margins", action="store_true", help="print the trainer router's margins per run")
    args = ap.parse_args(argv)
    for name in args.scenario or list(MOE_SCENARIOS):
        print(make_run(args.out / name, MOE_SCENARIOS[name]))
        if args.margins:
            print("  " + margins_line(args.out / name))


def margins_line(run_dir: str | Path) -> str:
    """The trainer router's margin medians on flipped / kept / all tokens of a run, as one line."""

    m = summary(reduced(analyze(run_dir, AnalysisConfig()), RouteMarginReducer()))
    if not m["measured"]:
        return "router margin: not recorded (a dense model)"
    parts = [f"{g} {m[g]['tokens']} tokens, median {m[g]['median']:.4g}" for g in ("flipped", "kept", "all")
             if m[g]["median"] is not None]
    return "router margin: " + "; ".join(parts)


if __name__ == "__main__":
    main()
