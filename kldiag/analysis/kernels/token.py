"""Per-token maths of the compiled pass (fused.py), inlined into its loops.

It is that of kldiag.estimators (docs/metrics.md, "Per-token estimators"), from d = logp_ref - logp
and x = logp - logp_old, each float32 input converted to float64 as it is read:

    k1 = -d    k2 = d^2 / 2    k3 = expm1(d) - d    weight_k3 = -expm1(d)
    rho = exp(x)    k3_is = rho * k3    weight_k3_is = rho * (-d)

`token` is the one place these are computed, with fastexp's vectorised exp and expm1;
tests/test_analysis_kernel.py checks it against estimators.py (within 2 ulp). A token is
*valid for d* when d is finite and *valid for x* when x is finite (a null logp_old means
on-policy: x = 0). Invalid tokens hold 0 in every sum and are not binned; sums keep
finite summands only and count them (docs/metrics.md). logp_old and logp_sampler are read
only on tokens in the loss (mask true): elsewhere (tool output, prompt echo inside a completion)
a dump may hold a placeholder (0.0, NaN) that is neither a mismatch nor a numerical fault.
"""

from __future__ import annotations

import numpy as np

from kldiag.analysis.kernels import fastexp
from kldiag.jit import njit

JIT = dict(cache=True, nogil=True, error_model="numpy")
# Per-token helpers are inlined into the kernel by numba (inline="always"): left to LLVM,
# which declines to inline functions this large, the calls keep the loop from vectorising.
# Sums may be reordered (vectorised reductions); NaN and inf are still honoured.
SUMS = dict(JIT, fastmath={"reassoc", "contract", "nsz"})
BAD_NONFINITE, BAD_INVALID = 1, 2  # bits of the per-row code of bad log-probs
MANT = (1 << 52) - 1
NONE_BITS = -1  # int64 bits of "no value yet" for maxima of values >= +0.0
MIN_NONE_BITS = 0x7FF8_0000_0000_0000  # above +inf's bits: "no value yet" for minima


@njit(inline="always", **JIT)
def finite(v):
    """math.isfinite, safe under fastmath "reassoc": numba's isfinite is folded to True there."""
    return abs(v) < np.inf


@njit(inline="always", **JIT)
def abs_bin(v, m1, k0, n_edges):
    """bins.abs_bins for one value >= +0.0: exponent and mantissa bits against the edges'."""
    b = np.float64(v).view(np.int64)
    k = 2 * (b >> 52) - k0 + np.int64((b & MANT) >= m1)
    return min(max(k, 0), n_edges)


@njit(inline="always", **JIT)
def d_bin(d, inv_step, offset, n_edges):
    """bins.d_bins for one value: exact arithmetic on uniform edges with a power-of-two step."""
    k = np.floor(d * inv_step)  # a float: math.floor returns an int64, which overflows
    k = min(max(k, -offset - 1.0), n_edges - 1.0 - offset)
    # through int32 (|k| <= n_edges): AVX2 converts doubles to int32 four at a time, to int64 one by one
    return np.int64(np.int32(k)) + np.int64(offset) + 1


@njit(inline="always", **JIT)
def token(sv, ov, rv):
    """(d, valid_d, x, valid_x, rho, k3, w, k3_is, w_is) of one token, float64 inputs.

    Invalid: d = 0, x = 0, rho = NaN, k3_is = w_is = 0. rho * k3 and rho * |d| are 0 * inf
    only at a valid token, where estimators.py gives +inf (the limit of the product).
    """
    d = rv - sv
    valid_d = finite(d)
    d = d if valid_d else 0.0
    x = sv - ov
    valid_x = finite(x)
    x = x if valid_x else 0.0
    em = fastexp.expm1(d)
    rho = fastexp.exp(x)
    k3 = em - d  # >= 0: expm1(d) >= d
    w = abs(em)
    k3_is = rho * k3
    k3_is = np.inf if k3_is != k3_is else k3_is
    w_is = rho * abs(d)
    w_is = np.inf if w_is != w_is else w_is
    both = valid_d & valid_x
    return (d, valid_d, x, valid_x, rho if valid_x else np.nan, k3, w, k3_is if both else 0.0,
            w_is if both else 0.0)


@njit(inline="always", **JIT)
def above_one(v):
    """A finite log-prob above 0, i.e. a probability above one (+inf is non-finite, not this:
    kldiag.estimators.flag_invalid)."""
    return (v > 0.0) & (v < np.inf)


@njit(inline="always", **JIT)
def bad_code(sv, ov, rv, mv, mk):
    """(BAD_NONFINITE | BAD_INVALID bits of one row's raw log-probs, whether its logp_old, whether its
    logp_sampler is a placeholder). Absent columns repeat s. logp_old and logp_sampler are read only
    in the loss (mk); outside it a value of 0.0 or NaN/inf is a dump's placeholder (counted only).
    One set of finiteness tests serves both: no select, no branch."""
    fo, fm = finite(ov), finite(mv)
    ok = finite(sv) & finite(rv) & (fo | (not mk)) & (fm | (not mk))
    invalid = above_one(sv) | above_one(rv) | (mk & (above_one(ov) | above_one(mv)))
    out = not mk
    return (np.int64(not ok) * BAD_NONFINITE + np.int64(invalid) * BAD_INVALID,
            out & ((ov == 0.0) | (not fo)), out & ((mv == 0.0) | (not fm)))


@njit(inline="always", **JIT)
def mismatch(sv, ov, mv, masked, has_m):
    """(y, k3 of z = o - m, z valid) of one token: y = m - s (o - s without a sampler value)."""
    use_m = has_m & (mv == mv)
    y = (mv if use_m else ov) - sv
    z = ov - mv
    zok = has_m & masked & finite(z)
    z = z if zok else 0.0
    kz = fastexp.expm1(z) - z
    return y, kz, zok & finite(kz)


@njit(inline="always", **JIT)
def bits(v):
    return np.float64(v).view(np.int64)


@njit(inline="always", **JIT)
def from_bits(b, none):
    return np.nan if b == none else np.int64(b).view(np.float64)
