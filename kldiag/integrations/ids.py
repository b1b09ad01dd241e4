"""Stable sequence and group ids for the hooks of trainers that drop their sample ids (OpenRLHF, SkyRL, AReaL).

A sequence id is a hash of the sample's token ids and of the bits of its old log-probs: the same sample
keeps its id across PPO epochs, shuffles and micro-batches, and two samples with the same tokens (a GRPO
group's duplicates) differ by their log-probs. A group id is a hash of the prompt (text or token ids).
Hashed on the tensors' device (kldiag.integrations.verl_batch.row_hash), then one [B] int64 copy to the host.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

MASK62 = (1 << 62) - 1


def _ragged(x: Any, keep: Any) -> tuple[Any, Any]:
    """(values, lengths) of the kept entries of each row of a [B, T] tensor (keep: bool [B, T])."""
    return x[keep], keep.sum(-1)


def sequence_ids(tokens: Any, token_keep: Any, logp_old: Any, logp_keep: Any) -> np.ndarray:
    """int64 [B]: tokens [B, T] (kept where token_keep), logp_old [B, A] (kept where logp_keep)."""
    import torch

    from kldiag.integrations.verl_batch import row_hash

    with torch.no_grad():
        toks, tok_len = _ragged(tokens.to(torch.int64), token_keep.bool())
        bits = logp_old.detach().to(torch.float32).contiguous().view(torch.int32)
        old, old_len = _ragged(bits, logp_keep.bool())
        seq = (row_hash(toks, tok_len) * 31 + row_hash(old, old_len)) & MASK62
    return seq.cpu().numpy()


def text_ids(items: Any) -> np.ndarray | None:
    """int64 [B] hashes of per-sample strings (or token-id lists); None when there are none."""
    if items is None or len(items) == 0:
        return None
    return np.array([int.from_bytes(hashlib.blake2b(str(x).encode(), digest_size=8).digest(), "little") & MASK62
                     for x in items], dtype=np.int64)
