"""The trainer's MoE routes during TRL's loss forward: forward hooks on every router, no extra forward.

transformers 5.x MoE models route each token through a `*TopKRouter` module per sparse layer
(`model.layers[i].mlp.gate`: Qwen3MoeTopKRouter, Qwen2MoeTopKRouter, MixtralTopKRouter, ...). Its forward
returns (router_logits, router_scores, router_indices), the indices [tokens, k] =
topk(softmax(logits), k) (transformers 5.24.0 `models/qwen3_moe/modeling_qwen3_moe.py`). While the capture
is open, a hook on each router keeps the indices of every chunk TRL scores
(`GRPOTrainer._get_per_token_logps_and_entropies` runs the model on `batch_size` rows at a time); `result`
gives the route of the position that predicts each completion token (hidden position -logits_to_keep - 1 + t,
as TRL's log-probs), [B, logits_to_keep, L, k] with L = the config's num_hidden_layers and -1 on dense layers.
"""

from __future__ import annotations

import inspect
import re
from typing import Any

LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def routers(model: Any) -> dict[int, Any]:
    """{layer index: router module} of a transformers MoE model (empty for a dense model)."""
    out = {}
    for name, module in model.named_modules():
        if type(module).__name__.endswith("TopKRouter"):
            m = LAYER_RE.search(name)
            if m is not None:
                out[int(m.group(1))] = module
    return out


class RoutesCapture:
    """Hooks on a model's routers for one scoring call; `result()` the routes of the completion tokens."""

    def __init__(self, model: Any, logits_to_keep: int):
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.layers, self.k = int(config.num_hidden_layers), int(config.num_experts_per_tok)
        self.keep = int(logits_to_keep)
        self.chunks: dict[int, list[Any]] = {}
        self.handles = [r.register_forward_hook(self._hook(i)) for i, r in routers(model).items()]

    @classmethod
    def around(cls, trainer: Any, method: Any, args: tuple, kwargs: dict) -> RoutesCapture | None:
        """A capture for one call of trainer._get_per_token_logps_and_entropies(*args, **kwargs); None for a
        model without routers."""
        bound = inspect.signature(method).bind(*args, **kwargs).arguments
        model = trainer.accelerator.unwrap_model(bound["model"])
        model = model.get_base_model() if hasattr(model, "get_base_model") else model
        if not routers(model):
            return None
        cap = cls(model, bound["logits_to_keep"])
        cap.shape = tuple(bound["input_ids"].shape)
        return cap

    def _hook(self, layer: int):
        def hook(module, args, output) -> None:
            self.chunks.setdefault(layer, []).append(output[2].detach())
        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()

    def result(self) -> Any:
        """[B, logits_to_keep, L, k] int64 on the routes' device (-1 on dense layers)."""
        import torch

        b, s = self.shape
        first = next(iter(self.chunks.values()))[0]
        out = torch.full((b, self.keep, self.layers, self.k), -1, dtype=torch.long, device=first.device)
        for layer, parts in self.chunks.items():
            idx = torch.cat(parts).reshape(b, s, -1)
            out[:, :, layer, : idx.shape[-1]] = idx[:, s - self.keep - 1: s - 1]
        return out
