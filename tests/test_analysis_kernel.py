"""The compiled kernel's per-token values, flags and bins equal kldiag.estimators and np.searchsorted."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from kldiag import estimators as E
from kldiag.analysis import bins, fused
from kldiag.analysis.kernel import Thresholds
from kldiag.analysis.stats import ABS, D_GRID, batch_partials
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


def _record_batch(s, r, o, mask=None, step=None) -> pa.RecordBatch:
    n = len(s)
    cols = {"step": np.zeros(n, np.int64) if step is None else step, "micro": np.zeros(n, np.int32),
            "iteration": np.zeros(n, np.int16), "rank": np.zeros(n, np.int16), "seq": np.arange(n) // 7,
            "group": np.zeros(n, np.int64), "pos": np.arange(n, dtype=np.int32) % 7, "token_id": np.zeros(n, np.int32),
            "logp": s, "logp_old": o, "logp_ref": r, "logp_sampler": np.full(n, np.nan), "advantage": np.ones(n),
            "mask": np.ones(n, bool) if mask is None else mask, "entropy": np.zeros(n)}
    arrays = []
    for f in TOKEN_SCHEMA:
        a = cols[f.name]
        if f.type == pa.float32():
            a = np.asarray(a, np.float32)
            arrays.append(pa.array(a, mask=np.isnan(a) if f.name == "logp_sampler" else None))
        else:
            arrays.append(pa.array(np.asarray(a).astype(f.type.to_pandas_dtype())))
    return pa.RecordBatch.from_arrays(arrays, schema=TOKEN_SCHEMA)


def _bad_inputs():
    s, r, o = (a.astype(np.float32) for a in _grid())
    s[:3], r[3:6], o[6:9] = [np.nan, np.inf, -np.inf], [np.nan, np.inf, -np.inf], [np.nan, np.inf, -np.inf]
    return s, r, o


def test_token_values_equal_estimators_on_float32_inputs():
    """fused.token on fused.exps' values is estimators.py bit for bit (both use numpy's exp/expm1)."""
    s, r, o = _bad_inputs()
    ex = fused.exps(s, r, o, np.zeros(0, np.float32), np.zeros(0, bool))
    got = np.array([fused.token(ex[0][i], ex[1][i], ex[2][i], ex[3][i]) for i in range(len(s))], np.float64)
    d, valid_d, _, valid_x, rho, k3, w, k3_is, w_is = got.T
    valid_d, valid_x = valid_d.astype(bool), valid_x.astype(bool)
    s64, r64, o64 = (a.astype(np.float64) for a in (s, r, o))
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(valid_d, np.isfinite(r64 - s64))
        np.testing.assert_array_equal(valid_x, np.isfinite(s64 - o64))
        both = valid_d & valid_x
        np.testing.assert_array_equal(d[valid_d], E.log_ratio(s64, r64)[valid_d])
        np.testing.assert_array_equal(k3[valid_d], E.k3(s64, r64)[valid_d])
        np.testing.assert_array_equal(w[valid_d], np.abs(E.weight_k3(s64, r64))[valid_d])
        np.testing.assert_array_equal(rho[valid_x], E.rho(s64, o64)[valid_x])
        np.testing.assert_array_equal(k3_is[both], E.k3_is(s64, r64, o64)[both])
        np.testing.assert_array_equal(w_is[both], np.abs(E.weight_k3_is(s64, r64, o64))[both])
    # Excluded tokens hold 0 in the summed values and NaN in rho.
    assert not valid_d.all() and np.all(d[~valid_d] == 0) and np.all(k3[~valid_d] == 0) and np.all(w[~valid_d] == 0)
    assert np.all(np.isnan(rho[~valid_x])) and np.all(k3_is[~both] == 0) and np.all(w_is[~both] == 0)


@pytest.mark.parametrize("tau,limit,clamp", [(20.0, 10.0, 10.0), (1.5, 0.5, 0.1), (1e6, 1e6, 1e6)])
def test_batch_flags_and_histograms_equal_estimators(tau, limit, clamp):
    s, r, o = _bad_inputs()
    mask = np.random.default_rng(1).random(len(s)) > 0.2
    step = np.repeat(np.arange(3), -(-len(s) // 3))[: len(s)]
    res = batch_partials(_record_batch(s, r, o, mask=mask, step=step), 0, Thresholds(tau, limit, clamp, 0.2, 0.2, 10))
    s64, r64, o64 = (a.astype(np.float64) for a in (s, r, o))
    with np.errstate(all="ignore"):
        fl = E.flags(s64, r64, o64, tau=tau, limit=limit, clamp=clamp)
        d, w, rho = E.log_ratio(s64, r64), np.abs(E.weight_k3(s64, r64)), E.rho(s64, o64)
        w_is = np.abs(E.weight_k3_is(s64, r64, o64))
    valid_d, valid_x = np.isfinite(d) & mask, np.isfinite(s64 - o64) & mask
    for i in range(3):
        at = step == i
        for name, want in (("n_theta", fl.theta_ll_ref), ("n_blowup", fl.weight_blowup),
                           ("n_clamp", fl.clamp_saturated)):
            assert res.steps[name][i] == np.sum(want & valid_d & at), name
        for name, v, edges, ok in (("h_d", d, D_EDGES, valid_d), ("h_weight_k3_abs", w, ABS_EDGES, valid_d),
                                   ("h_weight_k3_is_abs", w_is, ABS_EDGES, valid_d & valid_x),
                                   ("h_rho", rho, ABS_EDGES, valid_x)):
            want = np.bincount(np.searchsorted(edges, v[ok & at], side="right"), minlength=len(edges) + 1)
            np.testing.assert_array_equal(res.steps[name][i], want, err_msg=name)


def test_bin_table_equals_searchsorted():
    rng = np.random.default_rng(2)
    v = np.abs(np.concatenate([rng.normal(0, 1, 10000) * np.exp(rng.uniform(-40, 45, 10000)), ABS_EDGES,
                               np.nextafter(ABS_EDGES, 0), np.nextafter(ABS_EDGES, np.inf), [0.0, 5e-324, np.inf]]))
    np.testing.assert_array_equal(bins.abs_table()(v), np.searchsorted(ABS_EDGES, v, side="right"))
    signed = bins.BinTable.build(D_EDGES)
    d = np.concatenate([rng.uniform(-50, 50, 10000), D_EDGES, np.nextafter(D_EDGES, -np.inf), [-0.0, np.inf, -np.inf]])
    np.testing.assert_array_equal(signed(d), np.searchsorted(D_EDGES, d, side="right"))
    np.testing.assert_array_equal(bins.d_bins(d), np.searchsorted(D_EDGES, d, side="right"))
    finite = d[np.isfinite(d)]
    np.testing.assert_array_equal([fused.d_bin(x, *D_GRID) for x in finite],
                                  np.searchsorted(D_EDGES, finite, side="right"))
    np.testing.assert_array_equal([fused.abs_bin(x, ABS.shift, ABS.lo, ABS.cut) for x in v],
                                  np.searchsorted(ABS_EDGES, v, side="right"))


def test_quantile_is_within_one_bin():
    rng = np.random.default_rng(3)
    v = np.exp(rng.normal(0, 3, 100000))
    counts = np.bincount(np.searchsorted(ABS_EDGES, v, side="right"), minlength=len(ABS_EDGES) + 1)
    for q in (0.5, 0.9, 0.99, 0.999):
        est, true = bins.quantile(counts, ABS_EDGES, q, v.max()), np.quantile(v, q)
        assert true / 10 ** 0.25 <= est <= true * 10 ** 0.25
