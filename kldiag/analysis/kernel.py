"""The streaming kernel: one record batch -> per-step, per-sequence and flag partials.

Per-token maths is that of kldiag.estimators (DESIGN.md section 2), derived from
d = logp_ref - logp and x = logp - logp_old computed once (tests/test_analysis_kernel.py
checks every value against estimators.py):

    k1 = -d    k2 = d^2 / 2    k3 = expm1(d) - d    weight_k3 = -expm1(d)
    rho = exp(x)    k3_is = rho * k3    weight_k3_is = rho * (-d)

Everything is float64. Only tokens in the loss (mask true) enter the step and sequence
metrics; a metric's sums skip tokens where its value is not finite (counted separately),
so a NaN never turns a mean into NaN. Batches are grouped by step and by (step, seq) with
np.add.reduceat over runs of equal keys: recorder files are step-ordered, so no sort.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from kldiag.analysis import bins
from kldiag.analysis.types import ABS_EDGES, D_EDGES

LOGPS = ("logp", "logp_old", "logp_ref", "logp_sampler")
COLUMNS = ("step", "micro", "iteration", "seq", "group", "pos", "token_id", *LOGPS, "advantage", "mask")
N_D, N_ABS = len(D_EDGES) + 1, len(ABS_EDGES) + 1
_ABS = bins.abs_table()
D_ZERO_BIN = int(np.searchsorted(D_EDGES, 0.0, side="right"))


@dataclass(frozen=True)
class Thresholds:
    """What the kernel needs from AnalysisConfig (resolved clip range)."""

    tau: float
    weight_limit: float
    clamp: float
    clip_low: float
    clip_high: float
    top_k: int


def token_values(s: np.ndarray, r: np.ndarray, o: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Per-token values the kernel uses, from float64 log-probs [n] (o None: on-policy).

    Shapes [n]. Overflow gives +-inf, and a product 0 * inf of finite inputs gives +inf,
    as in estimators._nan_to_inf_product.
    """
    d = r - s
    x = np.zeros_like(s) if o is None else s - o
    with np.errstate(over="ignore", invalid="ignore"):
        em = np.expm1(d)
        k3 = np.where(d == np.inf, np.inf, em - d)
        rho = np.exp(x)
        k3_is = rho * k3
        w_is = rho * -d
    k3_is = _nan_to_inf(k3_is, rho, k3, 1.0)
    w_is = _nan_to_inf(w_is, rho, d, -1.0)
    return {"d": d, "x": x, "k1": -d, "k2": 0.5 * d * d, "k3": k3, "weight_k3": -em,
            "rho": rho, "k3_is": k3_is, "weight_k3_is": w_is}


def _nan_to_inf(out: np.ndarray, a: np.ndarray, b: np.ndarray, sign_b: float) -> np.ndarray:
    bad = np.isnan(out)
    if not bad.any():
        return out
    bad &= ~np.isnan(a) & ~np.isnan(b)
    sign = np.sign(np.where(np.isinf(a), a, 1.0)) * np.sign(np.where(np.isinf(b), sign_b * b, 1.0))
    return np.where(bad, sign * np.inf, out)


# ---- columns -------------------------------------------------------------------------


def f64(batch: pa.RecordBatch, name: str) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(values float64 with NaN at nulls, null mask or None); (None, None) if all null."""
    col = batch.column(name)
    if col.null_count == len(col):
        return None, None
    values = col.to_numpy(zero_copy_only=False).astype(np.float64)
    return values, (np.asarray(col.is_null()) if col.null_count else None)


def ints(batch: pa.RecordBatch, name: str, fill: int = 0) -> np.ndarray:
    col = batch.column(name)
    if col.null_count:
        col = col.fill_null(fill)
    return col.to_numpy(zero_copy_only=False)


class Seg:
    """Consecutive segments of given lengths (zeros allowed) and reductions over them."""

    def __init__(self, lengths: np.ndarray):
        self.lengths = lengths
        self.n = len(lengths)
        self.nonempty = lengths > 0
        self.dense = bool(self.nonempty.all())
        self.starts = (np.cumsum(lengths) - lengths)[self.nonempty]

    def _put(self, reduced: np.ndarray, fill, dtype) -> np.ndarray:
        if self.dense:
            return reduced
        out = np.full(self.n, fill, dtype)
        out[self.nonempty] = reduced
        return out

    def sum(self, a: np.ndarray) -> np.ndarray:
        if not len(a):
            return np.zeros(self.n)
        return self._put(np.add.reduceat(a, self.starts), 0.0, np.float64)

    def count(self, b: np.ndarray) -> np.ndarray:
        if not len(b):
            return np.zeros(self.n, np.int64)
        return self._put(np.add.reduceat(b, self.starts, dtype=np.int64), 0, np.int64)

    def max(self, a: np.ndarray) -> np.ndarray:
        if not len(a):
            return np.full(self.n, np.nan)
        return self._put(np.fmax.reduceat(a, self.starts), np.nan, np.float64)

    def min(self, a: np.ndarray) -> np.ndarray:
        if not len(a):
            return np.full(self.n, np.nan)
        return self._put(np.fmin.reduceat(a, self.starts), np.nan, np.float64)

    def hist(self, bin_index: np.ndarray, n_bins: int) -> np.ndarray:
        """[n, n_bins] counts of bin_index per segment."""
        if self.n == 1:
            return np.bincount(bin_index, minlength=n_bins)[None, :]
        seg_id = np.repeat(np.arange(self.n), self.lengths)
        flat = np.bincount(seg_id * n_bins + bin_index, minlength=self.n * n_bins)
        return flat.reshape(self.n, n_bins)


def finite_sum(seg: Seg, v: np.ndarray, n_valid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sum of the finite values, their count) per segment; v has no NaN from excluded rows."""
    fin = np.isfinite(v)
    if fin.all():
        return seg.sum(v), n_valid
    return seg.sum(np.where(fin, v, 0.0)), n_valid - seg.count(~fin)


# ---- one batch -------------------------------------------------------------------------


@dataclass
class Tokens:
    """The masked tokens of a batch (compressed), with validity of each derived value."""

    d: np.ndarray  # logp_ref - logp; 0 where not valid_d
    valid_d: np.ndarray | None  # None: every token valid
    rho: np.ndarray  # exp(logp - logp_old); NaN where not valid_x
    rho0: np.ndarray  # rho with 0 where not valid_x
    x0: np.ndarray  # logp - logp_old; 0 where not valid_x
    valid_x: np.ndarray | None
    has_ref: bool


def _valid(v: np.ndarray) -> np.ndarray | None:
    ok = np.isfinite(v)
    return None if ok.all() else ok


def masked_tokens(s: np.ndarray, r: np.ndarray | None, o: np.ndarray | None,
                  o_null: np.ndarray | None) -> Tokens:
    """d and rho of the masked tokens (arrays already compressed to mask true)."""
    if r is None:
        d, valid_d = np.zeros_like(s), np.zeros(len(s), bool)
    else:
        d = r - s
        valid_d = _valid(d)
        if valid_d is not None:
            d[~valid_d] = 0.0
    if o is None:
        x = np.zeros_like(s)
    else:
        x = s - o
        if o_null is not None:
            x[o_null] = 0.0  # a row without logp_old is on-policy: rho = 1
    valid_x = _valid(x)
    if valid_x is None:
        with np.errstate(over="ignore"):
            rho = np.exp(x)
        return Tokens(d, valid_d, rho, rho, x, None, r is not None)
    x[~valid_x] = np.nan
    with np.errstate(over="ignore"):
        rho = np.exp(x)
    rho0 = np.where(valid_x, rho, 0.0)
    x[~valid_x] = 0.0
    return Tokens(d, valid_d, rho, rho0, x, valid_x, r is not None)


def _both(a: np.ndarray | None, b: np.ndarray | None) -> np.ndarray | None:
    if a is None:
        return b
    return a if b is None else a & b


def _count(seg: Seg, valid: np.ndarray | None) -> np.ndarray:
    return seg.lengths if valid is None else seg.count(valid)


def _fix_products(prod: np.ndarray, valid: np.ndarray | None, rho0: np.ndarray, other: np.ndarray) -> np.ndarray:
    """rho * value: 0 * inf is +-inf for a valid token (estimators), 0 for an excluded one."""
    nan = np.isnan(prod)
    if not nan.any():
        return prod
    sign = np.sign(np.where(np.isinf(other), other, 1.0))
    fixed = np.where(nan, sign * np.inf, prod)
    return fixed if valid is None else np.where(valid, fixed, np.where(nan, 0.0, prod))


@dataclass
class Batch:
    """Raw columns of a record batch as numpy (float64 log-probs, NaN at nulls)."""

    n: int
    step: np.ndarray
    seq: np.ndarray
    mask: np.ndarray
    lp: dict[str, np.ndarray | None]  # LOGPS and "advantage"
    null: dict[str, np.ndarray | None]  # null masks, None when no row is null
    arrow: pa.RecordBatch  # for the columns read only at a few rows (group, pos, token_id)

    @classmethod
    def from_arrow(cls, batch: pa.RecordBatch) -> Batch:
        step = ints(batch, "step")
        if len(step) > 1 and np.any(step[1:] < step[:-1]):  # not step-ordered: sort once
            batch = batch.take(pa.array(np.argsort(step, kind="stable")))
            step = ints(batch, "step")
        lp, null = {}, {}
        for name in (*LOGPS, "advantage"):
            lp[name], null[name] = f64(batch, name)
        mask = batch.column("mask").fill_null(False).to_numpy(zero_copy_only=False)
        return cls(batch.num_rows, step, ints(batch, "seq"), mask, lp, null, batch)

    def at(self, name: str, rows: np.ndarray, fill: int = 0) -> np.ndarray:
        """Integer column `name` at `rows` (nulls as `fill`), without converting the rest."""
        col = self.arrow.column(name).take(pa.array(rows, pa.int64()))
        return col.fill_null(fill).to_numpy(zero_copy_only=False).astype(np.int64)

    def nonfinite_invalid(self) -> tuple[np.ndarray, np.ndarray]:
        """[n] bool: any present log-prob NaN/inf; any log-prob > 0."""
        nf = np.zeros(self.n, bool)
        inv = np.zeros(self.n, bool)
        for name in LOGPS:
            v = self.lp[name]
            if v is None:
                continue
            bad = ~np.isfinite(v)
            if self.null[name] is not None:
                bad &= ~self.null[name]
            nf |= bad
            with np.errstate(invalid="ignore"):
                inv |= v > 0
        return nf, inv
