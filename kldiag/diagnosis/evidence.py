"""Evidence of an episode or a cause: the worst tokens and their sequences, from the flags table."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kldiag.diagnosis.types import Episode

TOKEN_KEYS = ("step", "seq", "pos", "rank", "piece", "logp", "logp_old", "logp_ref", "logp_sampler", "d",
              "weight_k3", "weight_k3_is")
NONFINITE_KINDS = {"nonfinite": "nonfinite", "invalid": "invalid"}


def worst_tokens(flags: pa.Table | None, first: int, last: int | None, n: int, flag: str | None = None) -> list[dict]:
    """Up to n flagged tokens in steps [first, last] (last None: to the end), worst |k3 weight|
    first; with `flag` ("nonfinite", "invalid", ...), only tokens carrying it, in step order."""
    if flags is None or flags.num_rows == 0 or n <= 0:
        return []
    step = flags.column("step")
    keep = pc.greater_equal(step, first)
    if last is not None:
        keep = pc.and_(keep, pc.less_equal(step, last))
    if flag is not None and flag in flags.column_names:
        keep = pc.and_(keep, pc.fill_null(flags.column(flag), False))
    hit = flags.filter(keep)
    if hit.num_rows == 0:
        return []
    if flag is None:
        w = np.abs(np.nan_to_num(hit.column("weight_k3").to_numpy(zero_copy_only=False).astype(np.float64), nan=0.0))
        order = np.argsort(-w, kind="stable")[:n]
    else:
        order = np.argsort(hit.column("step").to_numpy(), kind="stable")[:n]
    rows = hit.take(pa.array(order)).to_pylist()
    return [{k: r.get(k) for k in TOKEN_KEYS if k in r} for r in rows]


def attach(episodes: list[Episode], flags: pa.Table | None, n: int) -> list[Episode]:
    """Sets each episode's evidence: {"tokens": worst tokens inside it, "sequences": their ids}."""
    for e in episodes:
        tokens = worst_tokens(flags, e.start, e.end, n, NONFINITE_KINDS.get(e.kind))
        seqs = list(dict.fromkeys((t["step"], t["seq"], t["rank"]) for t in tokens))
        e.evidence = {"tokens": tokens, "sequences": [{"step": s, "seq": q, "rank": r} for s, q, r in seqs]}
    return episodes
