"""exp and expm1 in float64 that LLVM vectorises inside a numba loop.

numba lowers math.exp to a scalar libm call (about 5 ns here), five times numpy's SIMD
exp; calling numpy instead means batch-sized float64 temporaries, whose memory traffic
cost more than the arithmetic (bench/analyze.py). These are branch-free, so a kernel
loop that calls them runs 8 lanes at a time with AVX-512 (4 with AVX2).

Method (Cody & Waite 1980; Tang 1989): x = n ln2 + r with |r| <= ln2 / 2, expm1(r) by its
Taylor series to r^13 (truncation below 2^-60 relative), then exp(x) = 2^n (1 + expm1(r))
and expm1(x) = 2^n expm1(r) + (2^n - 1). 2^n is built from its exponent bits in two halves
so that n may reach 1024 or -1077 without overflowing the bit field. Accuracy against
numpy, float64 (tests/test_analysis_kernel.py): exp within 1 ulp, expm1 within 2 ulp;
NaN, +-inf, overflow and underflow as numpy.

Compiled without fastmath "reassoc": reassociation would undo the Cody-Waite split.
"""

from __future__ import annotations

import math

import numpy as np

from kldiag.jit import njit

EXACT = {"contract"}  # fused multiply-adds only: no reassociation, NaN and inf kept
JIT = dict(cache=True, nogil=True, error_model="numpy", fastmath=EXACT)

INV_LN2 = 1.4426950408889634
LN2_HI = 6.93147180369123816490e-01  # ln 2 split so that n * LN2_HI is exact for |n| < 2^11
LN2_LO = 1.90821492927058770002e-10
X_MAX = 709.782712893384  # log(largest float64): exp overflows above
SHIFTER = 6755399441055744.0  # 1.5 * 2^52: x + SHIFTER is x rounded to an integer, for |x| < 2^51
SHIFTER_BITS = 0x4338_0000_0000_0000  # its float64 bits
_C = tuple(1.0 / math.factorial(k) for k in range(2, 14))
C2, C3, C4, C5, C6, C7, C8, C9, C10, C11, C12, C13 = _C


@njit(**JIT)
def reduce(x):
    """(2^h, 2^(n-h), expm1(r)) with x = n ln2 + r, h = n // 2; x clamped to [-746, 710]."""
    xc = min(max(x, -746.0), 710.0)
    # n = rint(x / ln2) by the shifter: adding 1.5 * 2^52 rounds to an integer, held in the low bits of the sum's
    # mantissa, so n as an int64 is a subtraction of bits. np.int64(np.rint(...)) needs AVX-512DQ's vcvttpd2qq to
    # vectorise: with AVX2 alone (AMD before Zen 4) LLVM converted lane by lane (1.78 ns an exp against 1.24).
    shifted = xc * INV_LN2 + SHIFTER
    n = shifted - SHIFTER
    r = (xc - n * LN2_HI) - n * LN2_LO
    p = C13
    p = p * r + C12
    p = p * r + C11
    p = p * r + C10
    p = p * r + C9
    p = p * r + C8
    p = p * r + C7
    p = p * r + C6
    p = p * r + C5
    p = p * r + C4
    p = p * r + C3
    p = p * r + C2
    pm1 = r + r * r * p
    ni = np.float64(shifted).view(np.int64) - SHIFTER_BITS
    h = ni >> 1
    s1 = np.int64((h + 1023) << 52).view(np.float64)
    s2 = np.int64((ni - h + 1023) << 52).view(np.float64)
    return s1, s2, pm1


@njit(**JIT)
def exp(x):
    """numpy.exp(x) within 1 ulp, for one float64 (NaN in, NaN out)."""
    s1, s2, p = reduce(x)
    v = (s1 * p + s1) * s2
    v = np.inf if x > X_MAX else v
    return x if x != x else v


@njit(**JIT)
def expm1(x):
    """numpy.expm1(x) within 2 ulp, for one float64 (NaN in, NaN out)."""
    s1, s2, p = reduce(x)
    s = s1 * s2  # exact while n <= 1023, that is x <= 709
    v = s * p + (s - 1.0)
    v = (s1 * p + s1) * s2 if x > 709.0 else v  # 2^n - 1 = 2^n there, and 2^n itself may overflow
    v = np.inf if x > X_MAX else v
    return x if x != x else v


@njit(**JIT)
def exp_array(x, out):
    """out[i] = exp(x[i]): the vectorised loop, for tests and benchmarks."""
    for i in range(len(x)):
        out[i] = exp(x[i])


@njit(**JIT)
def expm1_array(x, out):
    for i in range(len(x)):
        out[i] = expm1(x[i])
