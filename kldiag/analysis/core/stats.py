"""Partials of one record batch: per (step, rank), per (step, seq), and flagged rows.

Column names follow kldiag.analysis.core.keyed: `n_*` and `sum_*` add, `max_*`/`min_*` take
the extreme (NaN = no value), `h_*` are histogram counts, `first_*` keep the first value,
other columns are keys. docs/metrics.md says how each final metric derives from them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from kldiag.analysis.core import around, bins
from kldiag.analysis.core.batch import LOGPS, Batch, Thresholds
from kldiag.analysis.core.keyed import Keyed
from kldiag.analysis.kernels import fused, scans
from kldiag.analysis.kernels import ride as fused_ride
from kldiag.analysis.types import ABS_EDGES

ABS_GRID = np.array([*bins.ABS_MANTISSAS, bins.ABS_K0, len(ABS_EDGES)], np.int64)  # see fused.abs_bin
D_GRID = bins.d_grid()
if max(len(ABS_EDGES), len(bins.D_EDGES)) + 2 > 1 << fused.FIELD:  # the "not binned" bin must fit a field
    raise ImportError("histogram edges exceed fused.FIELD bits; widen FIELD")

TOP_ORDER = ("step", "rank", "seq", "pos", "micro", "iteration")


@dataclass
class BatchResult:
    steps: Keyed
    seqs: Keyed
    top: Keyed  # the top_k masked tokens by |k3 weight|
    bad: Keyed  # the first top_k tokens with a non-finite or positive log-prob


def seq_keyed(b: Batch, rank: int, starts: np.ndarray, seq_f: np.ndarray, seq_i: np.ndarray, clean: bool) -> Keyed:
    """One row per (step, seq) run of the batch; rows of one sequence merge later by key."""
    first = starts[:-1]
    out: Keyed = {"step": b.step[first], "seq": b.seq[first],
                  "first_group": b.at("group", first, -1), "first_rank": np.full(len(first), rank, np.int64),
                  "first_micro": b.at("micro", first), "first_iteration": b.at("iteration", first),
                  "n_rows": np.diff(starts)}
    out.update({name: seq_i[:, c] for c, name in enumerate(fused.SEQ_I)})
    out.update({name: seq_f[:, c] for c, name in enumerate(fused.SEQ_F)})
    out["n_opsm"] = out["n_tokens"]
    out.update(trainer_sums(b, starts, out, clean))
    return out


def trainer_sums(b: Batch, starts: np.ndarray, seqs: Keyed, clean: bool) -> Keyed:
    """Per-sequence sums of TRL's per-token KL times the mask (scans.trl_pass).

    When the batch is clean (every present log-prob finite and <= 0, no partial nulls) and
    every masked k3 and k3_is is finite, these are the masked sums already computed;
    otherwise a second pass applies TRL's IEEE semantics.
    """
    null_ref = b.null["logp_ref"]
    n_rows = seqs["n_rows"]
    n_ref = n_rows - np.add.reduceat(null_ref.astype(np.int64), starts[:-1]) if null_ref is not None else \
        (n_rows if b.raw["logp_ref"] is not None else np.zeros(len(n_rows), np.int64))
    out = {"sum_trl_k3": seqs["sum_k3"], "sum_trl_k3_is": seqs["sum_k3_is"], "sum_trl_x": seqs.pop("sum_trl_x"),
           "n_trl_ref": n_ref}
    if clean and b.raw["logp_ref"] is not None and np.array_equal(seqs["n_k3"], seqs["n_tokens"]) \
            and np.array_equal(seqs["n_k3_is"], seqs["n_tokens"]):
        return out
    a = trl_inputs(b)
    trl = scans.trl_pass(starts, a["s"], a["r"], a["o"], a["o_null"], a["mask"])
    out.update(sum_trl_k3=trl[:, 0], sum_trl_k3_is=trl[:, 1], sum_trl_x=trl[:, 2])
    return out


def step_keyed(b: Batch, rank: int, starts: np.ndarray, sidx: np.ndarray, res: tuple) -> Keyed:
    """One row per step run of the batch: sums, counts, extremes and histograms."""
    step_f, step_i, h_d, h_w, h_w_is, h_rho = res[2:8]
    first_seq = np.flatnonzero(np.diff(sidx, prepend=-1))
    step_begin = starts[first_seq]
    out: Keyed = {"step": b.step[step_begin], "rank": np.full(len(step_begin), rank, np.int64),
                  "n_rows": np.diff(np.append(step_begin, b.n))}
    out.update({name: step_f[:, c] for c, name in enumerate(fused.STEP_F)})
    out.update({name: step_i[:, c] for c, name in enumerate(fused.STEP_I)})
    if b.partial_nulls:  # the kernel's count reads a null logp_sampler's NaN as a placeholder: recount
        out["n_placeholder"] = placeholders(b, step_begin)
    out.update(h_d=h_d, h_weight_k3_abs=h_w, h_weight_k3_is_abs=h_w_is, h_rho=h_rho)
    return out


def placeholders(b: Batch, step_begin: np.ndarray) -> np.ndarray:
    """Per step run: tokens outside the loss whose present logp_old or logp_sampler is a placeholder
    (0.0 or non-finite; Batch.placeholders), int64 [len(step_begin)]."""
    rows = np.searchsorted(step_begin, b.placeholders(), side="right") - 1
    return np.bincount(rows, minlength=len(step_begin)).astype(np.int64)


def ro(a: np.ndarray | None, dtype, placeholder: np.ndarray | None = None) -> np.ndarray:
    """A read-only contiguous array of dtype; `placeholder` (else empty) when a is None.

    One array type per argument whatever the batch, so the kernel compiles once.
    """
    a = (np.empty(0, dtype) if placeholder is None else placeholder) if a is None else np.ascontiguousarray(a, dtype)
    a.flags.writeable = False
    return a


_zeros = np.zeros(0, np.uint8)


def zeros_u8(n: int) -> np.ndarray:
    """n read-only zero bytes, shared by every batch (a fresh np.zeros per batch cost 0.3 ns a token)."""
    global _zeros
    if len(_zeros) < n:
        _zeros = np.zeros(n, np.uint8)
        _zeros.flags.writeable = False
    return _zeros[:n]


def kernel_inputs(b: Batch) -> tuple[np.ndarray, ...]:
    """(s, o, r, m, adv, mask, bad, has) as fused.fused_pass takes them.

    An absent column is passed as s with has = 0; null logp_old rows hold s (on-policy:
    x = 0). bad holds the rows' bad codes when partial nulls make NaN ambiguous (has[4] = 1),
    else zeros.
    """
    raw, null = b.raw, b.null
    s = ro(raw["logp"], np.float32)
    o = raw["logp_old"]
    if o is not None and null["logp_old"] is not None:
        o = np.where(null["logp_old"], raw["logp"], o)
    cols = (s, ro(o, np.float32, s), ro(raw["logp_ref"], np.float32, s), ro(raw["logp_sampler"], np.float32, s),
            ro(raw["advantage"], np.float32, s))
    has = np.array([*(raw[name] is not None for name in ("logp_old", "logp_ref", "logp_sampler", "advantage")),
                    b.partial_nulls], np.int64)
    bad = ro(b.bad_codes(), np.uint8) if b.partial_nulls else zeros_u8(b.n)
    return (*cols, ro(b.mask, np.bool_), bad, has)


def null_masks(b: Batch) -> tuple[np.ndarray, ...]:
    """(s_null, o_null, r_null, m_null) of a Batch as fused_ride.fused_pass_est reads them: bool [n], true at every
    row of an absent column; one shared all-false array for the columns without a null (the usual case)."""
    none, out = zeros_u8(b.n).view(np.bool_), []
    for name in LOGPS:
        null = b.null[name]
        out.append(ro(np.ones(b.n, np.bool_), np.bool_) if b.raw[name] is None else none if null is None
                   else ro(null, np.bool_))  # read-only as `none` is: numba compiles a pass per writeable flag
    return tuple(out)


def trl_inputs(b: Batch) -> dict[str, np.ndarray]:
    """Columns for scans.trl_pass: an empty array for a missing one, the mask as bool."""
    raw = b.raw
    return {"s": ro(raw["logp"], np.float32), "r": ro(raw["logp_ref"], np.float32),
            "o": ro(raw["logp_old"], np.float32), "mask": ro(b.mask, np.bool_),
            "o_null": ro(b.null["logp_old"] if raw["logp_old"] is not None else None, np.bool_)}


# ---- flagged rows ------------------------------------------------------------------------


def flag_rows(b: Batch, rank: int, rows: np.ndarray, wabs: np.ndarray) -> Keyed:
    """The raw columns of the given rows (for `flags`), plus their |k3 weight| (NaN: none) and their index in
    the batch (around.ROW, for around.attach once they are selected)."""
    out: Keyed = {"step": b.step[rows], "rank": np.full(len(rows), rank, np.int64), "seq": b.seq[rows],
                  "pos": b.at("pos", rows), "micro": b.at("micro", rows), "iteration": b.at("iteration", rows),
                  "token_id": b.at("token_id", rows, -1), "mask": b.mask[rows], "wabs": wabs,
                  "token_id_null": b.null_at("token_id", rows)}
    for name in (*LOGPS, "advantage"):
        vals, null = b.raw[name], b.null[name]
        out[name] = np.full(len(rows), np.nan) if vals is None else vals[rows].astype(np.float64)
        out[f"{name}_null"] = (np.ones(len(rows), bool) if vals is None else
                               np.zeros(len(rows), bool) if null is None else null[rows])
    out[around.ROW] = np.asarray(rows, np.int64)
    return out


def select_top(table: Keyed, k: int) -> Keyed:
    """The k rows with the largest wabs; ties by (step, rank, seq, pos, ...): a total order."""
    if not table or k <= 0:
        return {}
    w = table["wabs"]
    if len(w) > 2 * k:  # sort only the k largest and their ties (NaN, a non-finite row's, sorts last)
        kth = -np.partition(-np.nan_to_num(w, nan=-np.inf), k - 1)[k - 1]
        table = {c: a[w >= kth] for c, a in table.items()} if kth > -np.inf else table
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


def top_rows(b: Batch, rank: int, th: Thresholds, thr: float, tail: Keyed | None = None) -> Keyed:
    """The top_k masked rows by |k3 weight| among those with |k3 weight| >= thr, with the token ids around
    them (around.attach; `tail`: the part's rows before the batch).

    |1 - exp(d)| >= thr holds for d >= log1p(thr), or d <= log1p(-thr) when thr < 1: rows
    are preselected by d, with margins for rounding, then w is recomputed with numpy.
    """
    if b.raw["logp_ref"] is None:
        return {}
    thr *= 1.0 - 1e-12  # the kernel's expm1 is within 2 ulp of numpy's: keep rows at the edge
    d_hi = np.log1p(thr) - 1e-9 if thr > 0 else -np.inf
    d_lo = np.log1p(-thr) + 1e-9 if 0 < thr < 1 else -np.inf
    s, r = ro(b.raw["logp"], np.float32), ro(b.raw["logp_ref"], np.float32)
    cand = scans.top_candidates(s, r, ro(b.mask, np.bool_), d_hi, d_lo)
    with np.errstate(all="ignore"):
        d = r[cand].astype(np.float64) - s[cand].astype(np.float64)
        w = np.abs(np.expm1(d))
    keep = np.isfinite(d) & (w >= thr)
    cand, w = cand[keep], w[keep]
    if len(cand) > th.top_k:  # keep the k largest values and their ties, then order exactly
        kth = np.partition(w, len(cand) - th.top_k)[len(cand) - th.top_k]
        cand, w = cand[w >= kth], w[w >= kth]
    return around.attach(select_top(flag_rows(b, rank, cand, w), th.top_k), b, tail)


# ---- one batch ---------------------------------------------------------------------------


def batch_partials(batch: pa.RecordBatch, rank: int, th: Thresholds, top_floor: float = -np.inf,
                   ride: fused_ride.EstimatorRide | None = None, edge: around.Edge | None = None,
                   signal: fused_ride.SignalRide | None = None) -> BatchResult:
    """Everything the analysis keeps from one record batch of format v1 columns; with `ride`, the
    Estimators page's per-token work in the same compiled pass (fused_ride.py), and with `signal` too, the
    learning signal's. A batch the pass reads otherwise (empty, or sorted first; the signal's: without the
    estimators' ride) goes to each rider's own pass (`alone`): its tokens numbered as stored.
    `edge`: what the part's previous batch left (around.Edge), advanced past this one."""
    if signal is not None and (ride is None or batch.num_rows == 0):
        signal.alone(batch)
        signal = None
    if batch.num_rows == 0:
        if ride is not None:
            ride.alone(batch)
        return BatchResult({}, {}, {}, {})
    b = Batch.from_arrow(batch)
    starts, ordered = scans.seq_starts(b.step, b.seq)
    if not ordered:  # recorder files are step-ordered; other writers' may not be: sort once
        for rider in (ride, signal):
            if rider is not None:
                rider.alone(batch)
        ride = signal = None
        b = Batch.from_arrow(batch.take(pa.array(np.argsort(b.step, kind="stable"))))
        starts, _ = scans.seq_starts(b.step, b.seq)
    sidx, n_steps = scans.step_of_seqs(b.step, starts)
    params = np.array([np.log(th.tau), th.weight_limit, th.clamp, 1.0 - th.clip_low, 1.0 + th.clip_high])
    if ride is None:
        res = fused.fused_pass(starts, sidx, n_steps, *kernel_inputs(b), params, ABS_GRID, D_GRID)
    else:
        res = fused_ride.run(b, starts, sidx, n_steps, kernel_inputs(b), null_masks(b), params, ABS_GRID, D_GRID,
                             ride, signal)
    bad_any = res[8]
    seqs = seq_keyed(b, rank, starts, res[0], res[1], clean=len(bad_any) == 0 and not b.partial_nulls)
    steps = step_keyed(b, rank, starts, sidx, res)
    thr = max(top_threshold(steps["h_weight_k3_abs"], th.top_k), top_floor)
    edge = edge if edge is not None else around.Edge()
    top = top_rows(b, rank, th, thr, edge.tail) if th.top_k > 0 else {}
    bad_sel = around.attach(select_first(flag_rows(b, rank, bad_any, np.full(len(bad_any), np.nan)), th.top_k),
                            b, edge.tail) if len(bad_any) else {}
    around.advance(edge, b)
    return BatchResult(steps, seqs, top, bad_sel)
