"""The trainer's MoE routes during TRL's loss forward: forward hooks on every MoE block, no extra forward.

Each MoE block's routing decision is read where the block dispatches on it (kldiag/integrations/common/moe_capture.py:
the ids its experts module receives, or the router output the block consumes), so biased, grouped and hash
routers are recorded as the block ran them, for every MoE family of transformers 5.x. While the capture is
open, a hook on each block keeps the ids of every chunk TRL scores (`GRPOTrainer._get_per_token_logps_and_entropies`
runs the model on `batch_size` rows at a time); `result` gives the route of the position that predicts each
completion token (hidden position -logits_to_keep - 1 + t, as TRL's log-probs), [B, logits_to_keep, L, k] with
L the length of the model's layer list, k the widest block's top-k and -1 on dense layers.

`margin` gives, per token, the router's confidence: for each layer whose router logits the model declares
(`_can_record_outputs["router_logits"]`), min over the chosen experts of the logit minus max over the others
(for a top-k router: the k-th minus the (k+1)-th largest logit; negative where the block's decision is not
the top-k of the raw logits, as with a score-correction bias or grouped top-k), and the minimum over layers.
"""

from __future__ import annotations

import inspect
from typing import Any

from kldiag.integrations.common.moe_capture import (
    MoeLayout,
    describe,
    find_sources,
    ids_of,
    layer_margin,
    min_over_layers,
    router_logits_modules,
)


def routers(model: Any) -> dict[int, Any]:
    """{layer index: the module whose call carries that layer's routing decision} (empty for a dense model)."""
    return {layer: s.module for layer, s in find_sources(model).sources.items()}


class RoutesCapture:
    """Hooks on a model's MoE blocks for one scoring call; `result()` the routes of the completion tokens."""

    def __init__(self, model: Any, logits_to_keep: int, layout: MoeLayout | None = None):
        self.layout = find_sources(model) if layout is None else layout
        self.layers = self.layout.layers
        self.keep = int(logits_to_keep)
        self.chunks: dict[int, list[Any]] = {}
        self.logits: dict[int, list[Any]] = {}
        self.handles = []
        for source in self.layout.sources.values():
            if source.kind in ("experts_input", "embedding_ids"):
                self.handles.append(source.module.register_forward_pre_hook(self._pre(source), with_kwargs=True))
            else:
                self.handles.append(source.module.register_forward_hook(self._post(source), with_kwargs=True))
        for layer, (module, index) in router_logits_modules(model).items():
            if layer in self.layout.sources:
                self.handles.append(module.register_forward_hook(self._logits(layer, index)))

    @classmethod
    def around(cls, trainer: Any, method: Any, args: tuple, kwargs: dict,
               layout: MoeLayout | None = None) -> RoutesCapture | None:
        """A capture for one call of trainer._get_per_token_logps_and_entropies(*args, **kwargs); None for a
        model without a capturable MoE block."""
        bound = inspect.signature(method).bind(*args, **kwargs).arguments
        model = unwrap(trainer, bound["model"])
        layout = find_sources(model) if layout is None else layout
        if not layout.sources:
            return None
        cap = cls(model, bound["logits_to_keep"], layout)
        cap.shape = tuple(bound["input_ids"].shape)
        return cap

    def _pre(self, source):
        def hook(module, args, kwargs) -> None:
            self.chunks.setdefault(source.layer, []).append(ids_of(source, args, kwargs, None))
        return hook

    def _post(self, source):
        def hook(module, args, kwargs, output) -> None:
            self.chunks.setdefault(source.layer, []).append(ids_of(source, args, kwargs, output))
        return hook

    def _logits(self, layer: int, index: int):
        def hook(module, args, output) -> None:
            out = output[index] if isinstance(output, (tuple, list)) else output
            self.logits.setdefault(layer, []).append(out.detach())
        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()

    def _per_layer(self, parts: list[Any], b: int, s: int) -> Any:
        import torch

        x = torch.cat([p.reshape(-1, p.shape[-1]) for p in parts])
        if x.shape[0] != b * s:
            raise ValueError(f"an MoE block saw {x.shape[0]} tokens in a forward of {b} x {s}; kldiag cannot place "
                             "its routes (a block called more or less than once per token)")
        return x.reshape(b, s, -1)[:, s - self.keep - 1: s - 1]

    def result(self) -> Any:
        """[B, logits_to_keep, L, k] int64 on the routes' device (-1 on dense layers)."""
        import torch

        b, s = self.shape
        per_layer = {layer: self._per_layer(parts, b, s) for layer, parts in self.chunks.items()}
        first = next(iter(per_layer.values()))
        k = max(x.shape[-1] for x in per_layer.values())
        out = torch.full((b, self.keep, self.layers, k), -1, dtype=torch.long, device=first.device)
        for layer, idx in per_layer.items():
            out[:, :, layer, : idx.shape[-1]] = idx
        return out

    def margin(self) -> tuple[Any, Any] | None:
        """([B, logits_to_keep] float32, [B, logits_to_keep] int16): the minimum over layers of the router's
        logit margin (module docstring) and the layer giving it; None when the model declares no router
        logits for its routed layers. NaN (layer -1) where no layer has one."""
        b, s = self.shape
        margins, layers = [], []
        for layer, parts in self.logits.items():
            if layer not in self.chunks or sum(p.numel() // p.shape[-1] for p in parts) != b * s:
                continue  # not one row of logits per token (Doge's product keys)
            logits = self._per_layer(parts, b, s).float()
            ids = self._per_layer(self.chunks[layer], b, s)
            if logits.shape[-1] <= int(ids.max()):  # not one logit per expert (Doge's product keys)
                continue
            margins.append(layer_margin(logits, ids))
            layers.append(layer)
        return min_over_layers(margins, layers) if margins else None


def unwrap(trainer: Any, model: Any) -> Any:
    """The plain transformers model behind the trainer's (accelerate, PEFT) wrappers."""
    model = trainer.accelerator.unwrap_model(model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def routes_config(layout: MoeLayout | None, engine_missing: str) -> tuple[dict[str, Any], str | None]:
    """(manifest config["routes"], the attach warning or None) for a policy's MoE layout.

    config["routes"]: {"captured": "trainer" | "none", "missing": {side: why}, "uncaptured": {module: class}};
    `engine_missing` says why the engine's side is not recorded by this hook."""
    if layout is None:
        return {"captured": "none", "missing": {"trainer": "kldiag could not inspect the policy's modules",
                                                "engine": engine_missing}}, None
    if not layout.moe:
        return {"captured": "none", "missing": {"trainer": "the policy has no MoE layer",
                                                "engine": "the policy has no MoE layer"}}, None
    out: dict[str, Any] = {"captured": "trainer" if layout.sources else "none", "missing": {"engine": engine_missing}}
    if not layout.uncaptured:
        return out, None
    out["uncaptured"] = dict(layout.uncaptured)
    what = describe(layout.uncaptured)
    if not layout.sources:
        out["missing"]["trainer"] = f"no MoE block of a shape kldiag reads: {what}"
    else:
        out["missing"]["trainer_layers"] = f"MoE modules of a shape kldiag does not read: {what}"
    warning = (f"kldiag: the policy has MoE layers whose routes kldiag cannot capture: {what}. Their routes are "
               "not recorded (no `experts` for them, routing analysis without them; the manifest's "
               "config['routes'] says so). Pass the routes to Recorder.record(experts=...) yourself, or report "
               "the model class to kldiag.")
    return out, warning
