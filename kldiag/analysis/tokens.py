"""Per-token values of the masked tokens of a batch, each computed once (float64).

Only tokens in the loss (mask true) are kept, compressed. A token is *valid for d* when
logp_ref - logp is finite (a null or non-finite input makes it invalid) and *valid for x*
when logp - logp_old is finite; a null logp_old means on-policy (rho = 1, as the trainers
do). Invalid tokens hold 0 in the summed arrays, so sums need no masking, and NaN in
`rho`, which fmax/fmin skip.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kldiag.analysis.kernel import Batch, Seg, finite_sum


def _valid(v: np.ndarray) -> np.ndarray | None:
    ok = np.isfinite(v)
    return None if ok.all() else ok


def _both(a: np.ndarray | None, b: np.ndarray | None) -> np.ndarray | None:
    if a is None:
        return b
    return a if b is None else a & b


def _product(a: np.ndarray, b: np.ndarray, valid: np.ndarray | None) -> np.ndarray:
    """a * b where a = rho >= 0; 0 * inf is +-inf on a valid token (estimators), else 0."""
    with np.errstate(invalid="ignore", over="ignore"):
        out = a * b
    nan = np.isnan(out)
    if not nan.any():
        return out
    fixed = np.where(nan, np.sign(np.where(np.isinf(b), b, 1.0)) * np.inf, out)
    return fixed if valid is None else np.where(valid, fixed, np.where(nan, 0.0, out))


@dataclass
class Tokens:
    """Masked tokens [n]. valid_* None means every token is valid."""

    s: np.ndarray  # logp
    o: np.ndarray | None  # logp_old, logp where null (None: on-policy)
    m: np.ndarray | None  # logp_sampler (NaN at nulls; None: no sampler)
    d: np.ndarray  # logp_ref - logp; 0 where not valid_d
    valid_d: np.ndarray | None
    x0: np.ndarray  # logp - logp_old; 0 where not valid_x
    valid_x: np.ndarray | None
    rho: np.ndarray  # exp(x); NaN where not valid_x
    rho0: np.ndarray  # rho with 0 where not valid_x
    k3: np.ndarray  # expm1(d) - d
    w: np.ndarray  # |weight_k3| = |expm1(d)|
    k3_is: np.ndarray  # rho * k3
    w_is: np.ndarray  # |weight_k3_is| = rho * |d|
    valid_dx: np.ndarray | None
    has_ref: bool

    def count_d(self, seg: Seg) -> np.ndarray:
        return seg.lengths if self.valid_d is None else seg.count(self.valid_d)

    def count_x(self, seg: Seg) -> np.ndarray:
        return seg.lengths if self.valid_x is None else seg.count(self.valid_x)

    def count_dx(self, seg: Seg) -> np.ndarray:
        return seg.lengths if self.valid_dx is None else seg.count(self.valid_dx)

    def mismatch(self, seg: Seg) -> tuple[np.ndarray, np.ndarray]:
        """KL(mu || pi_old) per segment: mean k3 of z = log pi_old - log mu (tokens drawn from mu)."""
        if self.m is None:
            return np.zeros(seg.n), np.zeros(seg.n, np.int64)
        z = (self.s if self.o is None else self.o) - self.m
        valid = _valid(z)
        if valid is not None:
            z[~valid] = 0.0
        with np.errstate(over="ignore"):
            k3 = np.expm1(z) - z
        return finite_sum(seg, k3, seg.lengths if valid is None else seg.count(valid))

    def opsm(self) -> np.ndarray:
        """log mu - logp, mu = the sampler's log-prob, else logp_old, else logp (TRL's choice)."""
        base = self.s if self.o is None else self.o
        if self.m is None:
            y = base - self.s
        else:
            y = self.m - self.s
            nan = np.isnan(self.m)
            if nan.any():
                y[nan] = (base - self.s)[nan]
        return np.where(np.isfinite(y), y, 0.0) if not np.isfinite(y).all() else y


def masked_tokens(b: Batch, idx: np.ndarray | None) -> Tokens:
    """Per-token values of the masked tokens of `b` (`idx`: their rows, None = all rows)."""
    def take(a):
        if a is None:
            return None
        return (a if idx is None else a[idx]).astype(np.float64)

    s, r, o, m = (take(b.raw[k]) for k in ("logp", "logp_ref", "logp_old", "logp_sampler"))
    if o is not None and b.null["logp_old"] is not None:
        o_null = b.null["logp_old"] if idx is None else b.null["logp_old"][idx]
        o[o_null] = s[o_null]  # a row without logp_old is on-policy: rho = 1
    if r is None:
        d, valid_d = np.zeros_like(s), np.zeros(len(s), bool)
    else:
        d = r - s
        valid_d = _valid(d)
        if valid_d is not None:
            d[~valid_d] = 0.0
    x = np.zeros_like(s) if o is None else s - o
    valid_x = _valid(x)
    with np.errstate(over="ignore"):
        if valid_x is None:
            rho = rho0 = np.exp(x)
        else:
            x[~valid_x] = np.nan
            rho = np.exp(x)
            rho0 = np.where(valid_x, rho, 0.0)
            x[~valid_x] = 0.0
        em = np.expm1(d)
    k3 = em - d
    w = np.abs(em)
    valid_dx = _both(valid_d, valid_x)
    return Tokens(s, o, m, d, valid_d, x, valid_x, rho, rho0, k3, w, _product(rho0, k3, valid_dx),
                  _product(rho0, np.abs(d), valid_dx), valid_dx, r is not None)
