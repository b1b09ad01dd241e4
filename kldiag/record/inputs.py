"""What record() takes: its shapes checked, this process's rank, and the draw behind seq_fraction."""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np

from kldiag.format import EXPERTS, EXPERTS_SAMPLER, ROUTE_ARGS

TOKEN_ARGS = ("logp", "logp_old", "logp_ref", "logp_sampler", "entropy", "mask", "completion_mask", "token_ids",
              "turn", "route_margin_trainer", "route_margin_layer")  # v1.3 router margins: [B, T] too
ROW_ARGS = ("seq_ids", "group_ids")
TOPK_PAIRS = (("topk_ids", "topk_logp"), ("topk_ids_sampler", "topk_logp_sampler"))  # [B, T, K]: one K per side
# v1.3, per sequence [B]: the weight version that generated it (ints) and its task label (strings); the version
# may also be given per token [B, T] (a rollout that straddles weight updates: each token its generating version)
VERSION_ARGS = ("policy_version", "task")
PER_TOKEN_OK = ("policy_version",)


def seq_unit(seq: np.ndarray) -> np.ndarray:
    """splitmix64(seq) / 2**64 in [0, 1): the deterministic draw behind `seq_fraction`."""
    with np.errstate(over="ignore"):
        z = seq.astype(np.int64).view(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / 2.0**53


def detect_rank(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """(rank, world_size): arguments, else torch.distributed when initialised, else RANK/WORLD_SIZE."""
    r, w = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    torch = sys.modules.get("torch")  # never imported here: only asked when the trainer has it
    dist = getattr(torch, "distributed", None) if torch is not None else None
    if dist is not None and dist.is_available() and dist.is_initialized():
        r, w = dist.get_rank(), dist.get_world_size()
    r = r if rank is None else int(rank)
    w = w if world_size is None else int(world_size)
    if not 0 <= r < w:
        raise ValueError(f"rank {r} is outside world_size {w}; pass rank= and world_size= with 0 <= rank < world_size")
    return r, w


def shape_of(x: Any) -> tuple[int, ...]:
    return tuple(x.shape) if hasattr(x, "shape") else np.shape(x)


def check_shapes(args: dict[str, Any]) -> tuple[int, int]:
    """ValueError naming the argument and both shapes unless every array fits logp's [B, T]
    (top-k arrays: [B, T, K], ids and log-probs of one side with the same K; task: [B]; policy_version:
    [B] or [B, T]). In `args`, task becomes a [B] numpy str array and a list of versions an int64 array; a
    non-integer version or a non-string label is a ValueError too."""
    shape = shape_of(args["logp"])
    if len(shape) != 2:
        raise ValueError(f"logp has shape {shape}; pass one micro-batch as a [batch, time] array")
    for name, x in args.items():
        got = shape_of(x)
        if name in TOKEN_ARGS:
            want, ok = f"{shape}", got == shape
        elif name in PER_TOKEN_OK:
            want, ok = f"({shape[0]},) or {shape}", got in (shape[:1], shape)
        elif name in ROW_ARGS or name in VERSION_ARGS:
            want, ok = f"({shape[0]},)", got == shape[:1]
        elif name in ROUTE_ARGS:
            want = f"({shape[0]}, {shape[1]}, L, k)"
            ok = len(got) == 4 and got[:2] == shape and got[2] > 0 and got[3] > 0
        elif any(name in pair for pair in TOPK_PAIRS):
            want, ok = f"({shape[0]}, {shape[1]}, K)", len(got) == 3 and got[:2] == shape and got[2] > 0
        else:  # advantages
            want, ok = f"({shape[0]},) or {shape}", got in (shape[:1], shape)
        if not ok:
            raise ValueError(f"{name} has shape {got}, but logp has shape {shape}; pass {name} with shape {want}")
    for ids, logps in TOPK_PAIRS:
        if (ids in args) != (logps in args):
            have, lack = (ids, logps) if ids in args else (logps, ids)
            raise ValueError(f"{have} was passed without {lack}; pass both (the top-k token ids and their "
                             "log-probs, same order) or neither")
        if ids in args and shape_of(args[ids]) != shape_of(args[logps]):
            raise ValueError(f"{ids} has shape {shape_of(args[ids])} but {logps} has {shape_of(args[logps])}; "
                             "pass one log-prob per top-k id (same K)")
    if all(name in args for name in ROUTE_ARGS) and shape_of(args[EXPERTS]) != shape_of(args[EXPERTS_SAMPLER]):
        got = shape_of(args["experts_sampler"])
        raise ValueError(f"experts_sampler has shape {got} but experts has {shape_of(args['experts'])}; pass both "
                         f"with the same layers L and top-k (-1 where a side has no route), shape "
                         f"({shape[0]}, {shape[1]}, L, k)")
    for name in VERSION_ARGS:
        if name in args:
            args[name] = row_labels(name, args[name]) if name == "task" else row_versions(args[name])
    return shape


def row_versions(x: Any) -> Any:
    """policy_version as given (a torch or numpy array of integers); ValueError naming the fix otherwise."""
    if not hasattr(x, "dtype"):
        x = np.asarray(x)
    dtype = str(x.dtype).replace("torch.", "")
    if not dtype.startswith(("int", "uint")):
        raise ValueError(f"policy_version has dtype {dtype}; pass one integer weight version per sequence (the "
                         "trainer step whose weights generated it), shape (batch,), or per token, shape (batch, time)")
    return x


def row_labels(name: str, x: Any) -> np.ndarray:
    """A [B] numpy array of str; ValueError naming the fix when a label is not a string."""
    a = np.asarray(x, dtype=object)
    bad = [v for v in a.ravel() if not isinstance(v, str)]
    if bad:
        raise ValueError(f"{name} holds {type(bad[0]).__name__} {bad[0]!r}; pass one string label per sequence, "
                         "shape (batch,)")
    return a.astype(str)
