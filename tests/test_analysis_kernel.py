"""The compiled kernel's per-token values, flags and bins equal kldiag.estimators and np.searchsorted.

Values are compared within a few ulp (fastexp's exp and expm1 are within 1 and 2 ulp of
numpy's); flags and bins exactly.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from kldiag import estimators as E
from kldiag.analysis.core import bins
from kldiag.analysis.core.batch import Thresholds
from kldiag.analysis.core.stats import ABS_GRID, D_GRID, batch_partials
from kldiag.analysis.kernels import fastexp, fused
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
            "mask": np.ones(n, bool) if mask is None else mask, "entropy": np.zeros(n),
            "attempt": np.zeros(n, np.int16)}
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


def _close(got, want, scale, ulps=4):
    """got == want within `ulps` units in the last place of `scale` (inf and NaN must match)."""
    same = (got == want) | (np.isnan(got) & np.isnan(want))
    with np.errstate(invalid="ignore"):
        near = np.abs(got - want) <= ulps * np.spacing(np.abs(scale))
    assert np.all(same | near), np.flatnonzero(~(same | near))[:10]


def test_fastexp_within_ulps_of_numpy_everywhere():
    rng = np.random.default_rng(5)
    x = np.concatenate([rng.uniform(-1, 1, 200000), rng.uniform(-800, 800, 200000), rng.normal(0, 1e-6, 10000),
                        [0.0, -0.0, np.nan, np.inf, -np.inf, 709.0, 709.78, 709.79, 710.0, -745.1, -745.2, -1e300,
                         1e300, 5e-324, fastexp.X_MAX]])
    out = np.empty_like(x)
    with np.errstate(all="ignore"):
        fastexp.exp_array(x, out)
        _close(out, np.exp(x), np.exp(x), ulps=1)
        fastexp.expm1_array(x, out)
        _close(out, np.expm1(x), np.expm1(x), ulps=2)


def test_token_values_equal_estimators_on_float32_inputs():
    """fused.token equals estimators.py within a few ulp; validity exactly."""
    s, r, o = _bad_inputs()
    s64, r64, o64 = (a.astype(np.float64) for a in (s, r, o))
    got = np.array([fused.token(s64[i], o64[i], r64[i]) for i in range(len(s))], np.float64)
    d, valid_d, _, valid_x, rho, k3, w, k3_is, w_is = got.T
    valid_d, valid_x = valid_d.astype(bool), valid_x.astype(bool)
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(valid_d, np.isfinite(r64 - s64))
        np.testing.assert_array_equal(valid_x, np.isfinite(s64 - o64))
        both = valid_d & valid_x
        np.testing.assert_array_equal(d[valid_d], E.log_ratio(s64, r64)[valid_d])
        em = np.expm1(d)  # k3 = expm1(d) - d cancels: its error is measured against expm1(d)
        _close(k3[valid_d], E.k3(s64, r64)[valid_d], np.maximum(np.abs(em), np.abs(d))[valid_d])
        _close(w[valid_d], np.abs(E.weight_k3(s64, r64))[valid_d], w[valid_d])
        _close(rho[valid_x], E.rho(s64, o64)[valid_x], rho[valid_x])
        scale = (np.maximum(np.abs(em), np.abs(d)) * np.maximum(rho, 1.0))[both]
        _close(k3_is[both], E.k3_is(s64, r64, o64)[both], scale)
        _close(w_is[both], np.abs(E.weight_k3_is(s64, r64, o64))[both], w_is[both])
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
    # top rows: the 10 largest finite-d |k3 weight| (inf included), ties in row order
    rows = np.flatnonzero(valid_d)
    want = rows[np.lexsort([rows, -w[rows]])][:10]
    np.testing.assert_array_equal(np.sort(res.top["seq"] * 7 + res.top["pos"]), np.sort(want))


@pytest.mark.parametrize("sampler_nulls", [False, True], ids=["computed", "bad_codes"])
def test_nonfinite_and_invalid_counts_equal_estimators(sampler_nulls):
    """n_nonfinite and n_invalid per step equal estimators.flags: +inf is non-finite and not also
    "probability > 1"; a finite log-prob above 0 is invalid. Both kernel paths: the fused bad_code
    and, when a column is null on some rows only, Batch.bad_codes."""
    s, r, o = _bad_inputs()
    s[9:12], r[12:14], o[14:16] = [0.5, np.inf, 3.0], [0.25, np.inf], [0.1, np.inf]
    mask = np.random.default_rng(2).random(len(s)) > 0.2
    mask[:16] = True  # logp_old counts in the loss only
    step = np.repeat(np.arange(3), -(-len(s) // 3))[: len(s)]
    batch = _record_batch(s, r, o, mask=mask, step=step)
    if sampler_nulls:  # logp_sampler present on some rows (equal to logp_old there): Batch.bad_codes runs
        m = pa.array(o, mask=np.arange(len(s)) % 2 == 1)
        batch = batch.set_column(batch.schema.get_field_index("logp_sampler"), "logp_sampler", m)
    res = batch_partials(batch, 0, Thresholds(20.0, 10.0, 10.0, 0.2, 0.2, 10))
    s64, r64, o64 = (a.astype(np.float64) for a in (s, r, o))
    fl = E.flags(s64, r64)
    fl_o = E.flags(s64, r64, o64)
    nonfinite = fl.nonfinite | (fl_o.nonfinite & mask)
    invalid = fl.invalid | (fl_o.invalid & mask)
    assert not np.any(invalid & nonfinite) and np.isinf(s64[10]) and not invalid[10]
    flagged = E.flagged(E.flags(s64, r64, o64, tau=20.0, limit=10.0, clamp=10.0), mask)
    for i in range(3):
        at = step == i
        assert res.steps["n_flagged"][i] == np.sum(flagged & at)  # the one definition of "flagged"
        assert res.steps["n_nonfinite"][i] == np.sum(nonfinite & at)
        assert res.steps["n_invalid"][i] == np.sum(invalid & at)


def test_bins_equal_searchsorted():
    rng = np.random.default_rng(2)
    v = np.abs(np.concatenate([rng.normal(0, 1, 10000) * np.exp(rng.uniform(-40, 45, 10000)), ABS_EDGES,
                               np.nextafter(ABS_EDGES, 0), np.nextafter(ABS_EDGES, np.inf),
                               [0.0, 5e-324, 1e-310, 1e300, np.inf]]))
    want = np.searchsorted(ABS_EDGES, v, side="right")
    np.testing.assert_array_equal(bins.abs_bins(v), want)
    m1, k0, n = ABS_GRID
    np.testing.assert_array_equal([fused.abs_bin(x, m1, k0, n) for x in v], want)
    d = np.concatenate([rng.uniform(-50, 50, 10000), D_EDGES, np.nextafter(D_EDGES, -np.inf), [-0.0, np.inf, -np.inf]])
    np.testing.assert_array_equal(bins.d_bins(d), np.searchsorted(D_EDGES, d, side="right"))
    finite = d[np.isfinite(d)]
    np.testing.assert_array_equal([fused.d_bin(x, *D_GRID) for x in finite],
                                  np.searchsorted(D_EDGES, finite, side="right"))


def test_quantile_is_within_one_bin():
    rng = np.random.default_rng(3)
    v = np.exp(rng.normal(0, 3, 100000))
    counts = np.bincount(np.searchsorted(ABS_EDGES, v, side="right"), minlength=len(ABS_EDGES) + 1)
    for q in (0.5, 0.9, 0.99, 0.999):
        est, true = bins.quantile(counts, ABS_EDGES, q, v.max()), np.quantile(v, q)
        assert true / 2 ** 0.5 <= est <= true * 2 ** 0.5


def test_kernel_sums_do_not_depend_on_where_the_arrays_live():
    """Vectorised sums round by lane: the same rows at other addresses must give the same bits."""
    rng = np.random.default_rng(7)
    n = 5000
    s = (-rng.exponential(1.0, n)).astype(np.float32)
    o = (s - rng.normal(0, 0.05, n)).astype(np.float32)
    r = np.minimum(s + rng.normal(0, 0.5, n), 0).astype(np.float32)
    batch = _record_batch(s, r, o, step=np.repeat(np.arange(5), n // 5))
    th = Thresholds(20.0, 10.0, 10.0, 0.2, 0.2, 10)
    first = batch_partials(batch, 0, th)
    keep = []
    for _ in range(30):
        keep.append(np.empty(int(rng.integers(1, 4000))))  # move the allocator on
        moved = batch.take(pa.array(np.arange(n)))  # fresh buffers, same values and nulls
        again = batch_partials(moved, 0, th)
        for name, col in first.steps.items():
            np.testing.assert_array_equal(again.steps[name], col, err_msg=name)
        for name, col in first.seqs.items():
            np.testing.assert_array_equal(again.seqs[name], col, err_msg=name)


def test_quantile_rows_equals_quantile_per_row():
    """The vectorised per-step quantile gives `quantile`'s value on every row: empty rows, rows whose
    quantile falls in the first or past the last edge, NaN and small vmax."""
    from kldiag.analysis.core import bins
    from kldiag.analysis.types import ABS_EDGES

    rng = np.random.default_rng(3)
    nb = len(ABS_EDGES) + 1
    counts = rng.integers(0, 5, (300, nb)) * (rng.random((300, nb)) < 0.3)
    counts[0] = 0
    counts[1, :] = 0
    counts[1, 0] = 7  # everything below the first edge
    counts[2, :] = 0
    counts[2, -1] = 3  # everything past the last edge
    vmax = rng.lognormal(0, 3, 300)
    vmax[3] = np.nan
    vmax[4] = 1e-9
    for q in (0.5, 0.9, 0.99, 1.0):
        got = bins.quantile_rows(counts, ABS_EDGES, q, vmax)
        want = np.array([np.nan if np.isnan(v) else bins.quantile(c, ABS_EDGES, q, v) for c, v in zip(counts, vmax)])
        np.testing.assert_allclose(got, want, rtol=1e-14, atol=0)
        assert np.array_equal(np.isnan(got), np.isnan(want))
