"""Partials of one record batch: per (step, rank), per (step, seq), and flagged rows.

Column names follow kldiag.analysis.keyed: `n_*` and `sum_*` add, `max_*`/`min_*` take
the extreme (NaN = no value), `h_*` are histogram counts, `first_*` keep the first value,
other columns are keys. docs/metrics.md says how each final metric derives from them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from kldiag.analysis import bins
from kldiag.analysis.keyed import Keyed, reduce_segments, segment_starts
from kldiag.analysis.kernel import ABS, D_ZERO_BIN, LOGPS, N_ABS, N_D, Batch, Seg, Thresholds, finite_sum
from kldiag.analysis.tokens import Tokens, masked_tokens
from kldiag.analysis.types import ABS_EDGES

TOP_ORDER = ("step", "rank", "seq", "pos", "micro", "iteration")


@dataclass
class BatchResult:
    steps: Keyed
    seqs: Keyed
    top: Keyed  # the top_k masked tokens by |k3 weight|
    bad: Keyed  # the first top_k tokens with a non-finite or positive log-prob


@dataclass
class Flagged:
    """Sorted indices (into the masked tokens) of the tokens each flag fires on."""

    theta: np.ndarray
    blowup: np.ndarray
    clamp: np.ndarray
    any: np.ndarray  # any flag, including non-finite/invalid log-probs


def flagged(t: Tokens, th: Thresholds, bad_masked: np.ndarray) -> Flagged:
    """Exact flags, evaluated only on tokens outside the window where none can fire."""
    low, high = th.d_window()
    cand = np.flatnonzero((t.d > high) | (t.d < low))
    d, w, k3 = t.d[cand], t.w[cand], t.k3[cand]
    theta, blowup, clamp = cand[d > np.log(th.tau)], cand[w > th.weight_limit], cand[k3 > th.clamp]
    anyf = np.union1d(np.union1d(theta, blowup), np.union1d(clamp, bad_masked))
    return Flagged(theta, blowup, clamp, anyf)


def step_partial(b: Batch, rank: int, th: Thresholds, t: Tokens, f: Flagged, rows: Seg, seg: Seg,
                 bad: tuple[np.ndarray, np.ndarray]) -> Keyed:
    """One row per step run of the batch: sums, counts, extremes and histograms."""
    n_d, n_x = t.count_d(seg), t.count_x(seg)
    out: Keyed = {"step": b.step[rows.begins], "rank": np.full(seg.n, rank, np.int64), "n_d": n_d, "n_x": n_x}
    out["sum_k1"] = -seg.sum(t.d)
    out["sum_k2"] = 0.5 * seg.sum(t.d * t.d)
    out["sum_w"], out["n_w"] = finite_sum(seg, t.w, n_d)
    out["sum_w_is"], out["n_w_is"] = finite_sum(seg, t.w_is, t.count_dx(seg))
    w_flag = np.zeros(len(t.d))
    w_flag[f.any] = t.w[f.any]
    out["sum_w_flagged"], _ = finite_sum(seg, w_flag, n_d)
    out["sum_rho"], out["n_rho"] = finite_sum(seg, t.rho0, n_x)
    with np.errstate(over="ignore"):
        out["sum_rho2"], _ = finite_sum(seg, t.rho0 * t.rho0, n_x)
    out["sum_drift"] = seg.sum(np.abs(t.x0))
    out["max_rho"], out["min_rho"] = seg.max(t.rho), seg.min(t.rho)
    with np.errstate(invalid="ignore"):
        out["n_clip"] = seg.count((t.rho < 1.0 - th.clip_low) | (t.rho > 1.0 + th.clip_high))
    out["sum_mismatch"], out["n_mismatch"] = t.mismatch(seg)
    for name in ("theta", "blowup", "clamp"):
        out[f"n_{name}"] = seg.count_at(getattr(f, name))
    out["n_nonfinite"], out["n_invalid"] = rows.count_at(bad[0]), rows.count_at(bad[1])
    out.update(histograms(seg, t, seg.lengths - n_d, seg.lengths - n_x, seg.lengths - t.count_dx(seg)))
    return out


def histograms(seg: Seg, t: Tokens, not_d, not_x, not_dx) -> Keyed:
    """Per-step histograms. Excluded tokens hold 0, so they are taken out of 0's bin."""
    h_d = seg.hist(bins.d_bins(t.d), N_D)
    h_d[:, D_ZERO_BIN] -= not_d
    h_w = seg.hist(ABS(t.w), N_ABS)
    h_w[:, 0] -= not_d
    h_w_is = seg.hist(ABS(t.w_is), N_ABS)
    h_w_is[:, 0] -= not_dx
    h_rho = seg.hist(ABS(t.rho0), N_ABS)
    h_rho[:, 0] -= not_x
    return {"h_d": h_d, "h_weight_k3_abs": h_w, "h_weight_k3_is_abs": h_w_is, "h_rho": h_rho}


def seq_partial(b: Batch, rank: int, rows: Seg, seg: Seg, t: Tokens, f: Flagged, bad_rows: np.ndarray) -> Keyed:
    """One row per (step, seq) run of the batch; rows of one sequence merge later by key."""
    first = rows.begins
    out: Keyed = {"step": b.step[first], "seq": b.seq[first],
                  "first_group": b.at("group", first, -1), "first_rank": np.full(seg.n, rank, np.int64),
                  "first_micro": b.at("micro", first), "first_iteration": b.at("iteration", first),
                  "n_rows": rows.lengths, "n_tokens": seg.lengths}
    n_d, n_dx = t.count_d(seg), t.count_dx(seg)
    out["sum_k3"], out["n_k3"] = finite_sum(seg, t.k3, n_d)
    out["sum_k3_is"], out["n_k3_is"] = finite_sum(seg, t.k3_is, n_dx)
    out["max_w"], out["max_w_is"] = seg.max(t.w), seg.max(t.w_is)
    out["n_flagged"] = seg.count_at(f.any)
    out["n_nonfinite"] = rows.count_at(bad_rows)
    adv = b.raw["advantage"]
    if adv is None:
        out["sum_adv"], out["n_adv"] = np.zeros(seg.n), np.zeros(seg.n, np.int64)
    else:
        ok = np.isfinite(adv)
        out["sum_adv"], out["n_adv"] = rows.sum(np.where(ok, adv, 0.0).astype(np.float64)), rows.count(ok)
    out["sum_opsm"], out["n_opsm"] = finite_sum(seg, t.opsm(), seg.lengths)
    out.update(trainer_sums(b, rows, seg, t, out))
    return out


def trainer_sums(b: Batch, rows: Seg, seg: Seg, t: Tokens, seqs: Keyed) -> Keyed:
    """Per-sequence sums of TRL's per-token KL times the mask, with IEEE semantics.

    TRL sums (kl * mask) over every token, so a non-finite kl outside the mask still gives
    NaN (0 * inf); batches whose values are all finite reuse the masked sums.
    """
    null_ref = b.null["logp_ref"]
    n_ref = rows.lengths - rows.count(null_ref) if null_ref is not None else \
        (rows.lengths if t.has_ref else np.zeros(rows.n, np.int64))
    if b.clean and t.valid_d is None and np.all(seqs["n_k3"] == seg.lengths) \
            and np.all(seqs["n_k3_is"] == seg.lengths):
        return {"sum_trl_k3": seqs["sum_k3"], "sum_trl_k3_is": seqs["sum_k3_is"],
                "sum_trl_x": seg.sum(t.x0), "n_trl_ref": n_ref}
    s = b.raw["logp"].astype(np.float64)
    r, o = b.raw["logp_ref"], b.raw["logp_old"]
    maskf = b.mask.astype(np.float64)
    dd = (np.full(b.n, np.nan) if r is None else r.astype(np.float64)) - s
    x = np.zeros(b.n) if o is None else s - o
    if o is not None and b.null["logp_old"] is not None:
        x[b.null["logp_old"]] = 0.0  # TRL uses logp itself when there is no old log-prob
    with np.errstate(over="ignore", invalid="ignore"):
        kl = np.exp(dd) - dd - 1.0
        return {"sum_trl_k3": rows.sum(kl * maskf), "sum_trl_k3_is": rows.sum(kl * np.exp(x) * maskf),
                "sum_trl_x": rows.sum(x * maskf), "n_trl_ref": n_ref}


def steps_from_seqs(seqs: Keyed) -> Keyed:
    """The per-step sums that are sums of per-sequence ones (same batch, step-grouped)."""
    names = ("n_rows", "n_tokens", "sum_k3", "n_k3", "sum_k3_is", "n_k3_is", "max_w", "max_w_is")
    sub = {"step": seqs["step"], **{k: seqs[k] for k in names}}
    out = reduce_segments(sub, segment_starts([seqs["step"]]))
    out.pop("step")
    return out


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


def top_rows(b: Batch, rank: int, th: Thresholds, t: Tokens, idx: np.ndarray | None, thr: float) -> Keyed:
    cand = np.flatnonzero(t.w >= thr)
    if t.valid_d is not None:
        cand = cand[t.valid_d[cand]]
    if len(cand) > th.top_k:  # keep the k largest values and their ties, then order exactly
        kth = np.partition(t.w[cand], len(cand) - th.top_k)[len(cand) - th.top_k]
        cand = cand[t.w[cand] >= kth]
    rows = cand if idx is None else idx[cand]
    return select_top(flag_rows(b, rank, rows, t.w[cand]), th.top_k)


# ---- one batch ---------------------------------------------------------------------------


def batch_partials(batch: pa.RecordBatch, rank: int, th: Thresholds, top_floor: float = -np.inf) -> BatchResult:
    """Everything the analysis keeps from one record batch of format v1 columns."""
    if batch.num_rows == 0:
        return BatchResult({}, {}, {}, {})
    b = Batch.from_arrow(batch)
    st, sq = segment_starts([b.step]), segment_starts([b.step, b.seq])
    rows_st, rows_sq = Seg(np.diff(np.append(st, b.n))), Seg(np.diff(np.append(sq, b.n)))
    idx = None if b.mask.all() else np.flatnonzero(b.mask)
    if idx is None:
        seg_st, seg_sq = rows_st, rows_sq
    else:
        cum = np.concatenate([[0], np.cumsum(b.mask, dtype=np.int64)])
        seg_st, seg_sq = Seg(cum[rows_st.ends] - cum[rows_st.begins]), Seg(cum[rows_sq.ends] - cum[rows_sq.begins])
    bad = b.bad_rows()
    bad_any = np.union1d(*bad)
    bad_masked = bad_any if idx is None else np.searchsorted(idx, bad_any[b.mask[bad_any]])
    t = masked_tokens(b, idx)
    f = flagged(t, th, bad_masked)
    seqs = seq_partial(b, rank, rows_sq, seg_sq, t, f, bad_any)
    steps = step_partial(b, rank, th, t, f, rows_st, seg_st, bad)
    steps.update(steps_from_seqs(seqs))
    steps["n_flagged"] = seg_st.count_at(f.any)
    thr = max(top_threshold(steps["h_weight_k3_abs"], th.top_k), top_floor)
    top = top_rows(b, rank, th, t, idx, thr) if th.top_k > 0 else {}
    bad_sel = select_first(flag_rows(b, rank, bad_any, np.full(len(bad_any), np.nan)), th.top_k) \
        if len(bad_any) else {}
    return BatchResult(steps, seqs, top, bad_sel)
