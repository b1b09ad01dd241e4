"""Decomposition: log(pi_theta/mu) = log(pi_theta/pi_old) + log(pi_old/mu), policy drift + engine mismatch.

Per step, and conditioned on the sampler's token probability (log-spaced buckets: the chart "When
Speed Kills Stability" uses to show the low-probability-token pitfall: mismatch grows as mu's
probability falls), on the token entropy and on the position in the completion. Tokens in the loss
of the first reuse iteration; a token without a sampler log-prob is left out of the mismatch terms.
Per group of tokens:

  drift_abs      mean |log pi_theta - log pi_old|
  mismatch_abs   mean |log pi_old - log mu|
  mismatch_mean  mean (log pi_old - log mu)   (a constant offset shows here)
  mismatch_k3    mean exp(d) - d - 1, d = log pi_old - log mu: K3 of KL(mu || pi_old) (verl rollout_corr/k3_kl)
  total_abs      mean |log pi_theta - log mu|
  mismatch_share mismatch_abs / (drift_abs + mismatch_abs)
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kldiag import estimators as E
from kldiag.mismatch.tokenset import TokenSet

PROB_EDGES = 10.0 ** np.arange(-8.0, 0.01, 0.5)  # mu's probability, half-decade buckets (1e-8 .. 1)
POS_EDGES = np.array([0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 1 << 40])
COLUMNS = ("tokens", "drift_abs", "mismatch_abs", "mismatch_mean", "mismatch_k3", "total_abs", "mismatch_share")


def terms(ts: TokenSet) -> dict[str, np.ndarray]:
    """Per-token drift = s - o, mismatch = o - m, total = s - m (float64, NaN where m is unknown), keep mask."""
    keep = ts.mask & np.isfinite(ts.logp) & np.isfinite(ts.logp_old)
    drift = ts.logp - ts.logp_old
    mismatch = ts.logp_old - ts.logp_sampler
    return {"drift": drift, "mismatch": mismatch, "total": drift + mismatch, "keep": keep}


MEANS = ("drift_abs", "mismatch_abs", "mismatch_mean", "mismatch_k3", "total_abs")  # rows 2..6 of summands()
BLOCK = 1 << 16  # tokens a block: a per-token temporary is a block's, not a fresh [N] array (see _sums)


def summands(ts: TokenSet, a: int, b: int) -> np.ndarray:
    """[7, b - a] float64, what a group sums for tokens a..b-1: keep and has_m (the two counts: kept, and kept
    with a sampler log-prob), then MEANS' terms, |drift| on the kept tokens and |d|, d, K3 (expm1 form: 0 near
    d = 0), |drift + d| on those with a sampler log-prob; 0 elsewhere (a NaN outside its tokens is never summed)."""
    logp, logp_old = ts.logp[a:b], ts.logp_old[a:b]
    keep = ts.mask[a:b] & np.isfinite(logp) & np.isfinite(logp_old)
    drift = logp - logp_old
    d = logp_old - ts.logp_sampler[a:b]
    has_m = keep & np.isfinite(d)
    z = np.empty((7, b - a))
    z[0], z[1] = keep, has_m
    np.abs(drift, out=z[2])
    np.abs(d, out=z[3])
    z[4], z[5] = d, E.k3_of_log_ratio(d)
    with np.errstate(invalid="ignore"):  # inf - inf outside the kept tokens: zeroed below
        np.add(drift, d, out=z[6])
    np.abs(z[6], out=z[6])
    z[2, ~keep] = 0.0
    z[3:, ~has_m] = 0.0
    return z


def bucket_index(x: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """int64: x's bucket [edges[i], edges[i + 1]) (below the first: 0, at or above the last: the last bucket),
    k = len(edges) - 1 where x is not finite (in no bucket). With a few edges (at most 256), the count of inner
    edges at or below x: searchsorted(edges, x, "right") - 1, clipped, from the same comparisons, about five
    times faster than its binary search per value."""
    k = len(edges) - 1
    if k > 255:
        idx = np.clip(np.searchsorted(edges, x, side="right") - 1, 0, k - 1)
    else:
        count, at = np.zeros(len(x), np.uint8), np.empty(len(x), bool)
        for e in edges[1:-1]:
            np.greater_equal(x, e, out=at)
            np.add(count, at, out=count, casting="unsafe")
        idx = count.astype(np.int64)
    idx[~np.isfinite(x)] = k
    return idx


def _prob(ts: TokenSet, a: int, b: int) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.exp(ts.logp_sampler[a:b])


def _pos(ts: TokenSet, a: int, b: int) -> np.ndarray:
    return ts.pos[a:b].astype(np.float64)


def _entropy(ts: TokenSet, a: int, b: int) -> np.ndarray:
    return ts.entropy[a:b]


def _step_values(step: np.ndarray) -> np.ndarray:
    """np.unique(step), without its sort when step is already sorted (a TokenSet's is)."""
    if len(step) < 2 or not bool(np.all(step[1:] >= step[:-1])):
        return np.unique(step)
    return step[np.r_[True, step[1:] != step[:-1]]]


def _sums(ts: TokenSet, axes: list, steps: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
    """(sums [7, *shape] of summands() per cell of `axes`, one (x_of(ts, a, b), edges) each: a token's cell is
    its bucket on each axis, bucket_index's k (no bucket) counted as one more, shape their len(edges); sums
    [7, len(steps)] per step of `steps` (its sorted values) or None).

    Block by block: numpy's bincount over a block's tokens (a step's: the sum of its run of tokens), each
    block's sums added. Not one compiled loop: this
    is the Mismatch page's first render, where numba's import and first kernel load cost about 0.35 s; and not
    [N] arrays: in a fresh process each new 16 MB array costs its page faults, more than the arithmetic (a
    2M-token sample: 0.6 s against 0.2 s). A sum is its tokens' in order within a block, then the blocks': the
    figures equal a one-pass sum's to rounding (about 1e-14 relative)."""
    shape = [len(edges) for _, edges in axes]
    n_cells = int(np.prod(shape))
    cells = np.zeros((7, n_cells))
    by_step = None if steps is None else np.zeros((7, len(steps)))
    for a in range(0, len(ts), BLOCK):
        b = min(a + BLOCK, len(ts))
        z = summands(ts, a, b)
        cell = np.zeros(b - a, np.int64)
        for x_of, edges in axes:
            cell *= len(edges)
            cell += bucket_index(x_of(ts, a, b), edges)
        for j in range(7):
            cells[j] += np.bincount(cell, weights=z[j], minlength=n_cells)
        if steps is not None:  # a run of one step's tokens at a time (a TokenSet is step-sorted: a run a step)
            step = ts.step[a:b]
            starts = np.flatnonzero(np.r_[True, step[1:] != step[:-1]])
            np.add.at(by_step.T, np.searchsorted(steps, step[starts]), np.add.reduceat(z, starts, axis=1).T)
    return cells.reshape(7, *shape), by_step


def _means(sums: np.ndarray) -> dict[str, np.ndarray]:
    """COLUMNS of groups from their sums [7, k] (summands' rows)."""
    n_keep, n_m = sums[0], sums[1]
    out: dict[str, np.ndarray] = {"tokens": n_keep.astype(np.int64)}
    with np.errstate(invalid="ignore", divide="ignore"):
        for j, c in enumerate(MEANS):
            out[c] = sums[2 + j] / (n_keep if c == "drift_abs" else n_m)
        out["mismatch_share"] = out["mismatch_abs"] / (out["drift_abs"] + out["mismatch_abs"])
    return out


def _step_table(steps: np.ndarray, sums: np.ndarray) -> pa.Table:
    g = _means(sums)
    return pa.table({"step": steps, **{c: g[c] for c in COLUMNS}})


def _bucket_table(edges: np.ndarray, sums: np.ndarray) -> pa.Table:
    """The buckets with a kept token (sums [7, len(edges)]: the last, no bucket, left out)."""
    g = _means(sums[:, :-1])
    table = pa.table({"lo": edges[:-1].astype(np.float64), "hi": edges[1:].astype(np.float64),
                      **{c: g[c] for c in COLUMNS}})
    return table.filter(pc.greater(table.column("tokens"), 0))


def _summary(sums: np.ndarray) -> dict[str, float]:
    g = _means(sums[:, None])
    return {c: (float(g[c][0]) if c != "tokens" else int(g[c][0])) for c in COLUMNS}


def by_step(ts: TokenSet) -> pa.Table:
    """step + COLUMNS: drift against mismatch, per step."""
    steps = _step_values(ts.step)
    return _step_table(steps, _sums(ts, [], steps)[1])


def _bucketed(ts: TokenSet, x_of, edges: np.ndarray) -> pa.Table:
    return _bucket_table(edges, _sums(ts, [(x_of, edges)], None)[0])


def by_sampler_prob(ts: TokenSet, edges: np.ndarray = PROB_EDGES) -> pa.Table:
    """lo, hi (mu's token probability) + COLUMNS: the low-probability-token pitfall."""
    return _bucketed(ts, _prob, np.asarray(edges, np.float64))


def entropy_edges(ts: TokenSet, n_buckets: int = 10) -> np.ndarray | None:
    """Equal-width edges over the recorded entropy of the tokens in the loss; None when none was recorded."""
    seen = ts.mask & np.isfinite(ts.entropy)
    if not seen.any():
        return None
    lo = float(np.min(ts.entropy, where=seen, initial=np.inf))
    hi = float(np.max(ts.entropy, where=seen, initial=-np.inf))
    return np.linspace(lo, (hi if hi > lo else lo + 1.0) + 1e-12, n_buckets + 1)


def by_entropy(ts: TokenSet, n_buckets: int = 10) -> pa.Table | None:
    """lo, hi (recorded entropy, nats; equal-width buckets) + COLUMNS; None when no entropy was recorded."""
    edges = entropy_edges(ts, n_buckets)
    return None if edges is None else _bucketed(ts, _entropy, edges)


def by_position(ts: TokenSet, edges: np.ndarray = POS_EDGES) -> pa.Table:
    """lo, hi (position in the completion, powers of two) + COLUMNS."""
    return _bucketed(ts, _pos, np.asarray(edges, np.float64))


def every_view(ts: TokenSet) -> dict:
    """by_step, by_sampler_prob, by_position, by_entropy and summary of ts in one pass: the sums per step and
    per (probability, position, entropy) cell; a bucketing's sums are its cells' (the same sums as its own
    grouping's, added in another order: equal to rounding), the summary's all of them."""
    ent = entropy_edges(ts)
    axes = [(_prob, PROB_EDGES), (_pos, POS_EDGES.astype(np.float64))] + ([(_entropy, ent)] if ent is not None else [])
    steps = _step_values(ts.step)
    cells, per_step = _sums(ts, axes, steps)
    n = len(axes)
    tables = [_bucket_table(edges, cells.sum(axis=tuple(a for a in range(1, n + 1) if a != i + 1)))
              for i, (_, edges) in enumerate(axes)]
    return {"by_step": _step_table(steps, per_step), "by_prob": tables[0], "by_pos": tables[1],
            "by_entropy": tables[2] if ent is not None else None, "summary": _summary(cells.reshape(7, -1).sum(axis=1))}


def summary(ts: TokenSet) -> dict[str, float]:
    """Run-level means of the decomposition (COLUMNS) over all kept tokens."""
    return _summary(_sums(ts, [], None)[0])
