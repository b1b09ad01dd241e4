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

from kldiag.integrations.trl.kernel import partials_kernel

METRIC_PREFIX = "kldiag/"

# Partial sums merged across micro-batches and ranks: summed, except the maxima.
_SUM_KEYS = ("tokens", "k3_sum", "k3_is_sum", "flagged", "weight_k3_abs_sum", "weight_k3_abs_flagged_sum",
             "nonfinite")
_MAX_KEYS = ("weight_k3_abs_max", "weight_k3_is_abs_max", "rho_max")


def batch_partials(logp: np.ndarray, logp_ref: np.ndarray | None, logp_old: np.ndarray | None,
                   mask: np.ndarray, logp_sampler: np.ndarray | None = None) -> dict[str, float]:
    """Partial sums of one micro-batch over its loss tokens. Inputs [B, T]; logp_old None = on-policy;
    logp_sampler (the engine's) enters the flags and the non-finite count only, as in the analysis.

    k3 / weight_k3 (Schulman 2020), k3_is / its weight (DeepSeek-V3.2 eq. 7/9), the per-token
    flags of docs/metrics.md. Non-finite weights stay +inf in the maxima; NaN ones are left out
    of the sums (counted in `nonfinite`). Per-token values are those of kldiag.estimators
    (tests/test_trl_metrics.py); one compiled pass that releases the GIL, because this runs
    once per recorded micro-batch, beside the training thread.
    """
    keep = np.asarray(mask, dtype=bool)
    s, r, o, u = (None if x is None else np.asarray(x) for x in (logp, logp_ref, logp_old, logp_sampler))
    if any(a is not None and a.shape != keep.shape for a in (s, r, o, u)):  # the kernel reads by index, unchecked
        raise ValueError("batch_partials: logp, logp_ref, logp_old, logp_sampler and mask must have one shape; got "
                         f"{[None if a is None else a.shape for a in (s, r, o, u)]} and mask {keep.shape}")
    # One kernel per dtype: float32 when every input is (widened in the kernel), else float64.
    dtype = np.float32 if all(a is None or a.dtype == np.float32 for a in (s, r, o, u)) else np.float64
    s = np.ascontiguousarray(s, dtype=dtype).ravel()
    r, o, u = (s if a is None else np.ascontiguousarray(a, dtype=dtype).ravel() for a in (r, o, u))
    keep = keep.ravel()

    sums, counts = partials_kernel(s, r, o, u, keep, logp_ref is not None)
    # Without a reference the kernel leaves the k3 sums, maxima and flags at 0.
    return dict(zip(_KERNEL_F, sums.tolist(), strict=True)) | dict(zip(_KERNEL_I, map(float, counts), strict=True))


# Outputs of the compiled pass, in order (trl_kernel.partials_kernel).
_KERNEL_F = ("k3_sum", "k3_is_sum", "weight_k3_abs_sum", "weight_k3_abs_flagged_sum", "weight_k3_abs_max",
             "weight_k3_is_abs_max", "rho_max")
_KERNEL_I = ("tokens", "flagged", "nonfinite")


def warm_kernel() -> None:
    """Compile (or load from numba's on-disk cache) both of the pass's dtypes before training starts:
    a first compile holds the GIL for about a second."""
    for dtype in (np.float32, np.float64):
        one = np.zeros((1, 1), dtype)
        batch_partials(one, one, one, np.ones((1, 1), bool))


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
