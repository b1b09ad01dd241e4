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
from kldiag.analysis.kernel import (
    _ABS,
    D_ZERO_BIN,
    LOGPS,
    N_ABS,
    N_D,
    Batch,
    Seg,
    Thresholds,
    Tokens,
    _both,
    _count,
    _fix_products,
    finite_sum,
    masked_tokens,
)
from kldiag.analysis.keyed import Keyed, segment_starts
from kldiag.analysis.types import ABS_EDGES

FLAG_RAW = ("step", "rank", "seq", "pos", "micro", "iteration", "token_id",
            "logp", "logp_old", "logp_ref", "logp_sampler", "advantage", "mask")


class Derived:
    """Per-token values of the masked tokens of a batch, computed once."""

    def __init__(self, t: Tokens, th: Thresholds, nf: np.ndarray, inv: np.ndarray):
        d = t.d
        with np.errstate(over="ignore", invalid="ignore"):
            em = np.expm1(d)
            self.k3 = em - d
            self.w = np.abs(em)
            self.valid_dx = _both(t.valid_d, t.valid_x)
            self.k3_is = _fix_products(t.rho0 * self.k3, self.valid_dx, t.rho0, self.k3)
            self.w_is = _fix_products(t.rho0 * np.abs(d), self.valid_dx, t.rho0, np.abs(d))
        self.theta = d > np.log(th.tau)
        self.blowup = self.w > th.weight_limit
        self.clamp = self.k3 > th.clamp
        self.flagged = self.theta | self.blowup | self.clamp | nf | inv
        with np.errstate(invalid="ignore"):
            self.clip = (t.rho < 1.0 - th.clip_low) | (t.rho > 1.0 + th.clip_high)


def step_partial(b: Batch, rank: int, th: Thresholds, t: Tokens, v: Derived, seg_all: Seg,
                 seg: Seg, nf: np.ndarray, inv: np.ndarray, mismatch: tuple) -> Keyed:
    """One row per step of the batch: sums, counts, extremes and histograms."""
    n_tok = seg.lengths
    n_d, n_x, n_dx = _count(seg, t.valid_d), _count(seg, t.valid_x), _count(seg, v.valid_dx)
    out: Keyed = {"step": b.step[seg_all.starts], "rank": np.full(seg.n, rank, np.int64),
                  "n_rows": seg_all.lengths, "n_tokens": n_tok, "n_d": n_d, "n_x": n_x}
    out["sum_k1"] = -seg.sum(t.d)
    out["sum_k2"] = 0.5 * seg.sum(t.d * t.d)
    out["sum_k3"], out["n_k3"] = finite_sum(seg, v.k3, n_d)
    out["sum_k3_is"], out["n_k3_is"] = finite_sum(seg, v.k3_is, n_dx)
    out["sum_w"], out["n_w"] = finite_sum(seg, v.w, n_d)
    out["sum_w_is"], out["n_w_is"] = finite_sum(seg, v.w_is, n_dx)
    out["sum_w_flagged"], _ = finite_sum(seg, np.where(v.flagged, v.w, 0.0), n_d)
    out["sum_rho"], out["n_rho"] = finite_sum(seg, t.rho0, n_x)
    with np.errstate(over="ignore"):
        out["sum_rho2"], out["n_rho2"] = finite_sum(seg, t.rho0 * t.rho0, n_x)
    out["sum_drift"] = seg.sum(np.abs(t.x0))
    out["sum_mismatch"], out["n_mismatch"] = mismatch
    out["max_w"], out["max_w_is"] = seg.max(v.w), seg.max(v.w_is)
    out["max_rho"], out["min_rho"] = seg.max(t.rho), seg.min(t.rho)
    for name, flag in (("theta", v.theta), ("blowup", v.blowup), ("clamp", v.clamp),
                       ("flagged", v.flagged), ("clip", v.clip)):
        out[f"n_{name}"] = seg.count(flag)
    out["n_nonfinite"], out["n_invalid"] = seg_all.count(nf), seg_all.count(inv)
    out.update(histograms(seg, t, v, n_tok - n_d, n_tok - n_x, n_tok - n_dx))
    return out


def histograms(seg: Seg, t: Tokens, v: Derived, not_d, not_x, not_dx) -> Keyed:
    """Per-step histograms; excluded tokens were set to 0, so they are taken out of 0's bin."""
    h_d = seg.hist(bins.d_bins(t.d), N_D)
    h_d[:, D_ZERO_BIN] -= not_d
    h_w = seg.hist(_ABS(v.w), N_ABS)
    h_w[:, 0] -= not_d
    h_w_is = seg.hist(_ABS(v.w_is), N_ABS)
    h_w_is[:, 0] -= not_dx
    h_rho = seg.hist(_ABS(t.rho0), N_ABS)
    h_rho[:, 0] -= not_x
    return {"h_d": h_d, "h_weight_k3_abs": h_w, "h_weight_k3_is_abs": h_w_is, "h_rho": h_rho}


def mismatch_sums(seg: Seg, s, o, m, o_null, m_null) -> tuple[np.ndarray, np.ndarray]:
    """KL(mu || pi_old) per step: k3 of z = log pi_old - log mu over tokens sampled by mu."""
    if m is None:
        return np.zeros(seg.n), np.zeros(seg.n, np.int64)
    base = s if o is None else (o if o_null is None else np.where(o_null, s, o))
    z = base - m
    valid = np.isfinite(z)  # a null sampler log-prob is NaN here
    z = np.where(valid, z, 0.0)
    with np.errstate(over="ignore"):
        k3 = np.expm1(z) - z
    return finite_sum(seg, k3, seg.count(valid))


def opsm_values(s, o, m, o_null, m_null) -> np.ndarray:
    """log mu - logp per masked token, with mu = sampler, else old, else logp (TRL's choice)."""
    base = s if o is None else (o if o_null is None else np.where(o_null, s, o))
    mu = base if m is None else (m if m_null is None else np.where(m_null, base, m))
    return mu - s


def seq_partial(b: Batch, rank: int, seg_all: Seg, seg: Seg, t: Tokens, v: Derived, nf: np.ndarray,
                opsm: np.ndarray) -> Keyed:
    """One row per (step, seq) run of the batch; rows of one sequence merge later by key."""
    first = seg_all.starts
    out: Keyed = {"step": b.step[first], "seq": b.seq[first],
                  "first_group": b.at("group", first, -1), "first_rank": np.full(seg.n, rank, np.int64),
                  "first_micro": b.at("micro", first), "first_iteration": b.at("iteration", first),
                  "n_rows": seg_all.lengths, "n_tokens": seg.lengths}
    out["sum_k3"], out["n_k3"] = finite_sum(seg, v.k3, _count(seg, t.valid_d))
    out["sum_k3_is"], out["n_k3_is"] = finite_sum(seg, v.k3_is, _count(seg, v.valid_dx))
    out["max_w"], out["max_w_is"] = seg.max(v.w), seg.max(v.w_is)
    out["n_flagged"] = seg.count(v.flagged)
    out["n_nonfinite"] = seg_all.count(nf)
    adv = b.lp["advantage"]
    if adv is None:
        out["sum_adv"], out["n_adv"] = np.zeros(seg.n), np.zeros(seg.n, np.int64)
    else:
        ok = np.isfinite(adv)
        out["sum_adv"], out["n_adv"] = seg_all.sum(np.where(ok, adv, 0.0)), seg_all.count(ok)
    out["sum_opsm"], out["n_opsm"] = finite_sum(seg, opsm, seg.lengths)
    return out


def run_lengths(starts: np.ndarray, n: int) -> np.ndarray:
    return np.diff(np.append(starts, n))


def masked_lengths(mask: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Masked rows in each run starting at `starts`."""
    return np.add.reduceat(mask, starts, dtype=np.int64) if len(mask) else np.zeros(0, np.int64)


def top_threshold(h_w: np.ndarray, top_k: int) -> float:
    """A |k3 weight| at or below the batch's top_k-th largest, read off its histogram."""
    from_top = np.cumsum(h_w.sum(axis=0)[::-1])
    i = int(np.searchsorted(from_top, top_k, side="left"))  # bins from the top needed
    if i >= len(from_top) - 1:
        return -np.inf
    return float(ABS_EDGES[len(from_top) - 2 - i])


def trainer_sums(b: Batch, seg_all: Seg, seg: Seg, t: Tokens, v: Derived, seqs: Keyed, clean: bool) -> Keyed:
    """Per-sequence sums of TRL's per-token KL times the mask, with IEEE semantics.

    TRL sums (kl * mask) over every token, so a non-finite kl outside the mask still gives
    NaN (0 * inf); `clean` batches (all finite) reuse the masked sums instead.
    """
    n_ref = seg_all.count(~b.null["logp_ref"]) if b.null["logp_ref"] is not None else \
        (seg_all.lengths if t.has_ref else np.zeros(seg_all.n, np.int64))
    if clean:
        return {"sum_trl_k3": seqs["sum_k3"], "sum_trl_k3_is": seqs["sum_k3_is"],
                "sum_trl_x": seg.sum(t.x0), "n_trl_ref": n_ref}
    s, r, o = b.lp["logp"], b.lp["logp_ref"], b.lp["logp_old"]
    maskf = b.mask.astype(np.float64)
    dd = (np.full(b.n, np.nan) if r is None else r) - s
    x = np.zeros(b.n) if o is None else np.where(b.null["logp_old"], 0.0, s - o) \
        if b.null["logp_old"] is not None else s - o
    with np.errstate(over="ignore", invalid="ignore"):
        kl = np.exp(dd) - dd - 1.0
        return {"sum_trl_k3": seg_all.sum(kl * maskf), "sum_trl_k3_is": seg_all.sum(kl * np.exp(x) * maskf),
                "sum_trl_x": seg_all.sum(x * maskf), "n_trl_ref": n_ref}


def flag_rows(b: Batch, rank: int, rows: np.ndarray, wabs: np.ndarray) -> Keyed:
    """The raw columns of the given rows (for `flags`), plus their |k3 weight| (NaN: none)."""
    out: Keyed = {"step": b.step[rows], "rank": np.full(len(rows), rank, np.int64), "seq": b.seq[rows],
                  "pos": b.at("pos", rows), "micro": b.at("micro", rows), "iteration": b.at("iteration", rows),
                  "token_id": b.at("token_id", rows, -1), "mask": b.mask[rows], "wabs": wabs}
    tid = b.arrow.column("token_id").take(pa.array(rows, pa.int64()))
    out["token_id_null"] = np.asarray(tid.is_null()).astype(bool)
    for name in (*LOGPS, "advantage"):
        vals, null = b.lp[name], b.null[name]
        out[name] = np.full(len(rows), np.nan) if vals is None else vals[rows]
        out[f"{name}_null"] = (np.ones(len(rows), bool) if vals is None else
                               np.zeros(len(rows), bool) if null is None else null[rows])
    return out


TOP_ORDER = ("step", "rank", "seq", "pos", "micro", "iteration")


def select_top(table: Keyed, k: int) -> Keyed:
    """The k rows with the largest wabs; ties by (step, rank, seq, pos): a total order."""
    if not table:
        return table
    order = np.lexsort([table[c] for c in TOP_ORDER[::-1]] + [-table["wabs"]])[:k]
    return {c: a[order] for c, a in table.items()}


def select_first(table: Keyed, k: int) -> Keyed:
    """The k earliest rows by (step, rank, seq, pos)."""
    if not table:
        return table
    order = np.lexsort([table[c] for c in TOP_ORDER[::-1]])[:k]
    return {c: a[order] for c, a in table.items()}


@dataclass
class BatchResult:
    steps: Keyed
    seqs: Keyed
    top: Keyed  # top_k masked tokens by |k3 weight|
    bad: Keyed  # first top_k tokens with a non-finite or positive log-prob


def batch_partials(batch: pa.RecordBatch, rank: int, th: Thresholds, top_floor: float = -np.inf) -> BatchResult:
    """Everything the analysis keeps from one record batch (format v1 columns COLUMNS)."""
    b = Batch.from_arrow(batch)
    st, sq = segment_starts([b.step]), segment_starts([b.step, b.seq])
    seg_all, seq_all = Seg(run_lengths(st, b.n)), Seg(run_lengths(sq, b.n))
    seg, seq_seg = Seg(masked_lengths(b.mask, st)), Seg(masked_lengths(b.mask, sq))
    nf, inv = b.nonfinite_invalid()
    idx = None if b.mask.all() else np.flatnonzero(b.mask)

    def take(a):
        return a if a is None or idx is None else a[idx]

    s, o, r, m = (take(b.lp[k]) for k in LOGPS)
    o_null, m_null = take(b.null["logp_old"]), take(b.null["logp_sampler"])
    t = masked_tokens(s, r, o, o_null)
    v = Derived(t, th, take(nf), take(inv))
    steps = step_partial(b, rank, th, t, v, seg_all, seg, nf, inv, mismatch_sums(seg, s, o, m, o_null, m_null))
    seqs = seq_partial(b, rank, seq_all, seq_seg, t, v, nf, opsm_values(s, o, m, o_null, m_null))
    clean = (t.has_ref and not nf.any() and t.valid_d is None
             and bool(np.all(steps["n_k3"] == steps["n_d"])) and bool(np.all(steps["n_k3_is"] == steps["n_d"])))
    seqs.update(trainer_sums(b, seq_all, seq_seg, t, v, seqs, clean))
    thr = max(top_threshold(steps["h_weight_k3_abs"], th.top_k), top_floor)
    cand = np.flatnonzero(v.w >= thr)
    if t.valid_d is not None:
        cand = cand[t.valid_d[cand]]
    rows_top = cand if idx is None else idx[cand]
    top = select_top(flag_rows(b, rank, rows_top, v.w[cand]), th.top_k) if th.top_k > 0 else {}
    bad_rows = np.flatnonzero(nf | inv)
    bad = select_first(flag_rows(b, rank, bad_rows, np.full(len(bad_rows), np.nan)), th.top_k) \
        if len(bad_rows) and th.top_k > 0 else {}
    return BatchResult(steps, seqs, top, bad)
