"""What a verl micro-batch carries besides the log-probs, as kldiag's columns: stable sequence and group
ids hashed on the device (no host sync on verl's nested layout), the engine's MoE routes and the weight
version of each sequence (verl 0.9.1 batch keys; kldiag.integrations.verl records them)."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from kldiag.integrations.common.ids import mix, row_hash


def non_tensor(data: Any, key: str) -> Any:
    from verl.utils import tensordict_utils as tu

    return tu.get_non_tensor_data(data=data, key=key, default=None) if key in data.keys() else None


def _ragged(x: Any, lengths: Any) -> tuple[Any, Any]:
    """(values, lengths) of a nested [B, j] tensor, or of a padded [B, T] one cut at `lengths`."""
    import torch

    if x.is_nested:
        return x.values(), x.offsets().diff()
    keep = torch.arange(x.shape[1], device=x.device)[None, :] < lengths[:, None]
    return x[keep], lengths  # boolean indexing: a sync, only on verl's padded (non-nested) layout


def policy_versions(data: Any, batch: int) -> np.ndarray | None:
    """[B] int64 policy_version (format v1.3) from the micro-batch's per-row `min_global_steps`, else None.

    verl 0.9.1 stamps each trajectory with `min_global_steps`, the weight version it started generating
    with (workers/rollout/llm_server.py), kept per row in the agent loop's non-tensor batch
    (experimental/agent_loop/agent_loop.py); its metric `trajectory_staleness_worst` is
    (global_steps - 1) - min_global_steps (trainer/ppo/v1/trainer_base.py). The recorded step is
    verl's global_steps, so policy_version = min_global_steps + 1 gives the same staleness."""
    if "min_global_steps" not in data.keys():
        return None
    v = non_tensor(data, "min_global_steps")
    v = v.tolist() if hasattr(v, "tolist") else v
    if not isinstance(v, (list, tuple)) or len(v) != batch or any(x is None for x in v):
        return None
    return np.asarray(v, dtype=np.int64) + 1


def sequence_ids(data: Any, lengths: Any) -> tuple[Any, Any]:
    """(seq, group) int64 [B]: see the module doc. lengths: [B] response lengths on the device."""
    import torch

    key = "input_ids" if "input_ids" in data.keys() else "responses"
    toks, tok_len = _ragged(data[key], lengths)
    old, old_len = _ragged(data["old_log_probs"], lengths)
    bits = old.detach().to(torch.float32).contiguous().view(torch.int32)
    seq = mix(row_hash(toks, tok_len) * 31 + row_hash(bits, old_len)) & ((1 << 62) - 1)
    uid = non_tensor(data, "uid") if "uid" in data.keys() else None
    uid = uid.tolist() if hasattr(uid, "tolist") else uid
    if isinstance(uid, (list, tuple)) and len(uid) == len(lengths):
        group = np.array([int.from_bytes(hashlib.blake2b(str(u).encode(), digest_size=8).digest(), "little")
                          & ((1 << 62) - 1) for u in uid], dtype=np.int64)
    elif "prompts" in data.keys() and data["prompts"].is_nested:
        p = data["prompts"]
        group = mix(row_hash(p.values(), p.offsets().diff())) & ((1 << 62) - 1)
    else:
        group = None
    return seq, group


def engine_routes(routed_experts: Any, response_len: int) -> Any:
    """The engine's routes of the response tokens' log-probs, [B, R, L, k] int64, from verl's batch key
    `routed_experts` [B, prompt_len + response_len, L, k] (int16, one row per input token at its absolute
    position, trailing rows zero; verl/experimental/agent_loop/agent_loop.py): response token j's log-prob
    comes from input position P + j - 1, so the rows [-R - 1, -1). Rows past a response's end read the
    zero padding; the mask keeps them out of every figure."""
    return routed_experts[:, -response_len - 1:-1].long()
