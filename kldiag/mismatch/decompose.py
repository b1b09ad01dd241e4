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


MEANS = ("drift_abs", "mismatch_abs", "mismatch_mean", "mismatch_k3", "total_abs")


def weights(ts: TokenSet) -> dict[str, np.ndarray]:
    """Per token [N], for every grouping at once: each mean's summand where it counts and 0.0 elsewhere
    ("drift_abs" over kept tokens, the mismatch terms over kept tokens with a sampler log-prob), and
    the two counts as 0/1 ("n_keep", "n_m"). A group's sum then runs over every token in index order,
    adding 0.0 for the others: the same float64 sum, bit for bit, as over its selected tokens alone."""
    t = terms(ts)
    keep = t["keep"]
    has_m = keep & np.isfinite(t["mismatch"])
    d = t["mismatch"]
    k3 = E.k3_of_log_ratio(d)  # the expm1 form: exp(d) - d - 1 is 0 near d = 0
    return {"drift_abs": np.where(keep, np.abs(t["drift"]), 0.0), "mismatch_abs": np.where(has_m, np.abs(d), 0.0),
            "mismatch_mean": np.where(has_m, d, 0.0), "mismatch_k3": np.where(has_m, k3, 0.0),
            "total_abs": np.where(has_m, np.abs(t["total"]), 0.0),
            "n_keep": keep.astype(np.float64), "n_m": has_m.astype(np.float64)}


def _grouped(idx: np.ndarray, k: int, w: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """COLUMNS of groups 0..k-1 (idx [N]: a token's group; k: a token in no group)."""
    def total(x):
        return np.bincount(idx, weights=x, minlength=k + 1)[:k]

    n_keep, n_m = total(w["n_keep"]), total(w["n_m"])
    out: dict[str, np.ndarray] = {"tokens": n_keep.astype(np.int64)}
    with np.errstate(invalid="ignore", divide="ignore"):
        for c in MEANS:
            out[c] = total(w[c]) / (n_keep if c == "drift_abs" else n_m)
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
