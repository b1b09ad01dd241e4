"""Exact parity counts: every token whose two log-probs should be bitwise equal, and those that are not.

Two checks, each counted per step over the tokens in the loss (the reducer protocol, reduce.py):

    PARITY   log mu (logp_sampler) against log pi_old (logp_old; logp at iteration 0 where logp_old is null,
             the on-policy convention). A true on-policy run (slime/Miles `--true-on-policy-mode`: batch-invariant
             kernels, the engine's exact computation path in the trainer) promises them equal, bit for bit.
    BATCH    log pi_theta (logp) against log pi_old (logp_old) on the step's first micro-batch (micro 0) of its
             first iteration (iteration 0): no optimizer step has run since pi_old was computed there, so any
             difference is batch variance, the same weights giving other log-probs for another micro-batch
             size or padding (verl issue #6280). Counted twice: over every such token (BATCH), and over those
             whose recorded weight version is the step itself (BATCH_FRESH: `policy_version == step`, a sample of
             the weights being updated, on-policy by the run's own record).

Per (check, step): tokens compared, tokens off (|a - b| > tol, float32 values as stored, compared in float64:
exact), the max |a - b| and the sum of |a - b| (rows "r_"); and per (check, step, seq) of the lowest sequence id
with a token off in a batch, the lowest position off (rows "f_": the first token off is the lowest (seq, pos) of
its step). Both merged by key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from kldiag.analysis.core import keyed
from kldiag.analysis.kernels import blocks as KB
from kldiag.analysis.kernels import contract as KK
from kldiag.analysis.reducers.base import ListReducer, filled, raw, readonly

PARITY, BATCH, BATCH_FRESH = 0, 1, 2
CHECKS = ("parity", "batch", "batch_fresh")



def batch_partial(batch: pa.RecordBatch, tol: float) -> dict[str, np.ndarray] | None:
    """The rows of one record batch (module docstring; one compiled pass, kernels.contract.contract_cells); None
    when it has nothing to compare. Columns go to the kernel as stored (base.raw: Arrow's buffers); an optional
    one the batch lacks (or holds nulls only) as None, which compiles its check out (no logp_sampler: no parity
    work). Nulls become values that compare as nulls do: NaN log-probs (a copy of a column that holds some)."""
    (old, ok_o), (mu, ok_m) = raw(batch, "logp_old"), raw(batch, "logp_sampler")
    step = filled(batch, "step", 0)
    if not len(step) or (old is None and mu is None):  # no pi_old nor mu: neither check compares a token
        return None
    starts, keys = KB.blocks(step)
    lo, hi = int(keys.min()), int(keys.max())
    if hi - lo < 1 << 16:  # a batch's steps are a short range: an offset, no sort
        steps, cells = np.arange(lo, hi + 1, dtype=np.int64), keys - lo
    else:
        steps, cells = np.unique(keys, return_inverse=True)
        cells = cells.reshape(-1).astype(np.int64)
    it, micro, seq, pos = (filled(batch, name, 0) for name in ("iteration", "micro", "seq", "pos"))
    mask = readonly(filled(batch, "mask", False).astype(bool, copy=False))  # read-only: one compiled variant
    logp = filled(batch, "logp", np.float32(np.nan))
    mu = mu if ok_m is None else readonly(np.where(ok_m, mu, np.float32(np.nan)))
    version, ok_v = raw(batch, "policy_version")
    if ok_v is not None:  # a null version is no step's: never fresh
        version = readonly(np.where(ok_v, version.astype(np.int64), lo - 1))
    n_tok, n_off, top, tot, f_seq, f_pos = KK.contract_cells(starts, cells, keys, len(steps), it, micro, seq, pos, mask,
                                                             logp, old, ok_o, mu, version, float(tol))
    c, g = np.nonzero(n_tok)
    if not len(c):
        return None
    out = {"r_check": c.astype(np.int64), "r_step": steps[g], "r_n_tokens": n_tok[c, g], "r_n_off": n_off[c, g],
           "r_max_abs": top[c, g], "r_sum_abs": tot[c, g]}
    c, g = np.nonzero(n_off)
    out.update({"f_check": c.astype(np.int64), "f_step": steps[g], "f_seq": f_seq[c, g], "f_min_pos": f_pos[c, g]})
    return out


def empty() -> dict[str, np.ndarray]:
    out = {f"r_{k}": np.zeros(0, np.int64) for k in ("check", "step", "n_tokens", "n_off")}
    out.update({f"r_{k}": np.zeros(0) for k in ("max_abs", "sum_abs")})
    out.update({f"f_{k}": np.zeros(0, np.int64) for k in ("check", "step", "seq", "min_pos")})
    return out


def merge_partials(partials) -> dict[str, np.ndarray]:
    """Rows summed (maxima taken) by (check, step); first-token rows by (check, step, seq), lowest position."""
    partials = [p for p in partials if p is not None and len(p.get("r_step", ()))]
    if not partials:
        return empty()
    out = {}
    for pre in ("r_", "f_"):
        t = keyed.reduce_by_key({k[2:]: np.concatenate([p[k] for p in partials]) for k in partials[0] if k[:2] == pre})
        out.update({f"{pre}{k}": v for k, v in t.items()})
    return out


@dataclass(frozen=True)
class ContractReducer(ListReducer):
    """The exact parity counts (module docstring). `tol`: |a - b| above it counts as off (0: bitwise)."""

    tol: float = 0.0
    name: str = "contract"
    version: int = 3  # 3: the compiled pass (contract_kernel)
    columns: tuple[str, ...] = ("step", "iteration", "micro", "seq", "pos", "mask", "logp", "logp_old",
                                "logp_sampler", "policy_version")

    def settings(self) -> dict:
        return {"tol": self.tol}

    def partial(self, batch: pa.RecordBatch) -> dict[str, np.ndarray] | None:
        return batch_partial(batch, self.tol)

    def merge(self, partials) -> dict[str, np.ndarray]:
        return merge_partials(partials)


def at_steps(keys: np.ndarray, values: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """values (keyed by the sorted, unique `keys`) at each of `steps`, -1 where a step has none."""
    if not len(keys):
        return np.full(len(steps), -1, np.int64)
    at = np.minimum(np.searchsorted(keys, steps), len(keys) - 1)
    return np.where(keys[at] == steps, values[at], -1)


def of_check(m: dict[str, np.ndarray], check: int) -> dict[str, np.ndarray]:
    """The per-step rows of one check, sorted by step, with the first token off (first_seq, first_pos; -1: none)."""
    sel = m["r_check"] == check
    r = {k[2:]: v[sel] for k, v in m.items() if k[:2] == "r_" and k != "r_check"}
    fs = m["f_check"] == check
    f_step, f_seq, f_pos = m["f_step"][fs], m["f_seq"][fs], m["f_min_pos"][fs]
    lowest = np.flatnonzero(np.r_[True, f_step[1:] != f_step[:-1]]) if len(f_step) else np.zeros(0, np.int64)
    r["first_seq"], r["first_pos"] = (at_steps(f_step[lowest], v[lowest], r["step"]) for v in (f_seq, f_pos))
    return r


def summary(m: dict[str, np.ndarray], check: int) -> dict[str, Any] | None:
    """One check's run-level figures: tokens, tokens off, share, steps off, the first token off (step, seq, pos),
    max |D| and where (step), mean |D|; None when no token was compared."""
    r = of_check(m, check)
    n = int(r["n_tokens"].sum())
    if not n:
        return None
    off = int(r["n_off"].sum())
    out: dict[str, Any] = {"tokens": n, "tokens_off": off, "share_off": off / n, "steps": int(len(r["step"])),
                           "steps_off": int(np.count_nonzero(r["n_off"])), "max_abs": float(r["max_abs"].max()),
                           "mean_abs": float(r["sum_abs"].sum() / n), "first": None, "max_step": None}
    if off:
        i = int(np.flatnonzero(r["n_off"])[0])
        out["first"] = {"step": int(r["step"][i]), "seq": int(r["first_seq"][i]), "pos": int(r["first_pos"][i])}
        out["max_step"] = int(r["step"][int(np.argmax(r["max_abs"]))])
    return out
