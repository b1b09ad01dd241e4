"""Partials of one record batch: per (step, rank), per (step, seq), and flagged rows.

Column names follow kldiag.analysis.keyed: `n_*` and `sum_*` add, `max_*`/`min_*` take
the extreme (NaN = no value), `h_*` are histogram counts, `first_*` keep the first value,
other columns are keys. docs/metrics.md says how each final metric derives from them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from kldiag.analysis import bins, fused
from kldiag.analysis.keyed import Keyed
from kldiag.analysis.kernel import LOGPS, Batch, Thresholds
from kldiag.analysis.types import ABS_EDGES

ABS = bins.abs_table()
D_GRID = bins.d_grid()

TOP_ORDER = ("step", "rank", "seq", "pos", "micro", "iteration")


@dataclass
class BatchResult:
    steps: Keyed
    seqs: Keyed
    top: Keyed  # the top_k masked tokens by |k3 weight|
    bad: Keyed  # the first top_k tokens with a non-finite or positive log-prob


def seq_keyed(b: Batch, rank: int, starts: np.ndarray, seq_f: np.ndarray, seq_i: np.ndarray) -> Keyed:
    """One row per (step, seq) run of the batch; rows of one sequence merge later by key."""
    first = starts[:-1]
    out: Keyed = {"step": b.step[first], "seq": b.seq[first],
                  "first_group": b.at("group", first, -1), "first_rank": np.full(len(first), rank, np.int64),
                  "first_micro": b.at("micro", first), "first_iteration": b.at("iteration", first),
                  "n_rows": np.diff(starts)}
    out.update({name: seq_i[:, c] for c, name in enumerate(fused.SEQ_I)})
    out.update({name: seq_f[:, c] for c, name in enumerate(fused.SEQ_F)})
    out["n_opsm"] = out["n_tokens"]
    out.update(trainer_sums(b, starts, out))
    return out


def trainer_sums(b: Batch, starts: np.ndarray, seqs: Keyed) -> Keyed:
    """Per-sequence sums of TRL's per-token KL times the mask (fused.trl_pass).

    When every log-prob is finite and every masked k3 and k3_is too, these are the masked
    sums already computed; otherwise a second pass applies TRL's IEEE semantics.
    """
    null_ref = b.null["logp_ref"]
    n_rows = seqs["n_rows"]
    n_ref = n_rows - np.add.reduceat(null_ref.astype(np.int64), starts[:-1]) if null_ref is not None else \
        (n_rows if b.raw["logp_ref"] is not None else np.zeros(len(n_rows), np.int64))
    out = {"sum_trl_k3": seqs["sum_k3"], "sum_trl_k3_is": seqs["sum_k3_is"], "sum_trl_x": seqs.pop("sum_trl_x"),
           "n_trl_ref": n_ref}
    if b.clean and b.raw["logp_ref"] is not None and np.array_equal(seqs["n_k3"], seqs["n_tokens"]) \
            and np.array_equal(seqs["n_k3_is"], seqs["n_tokens"]):
        return out
    a = kernel_inputs(b)
    trl = fused.trl_pass(starts, a["s"], a["r"], a["o"], a["o_null"], a["mask"])
    out.update(sum_trl_k3=trl[:, 0], sum_trl_k3_is=trl[:, 1], sum_trl_x=trl[:, 2])
    return out


def step_keyed(b: Batch, rank: int, starts: np.ndarray, sidx: np.ndarray, res: tuple) -> Keyed:
    """One row per step run of the batch: sums, counts, extremes and histograms."""
    _, _, step_f, step_i, h_d, h_w, h_w_is, h_rho, _ = res
    first_seq = np.flatnonzero(np.diff(sidx, prepend=-1))
    step_begin = starts[first_seq]
    out: Keyed = {"step": b.step[step_begin], "rank": np.full(len(step_begin), rank, np.int64),
                  "n_rows": np.diff(np.append(step_begin, b.n))}
    out.update({name: step_f[:, c] for c, name in enumerate(fused.STEP_F)})
    out.update({name: step_i[:, c] for c, name in enumerate(fused.STEP_I)})
    out.update(h_d=h_d, h_weight_k3_abs=h_w, h_weight_k3_is_abs=h_w_is, h_rho=h_rho)
    return out


def kernel_inputs(b: Batch) -> dict[str, np.ndarray]:
    """The batch's columns as the kernel takes them: read-only, an empty array for a missing one.

    One array type per argument whatever the batch, so the kernel compiles once.
    """
    def ro(a, dtype):
        a = np.empty(0, dtype) if a is None else np.ascontiguousarray(a, dtype)
        a.flags.writeable = False
        return a

    raw = b.raw
    return {"s": ro(raw["logp"], np.float32), "r": ro(raw["logp_ref"], np.float32),
            "o": ro(raw["logp_old"], np.float32), "m": ro(raw["logp_sampler"], np.float32),
            "adv": ro(raw["advantage"], np.float32), "mask": ro(b.mask, np.bool_),
            "o_null": ro(b.null["logp_old"] if raw["logp_old"] is not None else None, np.bool_)}


# ---- flagged rows ------------------------------------------------------------------------


def flag_rows(b: Batch, rank: int, rows: np.ndarray, wabs: np.ndarray) -> Keyed:
    """The raw columns of the given rows (for `flags`), plus their |k3 weight| (NaN: none)."""
    take = pa.array(rows, pa.int64())
    out: Keyed = {"step": b.step[rows], "rank": np.full(len(rows), rank, np.int64), "seq": b.seq[rows],
                  "pos": b.at("pos", rows), "micro": b.at("micro", rows), "iteration": b.at("iteration", rows),
                  "token_id": b.at("token_id", rows, -1), "mask": b.mask[rows], "wabs": wabs,
                  "token_id_null": np.asarray(b.arrow.column("token_id").take(take).is_null()).astype(bool)}
    for name in (*LOGPS, "advantage"):
        vals, null = b.raw[name], b.null[name]
        out[name] = np.full(len(rows), np.nan) if vals is None else vals[rows].astype(np.float64)
        out[f"{name}_null"] = (np.ones(len(rows), bool) if vals is None else
                               np.zeros(len(rows), bool) if null is None else null[rows])
    return out


def select_top(table: Keyed, k: int) -> Keyed:
    """The k rows with the largest wabs; ties by (step, rank, seq, pos, ...): a total order."""
    if not table or k <= 0:
        return {}
    order = np.lexsort([table[c] for c in TOP_ORDER[::-1]] + [-table["wabs"]])[:k]
    return {c: a[order] for c, a in table.items()}


def select_first(table: Keyed, k: int) -> Keyed:
    """The k earliest rows by (step, rank, seq, pos, ...)."""
    if not table or k <= 0:
        return {}
    order = np.lexsort([table[c] for c in TOP_ORDER[::-1]])[:k]
    return {c: a[order] for c, a in table.items()}


def top_threshold(h_w: np.ndarray, top_k: int) -> float:
    """A |k3 weight| at or below the batch's top_k-th largest, read off its histogram."""
    from_top = np.cumsum(h_w.sum(axis=0)[::-1])
    i = int(np.searchsorted(from_top, top_k, side="left"))  # bins from the top needed
    if i >= len(from_top) - 1:
        return -np.inf
    return float(ABS_EDGES[len(from_top) - 2 - i])


def top_rows(b: Batch, rank: int, th: Thresholds, wtop: np.ndarray, thr: float) -> Keyed:
    """The top_k rows by |k3 weight| among those >= thr (wtop: NaN where not a candidate)."""
    cand = np.flatnonzero(wtop >= thr)
    if len(cand) > th.top_k:  # keep the k largest values and their ties, then order exactly
        kth = np.partition(wtop[cand], len(cand) - th.top_k)[len(cand) - th.top_k]
        cand = cand[wtop[cand] >= kth]
    return select_top(flag_rows(b, rank, cand, wtop[cand]), th.top_k)


# ---- one batch ---------------------------------------------------------------------------


def batch_partials(batch: pa.RecordBatch, rank: int, th: Thresholds, top_floor: float = -np.inf) -> BatchResult:
    """Everything the analysis keeps from one record batch of format v1 columns."""
    if batch.num_rows == 0:
        return BatchResult({}, {}, {}, {})
    b = Batch.from_arrow(batch)
    a = kernel_inputs(b)
    starts = fused.seq_starts(b.step, b.seq)
    sidx, n_steps = fused.step_of_seqs(b.step, starts)
    nonfinite, invalid = b.bad_rows()
    code = np.zeros(b.n if len(nonfinite) or len(invalid) else 0, np.uint8)
    code[nonfinite] |= fused.BAD_NONFINITE
    code[invalid] |= fused.BAD_INVALID
    code.flags.writeable = False
    params = np.array([np.log(th.tau), th.weight_limit, th.clamp, 1.0 - th.clip_low, 1.0 + th.clip_high])
    ex = fused.exps(a["s"], a["r"], a["o"], a["m"], a["o_null"])
    res = fused.fused_pass(starts, sidx, n_steps, a["s"], a["o"], a["m"], a["o_null"], a["mask"], a["adv"],
                           code, ex, params, ABS.lo, ABS.cut, ABS.shift, len(ABS_EDGES) + 1, D_GRID)
    seqs = seq_keyed(b, rank, starts, res[0], res[1])
    steps = step_keyed(b, rank, starts, sidx, res)
    wtop = res[-1]
    thr = max(top_threshold(steps["h_weight_k3_abs"], th.top_k), top_floor)
    top = top_rows(b, rank, th, wtop, thr) if th.top_k > 0 else {}
    bad_any = np.flatnonzero(code)
    bad_sel = select_first(flag_rows(b, rank, bad_any, np.full(len(bad_any), np.nan)), th.top_k) \
        if len(bad_any) else {}
    return BatchResult(steps, seqs, top, bad_sel)
