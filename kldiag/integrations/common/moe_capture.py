"""Where a transformers MoE model decides its routes: the expert ids each MoE block dispatches on.

A block's routing decision is taken from what the block hands its experts, never recomputed from router
logits (DeepSeek-V3's and GLM4-MoE's sigmoid + score-correction bias + grouped top-k agrees with a plain
top-k of the logits on a few percent of pairs only). Four shapes cover the families transformers 5.25 ships
(read in `transformers/models/*/modeling_*.py`):

    experts_input    the experts module's forward takes the ids as its second argument
                     (`forward(hidden_states, top_k_index, top_k_weights)` under `@use_experts_implementation`,
                     gpt-oss's `router_indices`, ...): most families, hash-routed layers included (DeepSeek-V4's
                     `DeepseekV4HashRouter` ids reach the same experts call)
    dense_scores     a router that returns a [tokens, E] score matrix zero outside the chosen experts, which the
                     block multiplies into every expert's input (Llama4's `Llama4Router`): ids = its non-zeros
    sorted_dispatch  a gate that returns (index_sorted_experts, batch_index, gates, expert_size, logits) for
                     experts that take `expert_size` (JetMoE's `JetMoeTopKGating`): ids rebuilt from the sort
    embedding_ids    experts stored as an nn.Embedding indexed by the ids (Doge's `DogeCDMoE.down_embed`)

A layer is the index after the first ModuleList in a module's name (`model.layers.3.mlp.experts`,
`transformer.blocks.0.ffn.experts`, `h.5...`); L is that list's length. The routes are those of one layer
list, the first holding a routed block; MoE modules of any other list (a second tower) are listed as uncaptured.
A layer holds an MoE block when a module in it declares more than one expert (num_experts, num_local_experts,
n_routed_experts, moe_num_experts); `uncaptured` lists such layers that none of the shapes above covers.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import Any

INDEX_PARAMS = ("top_k_index", "router_indices", "selected_experts", "topk_indices", "topk_ids", "expert_indices",
                "routing_indices")
EXPERT_COUNT_ATTRS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
LAYER_RE = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")
# A layer with two routed blocks (JetMoE's mixture-of-attention beside its MoE MLP): the feed-forward one wins.
ATTENTION_RE = re.compile(r"attn|attention", re.IGNORECASE)


@dataclass
class Source:
    """One MoE block's routing decision: the module hooked and how its ids are read."""

    layer: int
    name: str
    module: Any
    kind: str  # experts_input | dense_scores | sorted_dispatch | embedding_ids
    param: tuple[str, int] | None = None  # experts_input: (parameter name, positional index after self)


@dataclass
class MoeLayout:
    """What `find_sources` found: sources per layer, the layer count, and the MoE layers left uncovered."""

    sources: dict[int, Source] = field(default_factory=dict)
    layers: int = 0
    uncaptured: dict[str, str] = field(default_factory=dict)  # module name -> class, MoE modules not covered

    @property
    def moe(self) -> bool:
        return bool(self.sources or self.uncaptured)


def index_param(module: Any) -> tuple[str, int] | None:
    """(name, position) of the expert-id parameter of `module`'s forward (after hidden_states), else None."""
    try:
        params = list(inspect.signature(type(module).forward).parameters)[1:]  # without self
    except (TypeError, ValueError):
        return None
    if len(params) >= 2 and params[1] in INDEX_PARAMS:
        return params[1], 1
    return None


def expert_count(module: Any) -> int:
    for attr in EXPERT_COUNT_ATTRS:
        value = getattr(module, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            return value
    return 0


def layer_of(name: str) -> tuple[str, int] | None:
    """(ModuleList path, index) of a module name: `model.layers.3.mlp` -> ("model.layers", 3)."""
    m = LAYER_RE.match(name)
    return None if m is None else (m.group(1), int(m.group(2)))


def _kind(name: str, module: Any, parent: Any, children: dict[str, Any]) -> tuple[str, Any] | None:
    """(kind, param) when `module` is where its block's routing decision can be read, else None."""
    import torch

    param = index_param(module)
    if param is not None:
        return "experts_input", param
    top_k, n = getattr(module, "top_k", None), expert_count(module)
    if isinstance(module, torch.nn.Embedding) and parent is not None and expert_count(parent) \
            and module.num_embeddings == expert_count(parent) and isinstance(getattr(parent, "top_k", None), int):
        first = next(c for c in children.values() if isinstance(c, torch.nn.Embedding))
        return ("embedding_ids", None) if first is module else None
    if not (isinstance(top_k, int) and n and parent is not None):
        return None
    siblings = [c for c in parent.children() if c is not module]
    if any("expert_size" in _params(c) for c in siblings):
        return "sorted_dispatch", None
    experts = getattr(parent, "experts", None)
    if experts is not None and expert_count(experts) and index_param(experts) is None and len(_params(experts)) == 1:
        return "dense_scores", None
    return None


def _params(module: Any) -> list[str]:
    try:
        return list(inspect.signature(type(module).forward).parameters)[1:]
    except (TypeError, ValueError):
        return []


def find_sources(model: Any) -> MoeLayout:
    """The routing decision of every MoE block of `model` (a torch module), by what the modules do."""
    modules = dict(model.named_modules())
    out = MoeLayout()
    moe_layers: dict[int, list[str]] = {}
    lists: dict[str, int] = {}
    unlayered: dict[str, str] = {}
    primary = None  # the layer list of the first routed block: MoE blocks of another list (a second tower) are named
    for name, module in modules.items():
        where = layer_of(name)
        parent_name = name.rpartition(".")[0]
        parent = modules.get(parent_name) if name else None
        kind = _kind(name, module, parent, dict(parent.named_children()) if parent is not None else {})
        if expert_count(module) or kind is not None:
            if where is not None and kind is not None and primary is None:
                primary = where[0]
            if where is None or where[0] != (primary or where[0]):
                unlayered[name] = type(module).__name__
                continue
            moe_layers.setdefault(where[1], []).append(name)
            lists.setdefault(where[0], len(modules[where[0]]) if hasattr(modules.get(where[0]), "__len__") else 0)
        if kind is not None:
            source = Source(where[1], name, module, kind[0], kind[1])
            held = out.sources.get(where[1])
            if held is None or (ATTENTION_RE.search(held.name) and not ATTENTION_RE.search(name)):
                out.sources[where[1]] = source
    # A container above the layers (the CausalLM's own num_experts, for its aux loss) is no block of its own.
    inside = [n for names in moe_layers.values() for n in names] + [n for n in unlayered if layer_of(n)]
    out.uncaptured.update({n or "<model>": c for n, c in unlayered.items()
                           if not any(m.startswith(n + ".") or not n for m in inside)})
    out.layers = max([*lists.values(), *(i + 1 for i in moe_layers)], default=0)
    for layer, names in moe_layers.items():
        if layer not in out.sources:
            out.uncaptured.update({n: type(modules[n]).__name__ for n in names if expert_count(modules[n])})
    return out


def ids_of(source: Source, args: tuple, kwargs: dict, output: Any) -> Any:
    """The [tokens, k] int64 expert ids one call of `source.module` dispatched on (a ValueError when the
    module's inputs or outputs do not have the shape its kind expects)."""
    import torch

    if source.kind == "experts_input":
        name, pos = source.param
        ids = kwargs[name] if name in kwargs else args[pos]
    elif source.kind == "embedding_ids":
        ids = args[0] if args else kwargs["input"]
    elif source.kind == "dense_scores":
        scores, k = output[0], int(source.module.top_k)
        ids = torch.topk(scores.detach().float(), k, dim=-1).indices
        if (scores.detach() != 0).sum(-1).max() > k:
            raise ValueError(f"{source.name}: more than top_k={k} non-zero router scores per token")
    elif source.kind == "sorted_dispatch":
        sorted_slots, expert_size = output[0], output[3]
        k = int(source.module.top_k)
        sizes = torch.as_tensor(expert_size, device=sorted_slots.device)
        experts = torch.repeat_interleave(torch.arange(len(sizes), device=sorted_slots.device), sizes)
        flat = torch.empty_like(sorted_slots)
        flat[sorted_slots] = experts
        ids = flat.reshape(-1, k)
    else:
        raise ValueError(f"unknown route source kind {source.kind!r}")
    ids = ids.detach()
    if ids.dim() == 1:
        ids = ids[:, None]
    return ids.reshape(-1, ids.shape[-1]).long()


def router_logits_modules(model: Any) -> dict[int, tuple[Any, int]]:
    """{layer: (module, output index)} of the modules the model itself declares as yielding its router
    logits (`_can_record_outputs["router_logits"]`, what `output_router_logits=True` returns)."""
    spec = None
    for module in model.modules():
        spec = (getattr(type(module), "_can_record_outputs", None) or {}).get("router_logits")
        if spec is not None:
            break
    if spec is None:
        return {}
    target = getattr(spec, "target_class", spec)
    index = int(getattr(spec, "index", 0) or 0)
    out = {}
    for name, module in model.named_modules():
        where = layer_of(name)
        if isinstance(target, type) and isinstance(module, target) and where is not None \
                and not ATTENTION_RE.search(name):
            out.setdefault(where[1], (module, index))
    return out


def layer_margin(logits: Any, ids: Any) -> Any:
    """[..., E] logits and [..., k] chosen ids -> [...] min(chosen logit) - max(other logit); NaN when every
    expert is chosen. For a plain top-k router this is the k-th minus the (k+1)-th largest logit."""
    import torch

    chosen = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, ids.clamp(min=0), True)
    low = logits.masked_fill(~chosen, float("inf")).amin(-1)
    high = logits.masked_fill(chosen, float("-inf")).amax(-1)
    out = low - high
    return out.where(out.isfinite(), torch.tensor(float("nan"), device=out.device))


def min_over_layers(margins: list[Any], layers: list[int]) -> tuple[Any, Any]:
    """([...] float32 minimum over the layers' margins, [...] int16 layer giving it): NaN layers left out;
    NaN and -1 where every layer is NaN."""
    import torch

    low, at = torch.stack(margins, -1).float().nan_to_num(nan=float("inf")).min(-1)
    found = low.isfinite()
    layer = torch.tensor(layers, device=at.device)[at]
    return low.where(found, torch.tensor(float("nan"), device=low.device)), layer.where(found, -1).to(torch.int16)


def describe(uncaptured: dict[str, str], limit: int = 6) -> str:
    """'layers 0, 1 (model.layers.N.mlp.experts: FooExperts, ...)' for a warning or a manifest."""
    layers, shapes, loose = set(), {}, []
    for name, cls in uncaptured.items():
        where = layer_of(name)
        if where is None:
            loose.append(f"{name} ({cls})")
            continue
        layers.add(where[1])
        shapes.setdefault(f"{where[0]}.N{name[len(where[0]) + 1 + len(str(where[1])):]}", cls)
    parts = []
    if layers:
        items = [f"{n}: {c}" for n, c in list(shapes.items())[:limit]]
        parts.append(f"layer{'s' if len(layers) > 1 else ''} {', '.join(map(str, sorted(layers)))} "
                     f"({', '.join(items)}{' ...' if len(shapes) > limit else ''})")
    return "; ".join(parts + loose[:limit])
