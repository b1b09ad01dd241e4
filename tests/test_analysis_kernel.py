"""The kernel's per-token values and bins equal kldiag.estimators and np.searchsorted."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from kldiag import estimators as E
from kldiag.analysis import bins
from kldiag.analysis.kernel import Batch, Seg, Thresholds
from kldiag.analysis.stats import flagged
from kldiag.analysis.tokens import masked_tokens
from kldiag.analysis.types import ABS_EDGES, D_EDGES
from kldiag.format import TOKEN_SCHEMA

EXTREME = np.array([0.0, -1e-12, -0.5, -3.0, -20.0, -88.0, -700.0, -750.0, -1e4, -3e38])


def _grid() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every pair of extreme log-probs, plus random typical ones."""
    rng = np.random.default_rng(0)
    s, r = (a.ravel() for a in np.meshgrid(EXTREME, EXTREME))
    o = np.roll(s, 3)
    typical = -rng.exponential(1.0, (3, 500))
    return (np.concatenate([s, typical[0]]), np.concatenate([r, typical[1]]), np.concatenate([o, typical[2]]))


def _batch(s, r, o, m=None, mask=None) -> Batch:
    n = len(s)
    cols = {"step": np.zeros(n, np.int64), "micro": np.zeros(n, np.int32), "iteration": np.zeros(n, np.int16),
            "rank": np.zeros(n, np.int16), "seq": np.arange(n) // 7, "group": np.zeros(n, np.int64),
            "pos": np.arange(n, dtype=np.int32) % 7, "token_id": np.zeros(n, np.int32),
            "logp": s, "logp_old": o, "logp_ref": r,
            "logp_sampler": m if m is not None else np.full(n, np.nan), "advantage": np.ones(n),
            "mask": np.ones(n, bool) if mask is None else mask, "entropy": np.zeros(n)}
    arrays = []
    for f in TOKEN_SCHEMA:
        a = cols[f.name]
        if f.type == pa.float32():
            a = np.asarray(a, np.float32)
            arrays.append(pa.array(a, mask=np.isnan(a) if f.name == "logp_sampler" else None))
        else:
            arrays.append(pa.array(np.asarray(a).astype(f.type.to_pandas_dtype())))
    return Batch.from_arrow(pa.RecordBatch.from_arrays(arrays, schema=TOKEN_SCHEMA))


def test_masked_tokens_equal_estimators_on_float32_inputs():
    s, r, o = (a.astype(np.float32) for a in _grid())
    s[:3], r[3:6], o[6:9] = [np.nan, np.inf, -np.inf], [np.nan, np.inf, -np.inf], [np.nan, np.inf, -np.inf]
    mask = np.random.default_rng(1).random(len(s)) > 0.2
    b = _batch(s, r, o, mask=mask)
    t = masked_tokens(b, np.flatnonzero(mask))
    s64, r64, o64 = (a[mask].astype(np.float64) for a in (s, r, o))
    with np.errstate(all="ignore"):
        valid, valid_x = np.isfinite(r64 - s64), np.isfinite(s64 - o64)
        both = valid & valid_x
        np.testing.assert_array_equal(t.d[valid], E.log_ratio(s64, r64)[valid])
        np.testing.assert_array_equal(t.k3[valid], E.k3(s64, r64)[valid])
        np.testing.assert_array_equal(t.w[valid], np.abs(E.weight_k3(s64, r64))[valid])
        np.testing.assert_array_equal(t.rho[valid_x], E.rho(s64, o64)[valid_x])
        np.testing.assert_array_equal(t.k3_is[both], E.k3_is(s64, r64, o64)[both])
        np.testing.assert_array_equal(t.w_is[both], np.abs(E.weight_k3_is(s64, r64, o64))[both])
    # Excluded tokens hold 0 in the summed arrays and NaN in rho, so sums need no mask.
    assert not valid.all() and np.all(t.d[~valid] == 0) and np.all(t.k3[~valid] == 0)
    assert np.all(np.isnan(t.rho[~valid_x])) and np.all(t.rho0[~valid_x] == 0) and np.all(t.k3_is[~both] == 0)
    with np.errstate(all="ignore"):
        fl = E.flags(s64, r64, o64, tau=20.0, limit=10.0, clamp=10.0)
    f = flagged(t, Thresholds(20.0, 10.0, 10.0, 0.2, 0.2, 10), np.zeros(0, np.intp))
    for name in ("theta", "blowup", "clamp"):
        got = np.zeros(len(s64), bool)
        got[getattr(f, name)] = True
        want = {"theta": fl.theta_ll_ref, "blowup": fl.weight_blowup, "clamp": fl.clamp_saturated}[name]
        np.testing.assert_array_equal(got, want & valid, err_msg=name)


@pytest.mark.parametrize("tau,limit,clamp", [(20.0, 10.0, 10.0), (1.5, 0.5, 0.1), (1e6, 1e6, 1e6)])
def test_flag_window_never_misses_a_flag(tau, limit, clamp):
    th = Thresholds(tau, limit, clamp, 0.2, 0.2, 10)
    low, high = th.d_window()
    d = np.linspace(low, high, 20001)
    with np.errstate(over="ignore"):
        assert not np.any(d > np.log(tau))
        assert not np.any(np.abs(np.expm1(d)) > limit)
        assert not np.any(np.expm1(d) - d > clamp)


def test_bin_table_equals_searchsorted():
    rng = np.random.default_rng(2)
    v = np.abs(np.concatenate([rng.normal(0, 1, 10000) * np.exp(rng.uniform(-40, 45, 10000)), ABS_EDGES,
                               np.nextafter(ABS_EDGES, 0), np.nextafter(ABS_EDGES, np.inf), [0.0, 5e-324, np.inf]]))
    np.testing.assert_array_equal(bins.abs_table()(v), np.searchsorted(ABS_EDGES, v, side="right"))
    signed = bins.BinTable.build(D_EDGES)
    d = np.concatenate([rng.uniform(-50, 50, 10000), D_EDGES, np.nextafter(D_EDGES, -np.inf), [-0.0, np.inf, -np.inf]])
    np.testing.assert_array_equal(signed(d), np.searchsorted(D_EDGES, d, side="right"))
    np.testing.assert_array_equal(bins.d_bins(d), np.searchsorted(D_EDGES, d, side="right"))


def test_quantile_is_within_one_bin():
    rng = np.random.default_rng(3)
    v = np.exp(rng.normal(0, 3, 100000))
    counts = np.bincount(np.searchsorted(ABS_EDGES, v, side="right"), minlength=len(ABS_EDGES) + 1)
    for q in (0.5, 0.9, 0.99, 0.999):
        est, true = bins.quantile(counts, ABS_EDGES, q, v.max()), np.quantile(v, q)
        assert true / 10 ** 0.25 <= est <= true * 10 ** 0.25


def test_seg_reductions_match_slices_for_few_and_many_segments():
    rng = np.random.default_rng(4)
    for n_seg in (3, 40):
        lengths = rng.integers(0, 5, n_seg)
        v = rng.normal(size=int(lengths.sum()))
        seg = Seg(lengths)
        ends = np.cumsum(lengths)
        want = [v[e - n:e].sum() for e, n in zip(ends, lengths, strict=True)]
        np.testing.assert_allclose(seg.sum(v), want)
        mx = seg.max(v)
        for i, (e, n) in enumerate(zip(ends, lengths, strict=True)):
            assert (np.isnan(mx[i]) if n == 0 else mx[i] == v[e - n:e].max())
