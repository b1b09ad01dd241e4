"""The coverage table: per step, which of the optional inputs the run recorded, as a share of its loss tokens.

`CoverageReducer` (the reducer protocol, reduce.py) counts per step the tokens in the loss and, of those,
the tokens where each optional column holds a value (not null): the engine's log-probs (logp_sampler),
the reference's (logp_ref), the behaviour policy's (logp_old), the advantages, entropy, the weight
version (policy_version), the turn index, the task label, and the routes per side: the trainer's
(route_layers: the trainer routed the token) and the engine's (route_differ: its routes were compared with
the trainer's; a run that recorded one side has the trainer's only). Counting reads only scalar columns: the
top-k lists' counts come from the top-k reducer (kldiag.analysis.reducers.topk: n_trainer, n_sampler per step) when it
was read.

`table()` gives per step the share of loss tokens with each input, and per run, per input, on how many steps
it is present (`{"steps": 0, "of": 10, "token_share": 0.0}`): what `kldiag analyze --json` prints under
"coverage" and what the faces read to say which figure cannot be drawn and how to record its column.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from kldiag.analysis.core import keyed
from kldiag.analysis.kernels import blocks as KB
from kldiag.analysis.reducers.base import filled, validity
from kldiag.analysis.reducers.topk import TopkReducer
from kldiag.analysis.runtime.runner import reduced

# input name in the table -> the column whose non-null values count (the faces name the input)
COUNTED = {"logp_sampler": "logp_sampler", "logp_ref": "logp_ref", "logp_old": "logp_old",
           "routes_trainer": "route_layers", "routes_engine": "route_differ", "policy_version": "policy_version",
           "advantage": "advantage", "entropy": "entropy", "turn": "turn", "task": "task"}
TOPK = {"topk_trainer": "s_n_trainer", "topk_engine": "s_n_sampler"}  # from the top-k reducer's merged partial
INPUTS = (*COUNTED, *TOPK)


def batch_counts(batch: pa.RecordBatch) -> dict[str, np.ndarray]:
    """Per step of the batch's loss tokens: n_tokens and n_<input> (keyed.reduce_by_key form). Counted per block
    of one step (kernels.blocks) from Arrow's buffers as stored (base.raw); a column with no null (or only
    nulls) costs no per-row work: its count is the step's tokens (or 0)."""
    mask = filled(batch, "mask", False).astype(bool, copy=False)
    starts, keys = KB.blocks(filled(batch, "step", 0))
    per_block = KB.block_counts(starts, mask, None)
    if not per_block.sum():
        return _empty()
    steps, cells = np.unique(keys, return_inverse=True)  # one key a block: a few hundred a batch
    cells = cells.reshape(-1)
    tokens = _by_step(cells, per_block, len(steps))
    keep = tokens > 0
    out = {"step": steps[keep].astype(np.int64), "n_tokens": tokens[keep]}
    for name, column in COUNTED.items():
        i = batch.schema.get_field_index(column)
        col = batch.column(i) if i >= 0 else None
        if col is None or col.null_count == batch.num_rows:
            out[f"n_{name}"] = np.zeros(int(keep.sum()), np.int64)
        elif not col.null_count:
            out[f"n_{name}"] = out["n_tokens"].copy()
        else:
            counts = KB.block_counts(starts, mask, validity(col))
            out[f"n_{name}"] = _by_step(cells, counts, len(steps))[keep]
    return out


def _by_step(cells: np.ndarray, per_block: np.ndarray, n: int) -> np.ndarray:
    """[n] int64: the blocks' counts summed by their step's cell."""
    out = np.zeros(n, np.int64)
    np.add.at(out, cells, per_block)
    return out


def _empty() -> dict[str, np.ndarray]:
    return {"step": np.zeros(0, np.int64), "n_tokens": np.zeros(0, np.int64),
            **{f"n_{k}": np.zeros(0, np.int64) for k in COUNTED}}


@dataclass(frozen=True)
class CoverageReducer:
    """Per-step non-null counts of the optional inputs over the loss tokens (module docstring)."""

    name: str = "coverage"
    version: int = 1
    columns: tuple[str, ...] = ("step", "mask", *COUNTED.values())

    def settings(self) -> dict:
        return {"counted": COUNTED}

    def start(self, part) -> list:
        return []

    def add(self, state: list, batch: pa.RecordBatch) -> None:
        if batch.num_rows:
            state.append(batch_counts(batch))

    def finish(self, state: list, dropped: int) -> dict[str, np.ndarray]:
        return self.merge(state)

    def merge(self, partials) -> dict[str, np.ndarray]:
        return keyed.merge([p for p in partials if keyed.rows(p)]) or _empty()


# ---- what faces read --------------------------------------------------------------------------


def _topk_counts(topk: dict[str, np.ndarray] | None, steps: np.ndarray) -> dict[str, np.ndarray]:
    """The top-k reducer's per-step list counts aligned on `steps` (zeros where it has none)."""
    out = {name: np.zeros(len(steps)) for name in TOPK}
    if not topk or "s_step" not in topk or not len(topk["s_step"]):
        return out
    at = np.searchsorted(steps, topk["s_step"])
    ok = (at < len(steps)) & (steps[np.minimum(at, len(steps) - 1)] == topk["s_step"])
    for name, key in TOPK.items():
        np.add.at(out[name], at[ok], np.asarray(topk[key], np.float64)[ok])
    return out


def table(merged: dict[str, np.ndarray], topk: dict[str, np.ndarray] | None = None,
          routes: dict[str, Any] | None = None) -> dict[str, Any]:
    """JSON-ready coverage: `inputs` (per input over the run: steps present, of how many, token share),
    `steps` (per step: tokens in the loss and the share of them with each input), `routes` (the recorder's
    manifest config["routes"]: which side it captured and why not, when it wrote one)."""
    steps = np.asarray(merged["step"], np.int64)
    tokens = np.asarray(merged["n_tokens"], np.float64)
    counts = {name: np.asarray(merged[f"n_{name}"], np.float64) for name in COUNTED}
    if topk is not None:  # read: the lists' counts; not read, the top-k inputs are left out (unknown)
        counts.update(_topk_counts(topk, steps))
    names = [k for k in INPUTS if k in counts]
    with np.errstate(invalid="ignore", divide="ignore"):
        share = {k: np.where(tokens > 0, v / np.where(tokens > 0, tokens, 1), np.nan) for k, v in counts.items()}
    total = float(tokens.sum())
    inputs = {k: {"steps": int((counts[k] > 0).sum()), "of": int(len(steps)),
                  "token_share": float(counts[k].sum() / total) if total else None} for k in names}
    rows = [{"step": int(s), "tokens": int(tokens[i]),
             **{k: (round(float(share[k][i]), 6) if share[k][i] == share[k][i] else None) for k in names}}
            for i, s in enumerate(steps)]
    return {"inputs": inputs, "steps": rows, "routes": routes}


def missing(cov: dict[str, Any]) -> list[str]:
    """The inputs no step has (the faces say what they cannot draw without them)."""
    return [k for k, v in cov["inputs"].items() if v["of"] and not v["steps"]]


def coverage_of(analysis, topk: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
    """table() of an analysed run: the counts read with the analysis when it was made with
    diagnosis.core.reducers(), else one more pass; the manifest's config["routes"] when present. The top-k
    lists' counts come from `topk` (the top-k reducer's merged partial) or from the analysis's own read of it:
    without either they are left out, not read in one more pass."""
    routes = (getattr(analysis.manifest, "config", None) or {}).get("routes")
    if topk is None and TopkReducer.name in analysis.reduced:
        topk = reduced(analysis, TopkReducer())
    return table(reduced(analysis, CoverageReducer()), topk, routes)
