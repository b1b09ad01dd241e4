"""Estimator values, gradient weights (against torch autograd in float64) and flags."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kldiag import estimators as E
from kldiag.errors import UnknownEstimatorError


def _torch_values(s, r, o):
    """The estimator table of docs/metrics.md ("Per-token estimators"), written directly in torch."""
    d = r - s
    k3 = torch.exp(d) - d - 1
    return {
        "k1": s - r,
        "k2": 0.5 * d**2,
        "k3": k3,
        "k3_is": torch.exp(s - o) * k3,  # rho differentiable (DeepSeek-V3.2 eq. 7)
        "k3_clamped": torch.clamp(k3, min=-E.CLAMP, max=E.CLAMP),
        "kl_rev": d * torch.exp(d) - (torch.exp(d) - 1),
    }


@pytest.fixture(scope="module")
def logps():
    rng = np.random.default_rng(0)
    n = 4000
    s = -rng.exponential(3.0, n)
    # log-ratios from tiny to extreme: |d| up to 50 (exp(50) ~ 5e21, still finite in float64)
    d = np.concatenate([rng.uniform(-50, 50, n // 2), rng.normal(0, 1e-3, n // 4), rng.normal(0, 2, n - 3 * n // 4)])
    r = s + d
    o = s + rng.normal(0, 0.5, n)
    return s, r, o


@pytest.mark.parametrize("name", sorted(E.ESTIMATORS))
def test_weight_matches_autograd(name, logps):
    s, r, o = logps
    st = torch.tensor(s, dtype=torch.float64, requires_grad=True)
    vals = _torch_values(st, torch.tensor(r, dtype=torch.float64), torch.tensor(o, dtype=torch.float64))[name]
    (grad,) = torch.autograd.grad(vals.sum(), st)
    ours, want = E.weight(name, s, r, o), grad.numpy()
    # Autograd of rho * k3 sums two terms of size rho * exp(d) that cancel (k3 + 1 - exp(d)),
    # so its own float64 rounding error scales with that size; the closed form has none.
    cancel = np.exp(s - o) * np.maximum(1.0, np.exp(r - s)) if name in ("k3_is", "kl_rev") else 1.0
    atol = 1e-12 * cancel * np.maximum(1.0, np.abs(r - s))
    assert np.all(np.abs(ours - want) <= 1e-9 * np.abs(want) + atol), name


@pytest.mark.parametrize("name", sorted(E.ESTIMATORS))
def test_value_matches_torch(name, logps):
    s, r, o = logps
    t = {k: torch.tensor(v, dtype=torch.float64) for k, v in zip("sro", (s, r, o), strict=True)}
    want = _torch_values(t["s"], t["r"], t["o"])[name].numpy()
    # expm1-based k3 is more accurate than torch's exp(d) - d - 1 near d = 0: compare with
    # an absolute tolerance scaled to float64 rounding of exp(d).
    atol = 1e-15 * np.maximum(1.0, np.exp(r - s))
    if name == "k3_is":
        atol = atol * np.exp(s - o)
    np.testing.assert_allclose(E.value(name, s, r, o), want, rtol=1e-9, atol=atol.max() if name != "k1" else 0)


def test_k3_is_on_policy_equals_k3_and_weight_equals_k2():
    s, r = np.array([-1.0, -5.0, -0.1]), np.array([-2.0, -0.5, -0.1])
    np.testing.assert_allclose(E.k3_is(s, r, s), E.k3(s, r))
    np.testing.assert_allclose(E.weight_k3_is(s, r, s), E.weight_k2(s, r))


def test_k3_precise_near_zero():
    s = np.array([-1.0])
    r = s + 1e-9
    assert E.k3(s, r)[0] == pytest.approx(0.5e-18, rel=1e-6)


def test_overflow_gives_inf_and_flag_not_nan():
    s = np.array([-800.0, -100.0], dtype=np.float64)
    r = np.array([0.0, 0.0])
    w = E.weight_k3(s, r)
    assert np.all(np.isneginf(w[:1])) and np.isfinite(w[1])
    assert np.isposinf(E.k3(s, r)[0])
    assert not np.any(np.isnan(E.weight_k3_is(s, r, s - 900.0)))  # rho overflows too
    assert not np.any(np.isnan(E.k3_is(s, r, s + 900.0)))  # rho underflows to 0, k3 = inf
    f = E.flags(s, r)
    assert f.weight_blowup.all() and f.theta_ll_ref.all() and f.clamp_saturated.all()
    assert not f.nonfinite.any()


def test_float32_inputs_are_computed_in_float64():
    s = np.float32([-90.0])  # exp(90) overflows float32 but not float64
    assert np.isfinite(E.weight_k3(s, np.float32([0.0]))).all()
    assert E.k3(s, np.float32([0.0])).dtype == np.float64


def test_flags_on_hand_made_cases():
    ln = np.log
    s = np.array([ln(0.01), ln(0.5), ln(0.001), np.nan, 0.5, ln(0.2)])
    r = np.array([ln(0.5), ln(0.5), ln(0.5), ln(0.5), ln(0.5), ln(0.2)])
    f = E.flags(s, r)
    # pi_ref/pi_theta = 50 > 20; 1; 500; nan; ...; 1
    np.testing.assert_array_equal(f.theta_ll_ref, [True, False, True, False, False, False])
    # |1 - 50| = 49 > 10; |1 - 500| > 10
    np.testing.assert_array_equal(f.weight_blowup, [True, False, True, False, False, False])
    # k3(50) = 50 - ln 50 - 1 = 45.1 > 10; k3(500) > 10
    np.testing.assert_array_equal(f.clamp_saturated, [True, False, True, False, False, False])
    np.testing.assert_array_equal(f.nonfinite, [False, False, False, True, False, False])
    np.testing.assert_array_equal(f.invalid, [False, False, False, False, True, False])


def test_flag_thresholds_are_parameters():
    s, r = np.log([0.1]), np.log([0.5])  # ratio 5
    assert not E.flag_theta_ll_ref(s, r)[0] and E.flag_theta_ll_ref(s, r, tau=4)[0]
    assert not E.flag_weight_blowup(s, r)[0] and E.flag_weight_blowup(s, r, limit=3)[0]
    assert not E.flag_clamp_saturated(s, r)[0] and E.flag_clamp_saturated(s, r, clamp=1)[0]


def test_flags_with_old_and_sampler_columns():
    s, r = np.array([-1.0, -1.0]), np.array([-1.0, -1.0])
    f = E.flags(s, r, logp_old=np.array([np.inf, -1.0]), logp_sampler=np.array([-1.0, 0.1]))
    np.testing.assert_array_equal(f.nonfinite, [True, False])
    np.testing.assert_array_equal(f.invalid, [False, True])


def test_clamped_weight_is_zero_above_clamp():
    s, r = np.log([0.001, 0.4]), np.log([0.5, 0.5])
    w = E.weight_k3_clamped(s, r)
    assert w[0] == 0.0 and w[1] == pytest.approx(1 - 0.5 / 0.4)


def test_registry_unknown_name_lists_valid_ones():
    with pytest.raises(UnknownEstimatorError, match="k3_is"):
        E.get_estimator("k4")


def test_rho_and_log_ratio_shapes_broadcast():
    s = np.zeros((2, 3))
    assert E.rho(s, np.zeros(3)).shape == (2, 3)
    assert E.weight_k1(s, np.zeros(3)).shape == (2, 3)


def test_as_f64_reads_numpy_scalars_and_arrow_columns():
    import pyarrow as pa

    a = np.arange(3, dtype=np.float64)
    assert E.as_f64(a) is a  # no copy
    np.testing.assert_array_equal(E.as_f64(np.float32([0.5, -1])), [0.5, -1.0])
    assert E.as_f64(2).dtype == np.float64 and E.as_f64(2).shape == ()
    col = pa.chunked_array([pa.array([1.5, None], pa.float32()), pa.array([-2.0], pa.float32())])
    np.testing.assert_array_equal(E.as_f64(col), [1.5, np.nan, -2.0])
    np.testing.assert_array_equal(E.as_f64(pa.array([None, 3.0])), [np.nan, 3.0])


def test_k3_of_log_ratio_near_zero_and_at_infinity():
    d = np.array([1e-9, -1e-9, 1e-5, np.inf, -np.inf, np.nan])
    got = E.k3_of_log_ratio(d)
    small = d[:3]
    np.testing.assert_allclose(got[:3], small**2 / 2 + small**3 / 6 + small**4 / 24, rtol=1e-6)
    assert got[3] == np.inf and got[4] == np.inf and np.isnan(got[5])
    np.testing.assert_array_equal(E.k3(np.zeros(3), d[:3]), got[:3])
