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
from kldiag.jit import njit
from kldiag.mismatch.tokenset import TokenSet, unique_inverse

PROB_EDGES = 10.0 ** np.arange(-8.0, 0.01, 0.5)  # mu's probability, half-decade buckets (1e-8 .. 1)
POS_EDGES = np.array([0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 1 << 40])
COLUMNS = ("tokens", "drift_abs", "mismatch_abs", "mismatch_mean", "mismatch_k3", "total_abs", "mismatch_share")


def terms(ts: TokenSet) -> dict[str, np.ndarray]:
    """Per-token drift = s - o, mismatch = o - m, total = s - m (float64, NaN where m is unknown), keep mask."""
    keep = ts.mask & np.isfinite(ts.logp) & np.isfinite(ts.logp_old)
    drift = ts.logp - ts.logp_old
    mismatch = ts.logp_old - ts.logp_sampler
    return {"drift": drift, "mismatch": mismatch, "total": drift + mismatch, "keep": keep}


MEANS = ("drift_abs", "mismatch_abs", "mismatch_mean", "mismatch_k3", "total_abs")  # columns 2..6 of _group_sums


def weights(ts: TokenSet) -> dict[str, np.ndarray]:
    """What every grouping sums, per token [N]: drift, mismatch d, its K3, keep and has_m (kept with a
    sampler log-prob: the tokens of the mismatch terms)."""
    t = terms(ts)
    d = t["mismatch"]
    return {"drift": t["drift"], "mismatch": d, "k3": E.k3_of_log_ratio(d),  # expm1 form: 0 near d = 0
            "keep": t["keep"], "has_m": t["keep"] & np.isfinite(d)}


@njit(nogil=True, cache=True)
def _group_sums(idx, k, drift, d, k3, keep, has_m):  # pragma: no cover - compiled
    """[k + 1, 7] per group: n_keep, n_m, then the sums of MEANS, each over its tokens in index order
    (the order np.bincount adds in: the same float64 sums); group k collects tokens of no group."""
    out = np.zeros((k + 1, 7))
    for i in range(len(idx)):
        if not keep[i]:
            continue
        g = idx[i]
        out[g, 0] += 1.0
        out[g, 2] += abs(drift[i])
        if has_m[i]:
            out[g, 1] += 1.0
            out[g, 3] += abs(d[i])
            out[g, 4] += d[i]
            out[g, 5] += k3[i]
            out[g, 6] += abs(drift[i] + d[i])
    return out


def _grouped(idx: np.ndarray, k: int, w: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """COLUMNS of groups 0..k-1 (idx [N]: a token's group; k: a token in no group), one pass over the tokens."""
    sums = _group_sums(np.asarray(idx, np.int64), k, w["drift"], w["mismatch"], w["k3"], w["keep"], w["has_m"])[:k]
    n_keep, n_m = sums[:, 0], sums[:, 1]
    out: dict[str, np.ndarray] = {"tokens": n_keep.astype(np.int64)}
    with np.errstate(invalid="ignore", divide="ignore"):
        for j, c in enumerate(MEANS):
            out[c] = sums[:, 2 + j] / (n_keep if c == "drift_abs" else n_m)
        out["mismatch_share"] = out["mismatch_abs"] / (out["drift_abs"] + out["mismatch_abs"])
    return out


def by_step(ts: TokenSet, w: dict[str, np.ndarray] | None = None) -> pa.Table:
    """step + COLUMNS: drift against mismatch, per step (`w`: weights(ts), when already at hand)."""
    steps, idx = unique_inverse(ts.step)
    g = _grouped(idx, len(steps), weights(ts) if w is None else w)
    return pa.table({"step": steps, **{c: g[c] for c in COLUMNS}})


def _bucketed(ts: TokenSet, x: np.ndarray, edges: np.ndarray, w: dict[str, np.ndarray] | None) -> pa.Table:
    k = len(edges) - 1
    idx = np.clip(np.searchsorted(edges, np.nan_to_num(x, nan=edges[0]), side="right") - 1, 0, k - 1)
    idx[~np.isfinite(x)] = k  # no bucket: left out of every group
    g = _grouped(idx, k, weights(ts) if w is None else w)
    table = pa.table({"lo": edges[:-1].astype(np.float64), "hi": edges[1:].astype(np.float64),
                      **{c: g[c] for c in COLUMNS}})
    return table.filter(pc.greater(table.column("tokens"), 0))


def by_sampler_prob(ts: TokenSet, edges: np.ndarray = PROB_EDGES, w: dict[str, np.ndarray] | None = None) -> pa.Table:
    """lo, hi (mu's token probability) + COLUMNS: the low-probability-token pitfall."""
    with np.errstate(over="ignore"):
        return _bucketed(ts, np.exp(ts.logp_sampler), edges, w)


def by_entropy(ts: TokenSet, n_buckets: int = 10, w: dict[str, np.ndarray] | None = None) -> pa.Table | None:
    """lo, hi (recorded entropy, nats; equal-width buckets) + COLUMNS; None when no entropy was recorded."""
    e = ts.entropy[ts.mask & np.isfinite(ts.entropy)]
    if not len(e):
        return None
    hi = float(e.max()) if e.max() > e.min() else float(e.min()) + 1.0
    return _bucketed(ts, ts.entropy, np.linspace(float(e.min()), hi + 1e-12, n_buckets + 1), w)


def by_position(ts: TokenSet, edges: np.ndarray = POS_EDGES, w: dict[str, np.ndarray] | None = None) -> pa.Table:
    """lo, hi (position in the completion, powers of two) + COLUMNS."""
    return _bucketed(ts, ts.pos.astype(np.float64), edges.astype(np.float64), w)


def every_view(ts: TokenSet) -> dict:
    """by_step, by_sampler_prob, by_position, by_entropy and summary of ts, from one weights(ts)."""
    w = weights(ts)
    return {"by_step": by_step(ts, w), "by_prob": by_sampler_prob(ts, w=w), "by_pos": by_position(ts, w=w),
            "by_entropy": by_entropy(ts, w=w), "summary": summary(ts, w)}


def summary(ts: TokenSet, w: dict[str, np.ndarray] | None = None) -> dict[str, float]:
    """Run-level means of the decomposition (COLUMNS) over all kept tokens."""
    g = _grouped(np.zeros(len(ts), np.int64), 1, weights(ts) if w is None else w)
    return {c: (float(g[c][0]) if c != "tokens" else int(g[c][0])) for c in COLUMNS}
