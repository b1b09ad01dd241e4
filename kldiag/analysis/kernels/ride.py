"""The analysis's compiled pass with the Estimators page's per-token work riding in it.

`fused_pass_est` is fused.fused_pass with estimator_kernel.token_pass's outputs made in the same loop: the
estimator comparison needs the d = logp_ref - logp, x = logp - logp_old, expm1(d) and exp(x) of every token
that the analysis computes, and most of its sums are the analysis's (k1 = -d, k2 = d^2 / 2, k3 and k3_is,
K3's and K3_IS's |weight| and their histograms), so a dashboard's first pass reads each column once,
exponentiates once and adds only what the analysis lacks (|d|, k3_clamped, flagged shares, the kept sets).
It is a second compiled function from the same source, not a run-time flag of the first: its chunk loop is
fused.chunk_sums' own, compiled with the extras (fused.make_chunk_sums(True); numba prunes them from the bare
one), and its sequence loop is made of fused_pass's helpers, so a bare `kldiag analyze` runs fused.fused_pass
with its loop no larger (partials.AnalysisReducer.carry, reduce.PartFold).

The two agree where every token in the loss has a finite d and x (and a reference log-prob). A chunk with
another token (NaN, +-inf, a null reference: findings, rare) runs estimator_kernel.chunk_sums on its rows,
which keeps the estimators' own conventions there (expm1 and exp of the raw values, not the analysis's
zeroed ones). So each partial equals its standalone pass's: the analysis's bit for bit (the same loop body
and order of sums), the estimators' counts, maxima, histograms, kept tokens and sample exactly and their
sums to rounding (added in other chunks): tests/test_fused_ride.py. The estimators' tokens are numbered in
row order as in token_pass; chunks are cut at sequence starts here, so each chunk's first row and first
token number go to chunk_r0 and chunk_j (estimator_kernel.token_rows_at reads them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kldiag.analysis.kernels import estimators as E
from kldiag.analysis.kernels import signal as SK
from kldiag.analysis.kernels.fused import (
    BAD_INVALID,
    BAD_NONFINITE,
    BIN_COPIES,
    CHUNK,
    COUNT_BITS,
    FIELD,
    JIT,
    SUMS,
    abs_bin,
    add_chunk,
    add_sequence,
    bad_rows_of,
    make_chunk_sums,
    pass_arrays,
    pass_result,
    start_sequence,
)
from kldiag.jit import njit

SATURATED = 4  # a bit of chunk_sums_est's code[i] besides estimator_kernel's TOKEN and FLAGGED
if E.CHUNK < CHUNK:
    raise ImportError("fused_ride: estimator_kernel's chunk buffers must hold a fused.CHUNK chunk")


# fused.chunk_sums' three tuples and packed bins, then the estimators' extras of the same rows: what
# estimator_kernel.chunk_sums gives beyond the analysis's sums on a chunk whose tokens in the loss all have a
# finite d and x (`normal`): sums of min(k3, clamp), |d|, K3_clamped's |weight|, the flagged |weight| of k2,
# k3_is and k3_clamped, k3_weight_lost ((v4, a1, a4, f1, f3, f4, lost)), maxima of |d| and of K3_clamped's
# |weight| and the flagged tokens' select rank (x1, x4, hi_f, as bits); packed_e[i] = row i's |d| bin,
# w_k3[i] its |K3 weight|, code[i] its TOKEN, FLAGGED and SATURATED bits. fused.chunk_sums' own source,
# compiled with the extras (fused.make_chunk_sums).
chunk_sums_est = make_chunk_sums(True)


@njit(inline="always", **JIT)
def normal_chunk(cf, ci, cb, extra, maxima):  # pragma: no cover - compiled
    """estimator_kernel.chunk_sums' tuple of a normal chunk from chunk_sums_est's: the analysis's sums where
    they are the estimators' (k1 = -d, k2 = d^2 / 2, k3, k3_is; K3's and K3_IS's |weight|, K3's flagged) and
    the extras. Counts: tokens, flagged and saturated are the analysis's; no k1, k2 or k3_clamped value is
    non-finite (d is finite), k3's and k3_is's are the tokens without a finite one."""
    low = (1 << COUNT_BITS) - 1
    v4, a1, a4, f1, f3, f4, lost = extra
    x1, x4, hi_f = maxima  # the select rank of every token: the analysis's max_w
    w1, w2 = ci[1], ci[2]
    tokens, flagged, clamped = (w1 >> (6 * COUNT_BITS)) & low, (w1 >> (5 * COUNT_BITS)) & low, \
        (w1 >> (2 * COUNT_BITS)) & low
    n_k3, n_k3_is = w2 & low, (w2 >> COUNT_BITS) & low
    c0 = (tokens | (flagged << COUNT_BITS) | (clamped << (2 * COUNT_BITS)) | ((tokens - n_k3) << (5 * COUNT_BITS))
          | ((tokens - n_k3_is) << (6 * COUNT_BITS)))
    return ((-cf[0], 0.5 * cf[1], cf[9], cf[10], v4), (a1, cf[2], cf[3], a4), (f1, cf[4], f3, f4),
            (np.int64(x1), cb[2], cb[3], np.int64(x4)), np.int64(c0), np.int64(0), lost, cb[2], np.int64(hi_f))


@njit(inline="always", **JIT)
def count_bins_est(packed_e, packed, code, rows, h, normal, saturated, bin_zero):  # pragma: no cover - compiled
    """Add a chunk's estimator bins into h [BIN_COPIES, 4, bins] (estimator_kernel.count_bins'). K3's, K3_IS's
    and K3_clamped's |weight| bins are the analysis's |weight| and |weight_is| bins, added from its histograms
    at the end; here: of a normal chunk, the |d| bins, and K3_clamped's saturated tokens moved from their K3
    bin to 0's (`saturated`: their count); of another, all four of estimator_kernel.chunk_sums, less the
    analysis's bins of its rows (packed)."""
    low = (1 << FIELD) - 1
    if normal:
        for t in range(rows):
            h[t % BIN_COPIES, 0, packed_e[t]] += 1
        if saturated:
            for t in range(rows):
                if code[t] & SATURATED:
                    h[0, 3, (packed[t] >> FIELD) & low] -= 1
                    h[0, 3, bin_zero] += 1
        return
    E.count_bins(packed_e, rows, h)
    for t in range(rows):
        p = packed[t]
        h[0, 1, (p >> FIELD) & low] -= 1
        h[0, 2, (p >> (2 * FIELD)) & low] -= 1
        h[0, 3, (p >> FIELD) & low] -= 1


@njit(**SUMS)
def fused_pass_est(starts, sidx, n_steps, s, o, r, m, adv, mask, bad, has, params, abs_grid, d_grid,
                   s_null, o_null, r_null, m_null, fsum, icount, hist, scal, top_w, top_j, worst_w,
                   worst_j, chunk_r0, chunk_j, group, ok, sig_par, sig_cnt, sig_val):  # pragma: no cover - compiled
    """fused.fused_pass's outputs, and estimator_kernel.token_pass's into fsum .. worst_j, from one pass over
    the rows. Arguments: fused_pass's; null masks bool [n] (r_null true at every row without a reference);
    token_pass's outputs; chunk_r0, chunk_j [n_seq + n // CHUNK + 1] (token_rows_at's: each chunk's first
    row and first token number; chunk_j's entry after the last chunk the tokens in all). The estimators'
    thresholds are the analysis's (params). With the learning signal riding (sig_cnt [n_seq, 3], sig_val
    [n_seq, 9]; else both [0, .]): group int64 [n], ok bool [n] all true (no column with a null), sig_par
    (tol, clamp), and each sequence's signal_kernel.signal_rows row written at its index (signal_kernel.run_row).
    Returns (fused_pass's nine, k3_weight_lost, number of chunks, whether each sequence had one group).

    A chunk some token in the loss of which has a non-finite d or x (or no reference) is not normal: there
    the estimators' own chunk_sums runs on its rows (rare: such tokens are findings)."""
    n_seq, auto = len(starts) - 1, 0 if has[4] != 0 else BAD_NONFINITE | BAD_INVALID
    out, acc = pass_arrays(len(s), n_seq, n_steps, abs_grid, d_grid)
    seq_f, seq_i, step_f, step_i, step_b, h_d, h_w, h_w_is, h_rho, bad_rows = out
    acc_f, acc_i, acc_b = acc
    packed = np.empty(CHUNK, np.int64)
    packed_e, w_k3, code = np.empty(E.CHUNK, np.int64), np.empty(E.CHUNK), np.empty(E.CHUNK, np.uint8)
    eparams = np.array([params[0], params[1], params[2], 0.0, -np.inf])  # estimator_kernel.chunk_sums'
    bin_zero = abs_bin(0.0, abs_grid[0], abs_grid[1], abs_grid[2])
    est_acc = E.accumulators(abs_grid, top_w, top_j, worst_w, worst_j)
    no_f, no_b, no_i = np.empty(0), np.empty(0, np.bool_), np.empty(0, np.int64)
    rho_k, sig_on, one_group = np.empty(E.CHUNK), len(sig_cnt) > 0, True
    n_bad_rows, tok, n_chunks, low = 0, 0, 0, (1 << COUNT_BITS) - 1
    for j in range(n_seq):
        k = start_sequence(sidx, j, acc)
        sig = SK.run_start()
        for c0 in range(starts[j], starts[j + 1], CHUNK):
            c1 = min(c0 + CHUNK, starts[j + 1])
            (cf, ci, cb), extra, maxima = chunk_sums_est(
                s[c0:c1], o[c0:c1], r[c0:c1], m[c0:c1], adv[c0:c1], mask[c0:c1], bad[c0:c1], has, params, abs_grid,
                d_grid, packed, packed_e, w_k3, code, rho_k)
            if add_chunk((cf, ci, cb), acc, packed, c1 - c0, h_d[k], h_w[k], h_w_is[k], h_rho[k]):
                n_bad_rows = bad_rows_of(c0, c1, s, o, r, m, mask, bad, auto, bad_rows, n_bad_rows)
            tokens = (ci[1] >> (6 * COUNT_BITS)) & low
            normal = (ci[0] & low) == tokens and ((ci[0] >> COUNT_BITS) & low) == tokens  # n_d, n_x
            if sig_on:  # before E.chunk_sums, which writes w_k3 its own way
                sig = ride_chunk(sig, normal, c0, c1, s, o, r, adv, mask, group, ok, rho_k, w_k3, sig_par)
                one_group = one_group and SK.one_key(group[c0:c1], group[starts[j]])
            if normal:
                est = normal_chunk(cf, ci, cb, extra, maxima)
            else:
                est = E.chunk_sums(s[c0:c1], o[c0:c1], r[c0:c1], m[c0:c1], s_null[c0:c1], o_null[c0:c1],
                                   r_null[c0:c1], m_null[c0:c1], mask[c0:c1], eparams, abs_grid, packed_e, w_k3, code)
            chunk_r0[n_chunks], chunk_j[n_chunks] = c0, tok
            n_chunks += 1
            count_bins_est(packed_e, packed, code, c1 - c0, est_acc[6], normal, (ci[1] >> (2 * COUNT_BITS)) & low,
                           bin_zero)
            tok = E.add_chunk(est, packed_e, w_k3, code, c1 - c0, c0, tok, est_acc, False, no_f, no_b, no_i, False)
        add_sequence(acc_f, acc_i, acc_b, seq_f[j], seq_i[j], step_f[k], step_i[k], step_b[k])
        if sig_on:
            SK.run_row(sig, sig_cnt[j], sig_val[j])
    chunk_j[n_chunks] = tok
    add_weight_bins(h_w, h_w_is, est_acc[6])
    lost = E.totals(est_acc, abs_grid, fsum, icount, hist, scal)
    return pass_result(out, n_bad_rows, abs_grid, d_grid) + (lost, n_chunks, one_group)


@njit(inline="always", **JIT)
def ride_chunk(sig, normal, c0, c1, s, o, r, adv, mask, group, ok, rho_k, w_k3, sig_par):  # pragma: no cover
    """A chunk's learning-signal sums added into its sequence's (signal_kernel.run_add): from this pass's rho and
    |K3 weight| on a normal chunk (signal_kernel.ride_sums), by the signal's own pass elsewhere (run_sums)."""
    tol, clamp = sig_par[0], sig_par[1]
    if normal:
        t = SK.ride_sums(mask[c0:c1], adv[c0:c1], s[c0:c1], r[c0:c1], rho_k, w_k3, tol, clamp)
    else:
        t = SK.run_sums(mask[c0:c1], adv[c0:c1], ok[c0:c1], s[c0:c1], ok[c0:c1], o[c0:c1], ok[c0:c1], r[c0:c1],
                        ok[c0:c1], tol, clamp)
    return SK.run_add(sig, t)


@njit(inline="always", **JIT)
def add_weight_bins(h_w, h_w_is, h):  # pragma: no cover - compiled
    """Add the analysis's |weight| and |weight_is| bins [n_steps, BIN_COPIES, bins] into the estimators' K3,
    K3_IS and K3_clamped bins of h [BIN_COPIES, 4, bins]."""
    for k in range(len(h_w)):
        for c in range(BIN_COPIES):
            for b in range(h_w.shape[2]):
                h[0, 1, b] += h_w[k, c, b]
                h[0, 2, b] += h_w_is[k, c, b]
                h[0, 3, b] += h_w[k, c, b]


@dataclass(frozen=True)
class EstimatorRide:
    """The Estimators page's reducer riding in the analysis's pass: its thresholds (the analysis's, or it
    does not ride: partials.AnalysisReducer.carry), its kept sets' sizes, take(b, out), called with each
    kernel.Batch and `run`'s outputs for it, and alone(batch), its own pass over a record batch that the
    analysis reads otherwise (stats.batch_partials: an empty one, one it sorts first)."""

    tau: float
    weight_limit: float
    clamp: float
    keep_top: int
    keep_flagged: int
    take: Callable[[Any, dict], None]
    alone: Callable[[Any], None]


@dataclass(frozen=True)
class SignalRide:
    """The learning-signal reducer riding in the Estimators page's ridden pass (fused_pass_est): its thresholds
    (signal_kernel.run_sums' tol and clamp), inputs(batch) ((group, ok): int64 [n] group ids with nulls filled, a
    read-only all-true bool [n]),
    take(b, starts, group, cnt, val) (signal_rows' counts and values of each sequence starting at starts[:-1];
    those without a loss token are all zeros) and alone(batch), its own pass over a batch the ride cannot read: one
    with a null log-prob or advantage, without pi_ref or an advantage, or a sequence of two groups."""

    tol: float
    clamp: float
    inputs: Callable[[Any], tuple[np.ndarray, np.ndarray]]
    take: Callable[[Any, np.ndarray, np.ndarray, np.ndarray, np.ndarray], None]
    alone: Callable[[Any], None]


# Read-only, as SignalRide.inputs' arrays are: numba compiles the ridden pass once per writeable flag
NO_GROUPS, NO_OK = np.empty(0, np.int64), np.empty(0, np.bool_)
NO_GROUPS.flags.writeable = NO_OK.flags.writeable = False


def signal_reads(b) -> bool:
    """Whether the signal can ride on kernel.Batch b: every log-prob and advantage without a null, pi_ref and the
    advantage present (ok all true in fused_pass_est; where not, the signal's own pass knows its nulls)."""
    return (not b.partial_nulls and b.raw["logp_ref"] is not None and b.raw["advantage"] is not None
            and b.null["advantage"] is None)


def run(b, starts, sidx, n_steps, inputs, nulls, params, abs_grid, d_grid, ride: EstimatorRide,
        signal: SignalRide | None = None) -> tuple:
    """fused_pass's tuple of one batch (inputs: stats.kernel_inputs(b); nulls: stats.null_masks(b); params: the
    analysis's, whose first three are the ride's thresholds); the estimators' outputs go to
    ride.take(b, out) as named arrays: fsum, icount, hist, scal (estimator_kernel.token_pass's),
    k3_weight_lost [1], top_j, worst_j (the kept token numbers), chunk_r0, chunk_j (token_rows_at's); with
    `signal`, its rows to signal.take (or the batch to signal.alone: signal_reads)."""
    fsum, icount = np.zeros((4, E.N_EST)), np.zeros((1, E.N_EST), np.int64)
    hist, scal = np.zeros((E.N_EST, abs_grid[2] + 1), np.int64), np.zeros(5, np.int64)
    top_w, top_j = np.empty(ride.keep_top), np.empty(ride.keep_top, np.int64)
    worst_w, worst_j = np.empty(ride.keep_flagged), np.empty(ride.keep_flagged, np.int64)
    cap = len(starts) + b.n // CHUNK + 1
    chunk_r0, chunk_j = np.empty(cap, np.int64), np.empty(cap, np.int64)
    sig_on = signal is not None and signal_reads(b)
    n_sig = len(starts) - 1 if sig_on else 0
    group, ok = signal.inputs(b.arrow) if sig_on else (NO_GROUPS, NO_OK)
    sig_cnt, sig_val = np.zeros((n_sig, 3), np.int64), np.empty((n_sig, 9))
    sig_par = np.array([signal.tol, signal.clamp]) if sig_on else np.zeros(2)
    res = fused_pass_est(starts, sidx, n_steps, *inputs, params, abs_grid, d_grid, *nulls,
                         fsum, icount, hist, scal, top_w, top_j, worst_w, worst_j, chunk_r0, chunk_j,
                         group, ok, sig_par, sig_cnt, sig_val)
    n_chunks = res[10]
    ride.take(b, {"fsum": fsum, "icount": icount, "hist": hist, "scal": scal, "k3_weight_lost": np.array([res[9]]),
                  "top_j": top_j[:scal[E.S_TOP]], "worst_j": worst_j[:scal[E.S_WORST]],
                  "chunk_r0": chunk_r0[:n_chunks], "chunk_j": chunk_j[:n_chunks + 1]})
    if signal is not None:
        if sig_on and res[11]:
            signal.take(b, starts, group, sig_cnt, sig_val)
        else:
            signal.alone(b.arrow)
    return res[:9]
