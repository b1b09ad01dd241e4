"""Per task: the per-step figures of a run recorded with `task` labels (format v1.3), split by task.

`TaskReducer` (the reducer protocol, reduce.py) folds every token in the loss of a sequence with a task
into rows of (step, task), with s = logp, r = logp_ref, o = logp_old (s where null: on-policy),
m = logp_sampler, d = r - s, x = s - o, z = o - m:

    k3_mean             mean exp(d) - d - 1 (Schulman's K3 of pi_theta against pi_ref)
    weight_k3_abs_max   max |1 - pi_ref/pi_theta| (estimators.weight_k3)
    drift_abs_mean      mean |x|; rho = exp(x): rho_mean, rho_ess, rho_clip_frac (outside [1 - clip_low,
                        1 + clip_high], the run's clip range bound by the engine)
    mismatch_kl         mean exp(z) - z - 1 over tokens with m (KL(mu || pi_old), the analysis's figure);
                        mismatch_abs_mean mean |z|
    entropy_mean        mean recorded entropy

Task labels are strings: a partial keeps its own labels (a fixed-width numpy array) and codes into
them; merge maps every partial's codes onto the union of labels, sorted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kldiag import estimators as E
from kldiag.analysis.core import keyed
from kldiag.analysis.reducers.base import ClippedListReducer
from kldiag.analysis.reducers.base import num as _num
from kldiag.analysis.reducers.base import ratio as _ratio
from kldiag.analysis.reducers.staleness import keyed_max, keyed_sums

SUMS = ("n_tokens", "sum_k3", "n_k3", "sum_drift", "n_x", "sum_rho", "sum_rho2", "n_clip", "sum_mm", "sum_mm_abs",
        "n_mm", "sum_ent", "n_ent")
FIGURES = ("tokens", "k3_mean", "weight_k3_abs_max", "drift_abs_mean", "rho_mean", "rho_ess", "rho_clip_frac",
           "mismatch_kl", "mismatch_abs_mean", "entropy_mean")


def _f64(batch: pa.RecordBatch, name: str) -> np.ndarray:
    """A float column as float64 with NaN for nulls (all NaN when absent)."""
    i = batch.schema.get_field_index(name)
    if i < 0:
        return np.full(batch.num_rows, np.nan)
    return pc.fill_null(batch.column(i).cast(pa.float64()), np.nan).to_numpy(zero_copy_only=False)


def _codes(batch: pa.RecordBatch) -> tuple[np.ndarray, np.ndarray]:
    """(labels [K] str, codes [N] int64 into them; -1 where a row has no task)."""
    i = batch.schema.get_field_index("task")
    if i < 0 or batch.column(i).null_count == batch.num_rows:
        return np.zeros(0, "U1"), np.full(batch.num_rows, -1, np.int64)
    enc = pc.dictionary_encode(batch.column(i).cast(pa.string()))
    labels = np.array(enc.dictionary.to_pylist(), dtype=str)
    codes = pc.fill_null(enc.indices.cast(pa.int64()), -1).to_numpy(zero_copy_only=False)
    return labels, codes


def batch_partial(batch: pa.RecordBatch, clip: tuple[float, float]) -> dict[str, np.ndarray] | None:
    """The (step, task) cells of one record batch; None when no row has a task (a run without tasks
    costs one null check)."""
    labels, code = _codes(batch)
    if not len(labels):
        return None
    mask = pc.fill_null(batch.column(batch.schema.get_field_index("mask")), False).to_numpy(zero_copy_only=False)
    keep = mask & (code >= 0)
    step = batch.column(batch.schema.get_field_index("step")).to_numpy(zero_copy_only=False)[keep]
    s, r, o, m, ent = (_f64(batch, c)[keep] for c in ("logp", "logp_ref", "logp_old", "logp_sampler", "entropy"))
    o = np.where(np.isnan(o), s, o)
    with np.errstate(over="ignore", invalid="ignore"):
        d, x, z = r - s, s - o, o - m
        k3 = np.expm1(d) - d
        w = np.abs(E.weight_k3(s, r))
        rho = np.exp(x)
        mm = np.expm1(z) - z
    ok_k3, ok_x, ok_mm = np.isfinite(k3), np.isfinite(x) & np.isfinite(rho), np.isfinite(mm)
    lo, hi = 1.0 - clip[0], 1.0 + clip[1]
    rho_ok = np.where(ok_x, rho, 0.0)
    cells = _cells(step.astype(np.int64), code[keep], len(labels), {
        "n_tokens": np.ones(len(step), np.int64), "sum_k3": np.where(ok_k3, k3, 0.0), "n_k3": ok_k3.astype(np.int64),
        "sum_drift": np.where(ok_x, np.abs(x), 0.0), "n_x": ok_x.astype(np.int64), "sum_rho": rho_ok,
        "sum_rho2": np.where(np.isfinite(rho_ok * rho_ok), rho_ok * rho_ok, 0.0),
        "n_clip": (ok_x & ((rho < lo) | (rho > hi))).astype(np.int64), "sum_mm": np.where(ok_mm, mm, 0.0),
        "sum_mm_abs": np.where(ok_mm, np.abs(z), 0.0), "n_mm": ok_mm.astype(np.int64),
        "sum_ent": np.where(np.isfinite(ent), ent, 0.0), "n_ent": np.isfinite(ent).astype(np.int64)},
                   np.where(np.isnan(w), -np.inf, w))
    return {"labels": labels, **cells}


def _cells(step: np.ndarray, code: np.ndarray, k: int, sums: dict[str, np.ndarray], w: np.ndarray) -> dict:
    """SUMS per (step, task) by one bincount each, and max_w; rows sorted by step, then task."""
    if not len(step):
        return {"step": step, "task": code, **{n: v[:0] for n, v in sums.items()}, "max_w": w[:0]}
    steps, index = np.unique(step, return_inverse=True)  # a batch holds few steps: cheap
    key = index.reshape(-1) * k + code
    size = len(steps) * k
    held = np.flatnonzero(np.bincount(key, minlength=size))
    out = {"step": steps[held // k], "task": held % k}
    out.update({n: v[held] for n, v in keyed_sums(key, sums, size).items()})
    out["max_w"] = keyed_max(key, w, size)[held]
    return out


def merge_partials(partials) -> dict[str, np.ndarray]:
    """Codes mapped onto the sorted union of the partials' labels, then cells summed by (step, task)."""
    partials = [p for p in partials if len(p.get("step", ()))]
    if not partials:
        return empty()
    labels = np.unique(np.concatenate([p["labels"].astype(str) for p in partials]))
    mapped = [{**{k: v for k, v in p.items() if k != "labels"},
               "task": np.searchsorted(labels, p["labels"].astype(str))[p["task"]]} for p in partials]
    return {"labels": labels, **keyed.merge(mapped)}


def empty() -> dict[str, np.ndarray]:
    return {"labels": np.zeros(0, "U1"), "step": np.zeros(0, np.int64), "task": np.zeros(0, np.int64),
            **{k: np.zeros(0) for k in (*SUMS, "max_w")}}


@dataclass(frozen=True)
class TaskReducer(ClippedListReducer):
    """Per-(step, task) figures (module docstring); `clip` bound like StalenessReducer's."""

    clip: tuple[float, float] | None = None
    name: str = "tasks"
    version: int = 1
    columns: tuple[str, ...] = ("step", "mask", "logp", "logp_old", "logp_ref", "logp_sampler", "entropy", "task")

    def settings(self) -> dict:
        return {"clip": list(self.bound_clip())}

    def partial(self, batch: pa.RecordBatch, clip: tuple[float, float]) -> dict[str, np.ndarray] | None:
        return batch_partial(batch, clip)

    def merge(self, partials) -> dict[str, np.ndarray]:
        return merge_partials(partials)


# ---- what faces read --------------------------------------------------------------------------



def figures(c: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """FIGURES of summed cells (any grouping of the rows of a merged partial)."""
    return {"tokens": c["n_tokens"].astype(np.int64), "k3_mean": _ratio(c["sum_k3"], c["n_k3"]),
            "weight_k3_abs_max": np.where(np.isfinite(c["max_w"]), c["max_w"], np.nan),
            "drift_abs_mean": _ratio(c["sum_drift"], c["n_x"]), "rho_mean": _ratio(c["sum_rho"], c["n_x"]),
            "rho_ess": _ratio(c["sum_rho"] ** 2, c["n_x"] * c["sum_rho2"]),
            "rho_clip_frac": _ratio(c["n_clip"], c["n_x"]), "mismatch_kl": _ratio(c["sum_mm"], c["n_mm"]),
            "mismatch_abs_mean": _ratio(c["sum_mm_abs"], c["n_mm"]), "entropy_mean": _ratio(c["sum_ent"], c["n_ent"])}


def by_task(m: dict[str, np.ndarray], since: int | None = None) -> dict[str, Any]:
    """{"task": labels, figure: [K] array}: each task's figures over its steps (from step `since`)."""
    sel = m["step"] >= since if since is not None else np.ones(len(m["step"]), bool)
    cells = keyed.reduce_by_key({"task": m["task"][sel], **{k: m[k][sel] for k in (*SUMS, "max_w")}})
    return {"task": [str(m["labels"][t]) for t in cells["task"]], **figures(cells)}


def task_steps(m: dict[str, np.ndarray], task: str) -> dict[str, np.ndarray]:
    """{"step": [S], figure: [S]}: one task's per-step figures (empty for a task the run does not hold)."""
    hit = np.flatnonzero(m["labels"] == task)
    sel = m["task"] == (hit[0] if len(hit) else -2)
    return {"step": m["step"][sel], **figures({k: m[k][sel] for k in (*SUMS, "max_w")})}



def summary(m: dict[str, np.ndarray]) -> dict[str, Any]:
    """The per-task table as JSON-ready rows (`kldiag analyze --json` "tasks"; docs/metrics.md)."""
    bt = by_task(m)
    rows = [{"task": t, **{k: (int(bt[k][i]) if k == "tokens" else _num(bt[k][i])) for k in FIGURES}}
            for i, t in enumerate(bt["task"])]
    f = figures(m)
    steps = [{"step": int(m["step"][i]), "task": str(m["labels"][m["task"][i]]),
              **{k: (int(f[k][i]) if k == "tokens" else _num(f[k][i])) for k in FIGURES}}
             for i in range(len(m["step"]))]
    return {"tasks": [str(t) for t in m["labels"]], "by_task": rows, "steps": steps}
