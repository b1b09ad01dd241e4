"""MoE routes (format v1.3): the trainer's and the engine's expert ids per token and layer, compared as sets.

record(experts=[B, T, L, k], experts_sampler=[B, T, L, k]) gives, per token and layer, the k expert ids
each side routed the token to; -1 where the token has no route (a dense layer, the engine's missing last
row, padding). Engines may list a token's experts in another order than the trainer (SGLang's biased
top-k is unsorted, Megatron's sorted: THUDM/slime@624b824a `slime/utils/routing_replay.py`), so the two
sides are compared as sets. What is stored per token (docs/format.md, "MoE routing"):

    route_layers      layers the trainer routed (any id >= 0)
    route_differ      of those, layers where the engine routed too and its expert set differs
    route_missing     of those, layers where the engine has no route (all -1)
    route_overlap     mean over the compared layers of |trainer set & engine set| / max(set sizes)
    route_differ_at   which layers differ; route_missing_at: which are missing (bool [L] here, lists on disk)
    experts, experts_sampler   the full [L * k] lists, only with RecorderConfig(full_routes=True)

Runs in the writer thread (rows.host_columns): the training thread only validates and copies.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kldiag import format as F
from kldiag.format import ROUTE_ARGS

ID_MAX = np.iinfo(np.int16).max  # ids are stored as int16 (the largest MoE has a few hundred experts)


def check_ids(name: str, x: Any) -> None:
    """ValueError naming `name` unless every id is an integer in [-1, 32767] (-1: no route).

    One reduction (and, for a device tensor, one device sync): paid only by runs that record routes."""
    if hasattr(x, "dtype") and hasattr(x, "aminmax"):  # torch
        if x.is_floating_point():
            raise ValueError(f"{name} has dtype {x.dtype}; pass integer expert ids (-1 where a token has no route)")
        if x.numel() == 0:
            return
        lo, hi = (int(v) for v in x.aminmax())
    else:
        a = np.asarray(x)
        if a.dtype.kind not in "iu":
            raise ValueError(f"{name} has dtype {a.dtype}; pass integer expert ids (-1 where a token has no route)")
        if a.size == 0:
            return
        lo, hi = int(a.min()), int(a.max())
    if lo < -1 or hi > ID_MAX:
        raise ValueError(f"{name} holds expert id {lo if lo < -1 else hi}; pass ids in [0, {ID_MAX}], "
                         "-1 where a token has no route (a dense layer, the engine's missing last row, padding)")


def compare(experts: np.ndarray, experts_sampler: np.ndarray) -> dict[str, np.ndarray]:
    """The per-token comparison of two [B, T, L, k] id arrays (-1: no route).

    Returns route_layers, route_differ, route_missing (int16 [B, T]), route_overlap (float32 [B, T],
    NaN where no layer is compared) and route_differ_at, route_missing_at (bool [B, T, L]). One layer
    at a time: the k x k comparison of a 48-layer, top-8 batch stays a few MB.
    """
    a, b = np.asarray(experts), np.asarray(experts_sampler)
    routed, engine = (a >= 0).any(-1), (b >= 0).any(-1)  # [B, T, L]
    both = routed & engine
    inter = np.zeros(routed.shape, np.int64)
    size = np.maximum((a >= 0).sum(-1), (b >= 0).sum(-1))
    for layer in range(a.shape[2]):
        al, bl = a[:, :, layer], b[:, :, layer]
        hit = (al[..., :, None] == bl[..., None, :]) & (al[..., :, None] >= 0)
        inter[:, :, layer] = hit.any(-1).sum(-1)
    differ = both & (inter < size)
    missing = routed & ~engine
    n_both = both.sum(-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        frac = np.where(both, inter / np.maximum(size, 1), 0.0).sum(-1) / n_both
    return {F.ROUTE_LAYERS: routed.sum(-1).astype(np.int16), F.ROUTE_DIFFER: differ.sum(-1).astype(np.int16),
            F.ROUTE_MISSING: missing.sum(-1).astype(np.int16),
            F.ROUTE_OVERLAP: np.where(n_both > 0, frac, np.nan).astype(np.float32),
            F.ROUTE_DIFFER_AT: differ, F.ROUTE_MISSING_AT: missing}


def summarize(columns: dict[str, np.ndarray], full: bool) -> dict[str, np.ndarray]:
    """`columns` with the [B, T, L, k] route inputs replaced by what is stored (module docstring).

    With both sides: the comparison; with the trainer's alone: route_layers. `full`: also the
    lists themselves, as [B, T, L * k] int16 (written as list<int16> columns).
    """
    if not any(name in columns for name in ROUTE_ARGS):
        return columns
    out = {k: v for k, v in columns.items() if k not in ROUTE_ARGS}
    given = {name: np.asarray(columns[name]) for name in ROUTE_ARGS if name in columns}
    if len(given) == 2:
        out.update(compare(given[F.EXPERTS], given[F.EXPERTS_SAMPLER]))
    elif F.EXPERTS in given:
        out[F.ROUTE_LAYERS] = (given[F.EXPERTS] >= 0).any(-1).sum(-1).astype(np.int16)
    if full:
        for name, x in given.items():
            out[name] = x.reshape(*x.shape[:2], -1).astype(np.int16)
    return out
