"""One compiled pass over a micro-batch for the TRL hook's log metrics (trl_metrics.batch_partials).

Per-token maths is that of kldiag.estimators (docs/metrics.md, "Per-token estimators"), in float64:

    d = logp_ref - logp    rho = exp(logp - logp_old)    k3 = expm1(d) - d    |weight_k3| = |expm1(d)|
    k3_is = rho * k3 (DeepSeek-V3.2 eq. 7)    weight_k3_is = rho * (logp - logp_ref) (eq. 9)

with estimators._nan_to_inf_product's rule for 0 * inf, and NaN values left out of sums and
maxima. numpy would spend some thirty array operations on this; on the hook's micro-batches
(a few hundred tokens) their per-call cost, paid while holding the GIL beside the training
thread, was the bulk of the writer's CPU. Compiled once and cached on disk; releases the GIL.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from kldiag import estimators as E

JIT = dict(cache=True, nogil=True, error_model="numpy")
LOG_TAU = math.log(E.TAU)


@njit(inline="always", **JIT)
def product(a, b):
    """a * b; a NaN from 0 * inf of non-NaN factors is +-inf (estimators._nan_to_inf_product)."""
    out = a * b
    if math.isnan(out) and not math.isnan(a) and not math.isnan(b):
        sign = (math.copysign(1.0, a) if math.isinf(a) else 1.0) * (math.copysign(1.0, b) if math.isinf(b) else 1.0)
        return sign * math.inf
    return out


@njit(**JIT)
def partials_kernel(s, r, o, keep, has_ref):
    """Sums, maxima and counts over the tokens where `keep`; inputs [N]: s, r, o of one float
    dtype (float32 is widened as it is read), keep bool.

    Returns (f, c): f = k3_sum, k3_is_sum, weight_k3_abs_sum, weight_k3_abs_flagged_sum,
    weight_k3_abs_max, weight_k3_is_abs_max, rho_max; c = tokens, flagged, nonfinite
    (trl_metrics._KERNEL_F / _KERNEL_I). Without a reference (has_ref False) only rho_max,
    tokens and nonfinite (of logp and logp_old) are filled.
    """
    f = np.zeros(7)
    c = np.zeros(3, np.int64)
    for i in range(s.size):
        if not keep[i]:
            continue
        # float(x) of a float32 stays float32 in numba; the maths is float64, as in estimators.
        si, oi, ri = np.float64(s[i]), np.float64(o[i]), np.float64(r[i])
        c[0] += 1
        rho = math.exp(si - oi)
        if rho > f[6]:  # rho >= 0: a max from 0 equals the max of the non-NaN values (0 if none)
            f[6] = rho
        finite = math.isfinite(si) and math.isfinite(oi) and (not has_ref or math.isfinite(ri))
        if not finite:
            c[2] += 1
        if not has_ref:
            continue
        d = ri - si
        em1 = math.expm1(d)
        k3 = math.inf if d == math.inf else em1 - d
        w = abs(em1)
        flagged = (d > LOG_TAU or w > E.WEIGHT_LIMIT or k3 > E.CLAMP or not finite
                   or si > 0 or ri > 0 or oi > 0)  # > 0 of +inf is also nonfinite: the union is unchanged
        k3_is = product(rho, k3)
        w_is = abs(product(rho, -d))
        if not math.isnan(k3):
            f[0] += k3
        if not math.isnan(k3_is):
            f[1] += k3_is
        if not math.isnan(w):
            f[2] += w
            if flagged:
                f[3] += w
            if w > f[4]:
                f[4] = w
        if w_is > f[5]:
            f[5] = w_is
        if flagged:
            c[1] += 1
    return f, c
