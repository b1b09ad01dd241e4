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


def _grouped(idx: np.ndarray, k: int, t: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    keep, has_m = t["keep"], t["keep"] & np.isfinite(t["mismatch"])

    def mean(x, sel):
        n = np.bincount(idx[sel], minlength=k)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.bincount(idx[sel], weights=x[sel], minlength=k) / n

    d = t["mismatch"]
    k3 = E.k3_of_log_ratio(d)  # the expm1 form: exp(d) - d - 1 is 0 near d = 0
    out = {"tokens": np.bincount(idx[keep], minlength=k), "drift_abs": mean(np.abs(t["drift"]), keep),
           "mismatch_abs": mean(np.abs(d), has_m), "mismatch_mean": mean(d, has_m), "mismatch_k3": mean(k3, has_m),
           "total_abs": mean(np.abs(t["total"]), has_m)}
    with np.errstate(invalid="ignore", divide="ignore"):
        out["mismatch_share"] = out["mismatch_abs"] / (out["drift_abs"] + out["mismatch_abs"])
    return out


def by_step(ts: TokenSet) -> pa.Table:
    """step + COLUMNS: drift against mismatch, per step."""
    steps, idx = np.unique(ts.step, return_inverse=True)
    g = _grouped(idx.reshape(-1), len(steps), terms(ts))
    return pa.table({"step": steps, **{c: g[c] for c in COLUMNS}})


def _bucketed(ts: TokenSet, x: np.ndarray, edges: np.ndarray) -> pa.Table:
    t = terms(ts)
    t["keep"] = t["keep"] & np.isfinite(x)
    idx = np.clip(np.searchsorted(edges, np.nan_to_num(x, nan=edges[0]), side="right") - 1, 0, len(edges) - 2)
    g = _grouped(idx, len(edges) - 1, t)
    table = pa.table({"lo": edges[:-1].astype(np.float64), "hi": edges[1:].astype(np.float64),
                      **{c: g[c] for c in COLUMNS}})
    return table.filter(pc.greater(table.column("tokens"), 0))


def by_sampler_prob(ts: TokenSet, edges: np.ndarray = PROB_EDGES) -> pa.Table:
    """lo, hi (mu's token probability) + COLUMNS: the low-probability-token pitfall."""
    with np.errstate(over="ignore"):
        return _bucketed(ts, np.exp(ts.logp_sampler), edges)


def by_entropy(ts: TokenSet, n_buckets: int = 10) -> pa.Table | None:
    """lo, hi (recorded entropy, nats; equal-width buckets) + COLUMNS; None when no entropy was recorded."""
    e = ts.entropy[ts.mask & np.isfinite(ts.entropy)]
    if not len(e):
        return None
    hi = float(e.max()) if e.max() > e.min() else float(e.min()) + 1.0
    return _bucketed(ts, ts.entropy, np.linspace(float(e.min()), hi + 1e-12, n_buckets + 1))


def by_position(ts: TokenSet, edges: np.ndarray = POS_EDGES) -> pa.Table:
    """lo, hi (position in the completion, powers of two) + COLUMNS."""
    return _bucketed(ts, ts.pos.astype(np.float64), edges.astype(np.float64))


def summary(ts: TokenSet) -> dict[str, float]:
    """Run-level means of the decomposition (COLUMNS) over all kept tokens."""
    g = _grouped(np.zeros(len(ts), np.int64), 1, terms(ts))
    return {c: (float(g[c][0]) if c != "tokens" else int(g[c][0])) for c in COLUMNS}
