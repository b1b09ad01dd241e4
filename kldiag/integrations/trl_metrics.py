"""The `kldiag/...` metrics the TRL hook adds to the trainer's logs (kldiag.integrations.trl).

Per micro-batch partial sums over its loss tokens (batch_partials), merged associatively
across micro-batches (merge_partials, in recording order) and ranks (_reduce_across_ranks),
turned into metrics at each log (log_metrics). The hook computes the partials in the
recorder's writer thread from its host copies (Recorder.observe), or on the training thread
when a guard, live histograms or sampling need that.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kldiag import estimators as E

METRIC_PREFIX = "kldiag/"

# Partial sums merged across micro-batches and ranks: summed, except the maxima.
_SUM_KEYS = ("tokens", "k3_sum", "k3_is_sum", "flagged", "weight_k3_abs_sum", "weight_k3_abs_flagged_sum",
             "nonfinite")
_MAX_KEYS = ("weight_k3_abs_max", "weight_k3_is_abs_max", "rho_max")


def batch_partials(logp: np.ndarray, logp_ref: np.ndarray | None, logp_old: np.ndarray | None,
                   mask: np.ndarray) -> dict[str, float]:
    """Partial sums of one micro-batch over its loss tokens. Inputs [B, T]; logp_old None = on-policy.

    k3 / weight_k3 (Schulman 2020), k3_is / its weight (DeepSeek-V3.2 eq. 7/9), flags of
    DESIGN.md section 3. Non-finite weights stay +inf in the maxima; NaN ones are left out
    of the sums (counted in `nonfinite`). The values are those of kldiag.estimators, each
    intermediate (d, expm1(d), rho) computed once: this runs once per recorded micro-batch.
    """
    keep = np.asarray(mask, dtype=bool)
    s = np.asarray(logp, dtype=np.float64)[keep]
    o = s if logp_old is None else np.asarray(logp_old, dtype=np.float64)[keep]
    out = dict.fromkeys(_SUM_KEYS, 0.0) | dict.fromkeys(_MAX_KEYS, 0.0)
    out["tokens"] = float(s.size)
    if s.size == 0:
        return out
    with np.errstate(over="ignore", invalid="ignore"):
        rho = np.exp(s - o)  # E.rho
        out["rho_max"] = _nanmax(rho)
        if logp_ref is None:
            out["nonfinite"] = float(np.count_nonzero(~np.isfinite(s) | ~np.isfinite(o)))
            return out
        r = np.asarray(logp_ref, dtype=np.float64)[keep]
        d = r - s  # E.log_ratio
        em1 = np.expm1(d)
        k3 = np.where(d == np.inf, np.inf, em1 - d)  # E.k3
        w_abs = np.abs(em1)  # |E.weight_k3|
        nonfinite = ~(np.isfinite(s) & np.isfinite(r) & np.isfinite(o))
        invalid = (s > 0) | (r > 0) | (o > 0)  # E.flag_invalid up to +inf, which `nonfinite` holds anyway
        flagged = (d > np.log(E.TAU)) | (w_abs > E.WEIGHT_LIMIT) | (k3 > E.CLAMP) | nonfinite | invalid
        k3_is = _product(rho, k3)  # E.k3_is
        w_is = _product(rho, -d)  # E.weight_k3_is: s - r == -d exactly
    summable = ~np.isnan(w_abs)
    out.update(
        k3_sum=_nansum(k3), k3_is_sum=_nansum(k3_is), flagged=float(np.count_nonzero(flagged)),
        weight_k3_abs_sum=float(np.sum(w_abs[summable])),
        weight_k3_abs_flagged_sum=float(np.sum(w_abs[summable & flagged])),
        nonfinite=float(np.count_nonzero(nonfinite)),
        weight_k3_abs_max=_nanmax(w_abs), weight_k3_is_abs_max=_nanmax(np.abs(w_is)))
    return out


def _product(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a * b with E._nan_to_inf_product's rule for 0 * inf, whose mask is built only when a NaN appears."""
    out = a * b
    return E._nan_to_inf_product(out, a, b) if np.isnan(out).any() else out


def _nansum(x: np.ndarray) -> float:
    return float(np.sum(x[~np.isnan(x)]))


def _nanmax(x: np.ndarray) -> float:
    x = x[~np.isnan(x)]
    return float(np.max(x)) if x.size else 0.0


def merge_partials(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """Associative merge of two `batch_partials` results."""
    return {k: a[k] + b[k] for k in _SUM_KEYS} | {k: max(a[k], b[k]) for k in _MAX_KEYS}


def log_metrics(p: dict[str, float], has_ref: bool) -> dict[str, float]:
    """The `kldiag/...` metrics added to TRL's logs, from merged partials.

    Means here are token-weighted over the logging window (TRL's `kl` is a mean of
    micro-batch means). blame_share: share of the total |k3 weight| carried by flagged tokens.
    """
    n = max(p["tokens"], 1.0)
    out = {"rho_max": p["rho_max"], "nonfinite_count": p["nonfinite"]}
    if has_ref:
        total = p["weight_k3_abs_sum"]
        blame = 1.0 if np.isinf(total) else (p["weight_k3_abs_flagged_sum"] / total if total > 0 else 0.0)
        out.update(k3_mean=p["k3_sum"] / n, k3_is_mean=p["k3_is_sum"] / n, flagged_frac=p["flagged"] / n,
                   blame_share=blame, weight_k3_abs_max=p["weight_k3_abs_max"],
                   weight_k3_is_abs_max=p["weight_k3_is_abs_max"])
    return {METRIC_PREFIX + k: float(v) for k, v in out.items()}


def _reduce_across_ranks(p: dict[str, float], accelerator: Any) -> dict[str, float]:
    if int(accelerator.num_processes) == 1:
        return p
    import torch

    keys = (*_SUM_KEYS, *_MAX_KEYS)
    local = torch.tensor([p[k] for k in keys], dtype=torch.float64, device=accelerator.device)
    every = accelerator.gather(local).view(-1, len(keys)).cpu().numpy()
    merged = dict(zip(_SUM_KEYS, every[:, :len(_SUM_KEYS)].sum(axis=0), strict=True))
    return merged | dict(zip(_MAX_KEYS, every[:, len(_SUM_KEYS):].max(axis=0), strict=True))
