"""Stable sequence and group ids for the hooks of trainers that drop their sample ids (OpenRLHF, SkyRL, AReaL).

A sequence id is a hash of the sample's token ids and of the bits of its old log-probs: the same sample
keeps its id across PPO epochs, shuffles and micro-batches, and two samples with the same tokens (a GRPO
group's duplicates) differ by their log-probs. A group id is a hash of the prompt (text or token ids).
Hashed on the tensors' device (kldiag.integrations.verl.batch.row_hash), then one [B] int64 copy to the host.
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


def mix(x: Any) -> Any:
    """splitmix64's finaliser on int64 tensors (wrapping arithmetic, logical shifts; any device)."""
    m1, m2 = -4658895280553007687, -7723592293110705685  # 0xBF58476D1CE4E5B9, 0x94D049BB133111EB as int64
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * m1
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * m2
    return x ^ ((x >> 31) & ((1 << 33) - 1))


_MULTIPLIERS: dict[Any, Any] = {}  # device -> int64 [n] random odd multipliers, one per position


def _multipliers(n: int, device: Any) -> Any:
    """Fixed (seeded) random odd int64 multipliers for positions 0..n-1 on `device`, grown on demand."""
    import torch

    m = _MULTIPLIERS.get(device)
    if m is None or m.shape[0] < n:
        size = max(n, 2 * (m.shape[0] if m is not None else 4096))
        g = torch.Generator().manual_seed(0x6B6C64)
        m = (torch.randint(-(1 << 62), 1 << 62, (size,), generator=g, dtype=torch.int64) * 2 + 1).to(device)
        _MULTIPLIERS[device] = m
    return m


def row_hash(values: Any, lengths: Any) -> Any:
    """int64 [B] hash of each row of a ragged int64 array (values [N], lengths [B]), on its device.

    sum_t (x_t + 1) * M_t (wrapping, M_t seeded random odd numbers) per row, then splitmix64's
    finaliser mixed with the length: three passes over the tokens, no host sync.
    """
    import torch

    b, n = lengths.shape[0], values.shape[0]
    starts = torch.zeros(n + 1, dtype=torch.int64, device=values.device)
    ends = torch.cumsum(lengths, 0)
    starts.index_add_(0, ends[:-1], torch.ones(b - 1 if b else 0, dtype=torch.int64, device=values.device))
    row = torch.cumsum(starts[:n], 0)
    t = torch.arange(n, device=values.device) - (ends - lengths)[row]
    h = (values.to(torch.int64) + 1) * _multipliers(max(n, 1), values.device)[t]  # n >= every length: no sync
    acc = torch.zeros(b, dtype=torch.int64, device=values.device).index_add_(0, row, h)
    return mix(acc ^ (lengths.to(torch.int64) * 0x9E3779B9))
