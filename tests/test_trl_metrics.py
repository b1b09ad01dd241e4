"""kldiag.integrations.trl.metrics: the compiled per-micro-batch partials (trl_kernel) equal the same
sums built from kldiag.estimators' own functions (one numpy call per estimator, as before)."""

from __future__ import annotations

import numpy as np
import pytest

from kldiag import estimators as E
from kldiag.integrations.trl import metrics as M


def _nansum(x: np.ndarray) -> float:
    return float(np.sum(x[~np.isnan(x)]))


def _nanmax(x: np.ndarray) -> float:
    x = x[~np.isnan(x)]
    return float(np.max(x)) if x.size else 0.0


def reference_partials(logp, logp_ref, logp_old, mask) -> dict[str, float]:
    """The partials from the estimator functions, one at a time (kldiag 0.1's batch_partials)."""
    keep = np.asarray(mask, dtype=bool)
    s = np.asarray(logp)[keep]
    o = s if logp_old is None else np.asarray(logp_old)[keep]
    out = dict.fromkeys(M._SUM_KEYS, 0.0) | dict.fromkeys(M._MAX_KEYS, 0.0)
    out["tokens"] = float(s.size)
    if s.size == 0:
        return out
    out["rho_max"] = _nanmax(E.rho(s, o))
    if logp_ref is None:
        out["nonfinite"] = float(np.count_nonzero(E.flag_nonfinite(s, o)))
        return out
    r = np.asarray(logp_ref)[keep]
    w_abs = np.abs(E.weight_k3(s, r))
    f = E.flags(s, r, o)
    flagged = f.theta_ll_ref | f.weight_blowup | f.clamp_saturated | f.nonfinite | f.invalid
    summable = ~np.isnan(w_abs)
    out.update(
        k3_sum=_nansum(E.k3(s, r)), k3_is_sum=_nansum(E.k3_is(s, r, o)), flagged=float(np.count_nonzero(flagged)),
        weight_k3_abs_sum=float(np.sum(w_abs[summable])),
        weight_k3_abs_flagged_sum=float(np.sum(w_abs[summable & flagged])),
        nonfinite=float(np.count_nonzero(f.nonfinite)),
        weight_k3_abs_max=_nanmax(w_abs), weight_k3_is_abs_max=_nanmax(np.abs(E.weight_k3_is(s, r, o))))
    return out


pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the reference functions warn on NaN/inf

EDGES = np.array([np.nan, np.inf, -np.inf, 0.5, 0.0, -0.0, -1e-9, -700.0, -1e4, -3.0], np.float32)


def inputs(seed: int, b: int = 6, t: int = 40) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    logp = -rng.exponential(2.0, (b, t)).astype(np.float32)
    ref = logp + rng.normal(0, 4.0, (b, t)).astype(np.float32)
    old = logp + rng.normal(0, 0.5, (b, t)).astype(np.float32)
    for a in (logp, ref, old):  # NaN, +-inf, positive, zero and huge gaps at random places
        idx = rng.integers(0, a.size, 12)
        a.flat[idx] = rng.choice(EDGES, 12)
    mask = rng.random((b, t)) < 0.8
    return logp, ref, old, mask


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("case", ["off_policy", "on_policy", "no_ref", "bf16_like_f64"])
def test_fused_partials_equal_the_estimator_functions_exactly(seed: int, case: str) -> None:
    logp, ref, old, mask = inputs(seed)
    if case == "on_policy":
        old = None
    if case == "no_ref":
        ref = None
    if case == "bf16_like_f64":
        logp, ref, old = (a.astype(np.float64) for a in (logp, ref, old))
    got, want = M.batch_partials(logp, ref, old, mask), reference_partials(logp, ref, old, mask)
    assert got.keys() == want.keys()
    for key in got:  # counts and maxima exactly, sums up to their order (numpy sums pairwise); NaN/inf too
        if key in ("tokens", "flagged", "nonfinite") or key.endswith("_max"):
            assert got[key] == want[key] or np.isnan(got[key]) and np.isnan(want[key]), (key, got[key], want[key])
        else:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-12, err_msg=key)


def test_empty_mask_gives_zero_partials() -> None:
    logp, ref, old, mask = inputs(0)
    got = M.batch_partials(logp, ref, old, np.zeros_like(mask))
    assert got == reference_partials(logp, ref, old, np.zeros_like(mask)) and got["tokens"] == 0.0


def test_the_kernel_releases_the_gil() -> None:
    from kldiag.integrations.trl import kernel as trl_kernel

    assert trl_kernel.JIT["nogil"] and M.batch_partials(*inputs(1))["tokens"] > 0
    assert trl_kernel.partials_kernel.targetoptions["nogil"]


def test_mixed_dtypes_are_read_in_float64() -> None:
    logp, ref, old, mask = inputs(2)
    ref64 = ref.astype(np.float64) - 1e-9  # a difference float32 cannot hold
    got, want = M.batch_partials(logp, ref64, old, mask), reference_partials(logp, ref64, old, mask)
    np.testing.assert_allclose(got["k3_sum"], want["k3_sum"], rtol=1e-12)


def test_shapes_that_differ_are_an_error_not_a_read_out_of_bounds() -> None:
    logp, ref, old, mask = inputs(3)
    with pytest.raises(ValueError, match="one shape"):
        M.batch_partials(logp, ref[:, :5], old, mask)
    with pytest.raises(ValueError, match="one shape"):
        M.batch_partials(logp, ref, old, mask[:2])
    with pytest.raises(ValueError, match="one shape"):
        M.batch_partials(logp, ref, old, mask.T.copy().reshape(mask.shape[::-1]))


def test_the_sampler_enters_the_flags_as_in_the_analysis() -> None:
    """A token whose engine log-prob is NaN, +inf or positive is flagged and counted as kldiag.estimators
    says (the analysis's flagged_frac), though the sampler takes no part in the K3 sums."""
    rng = np.random.default_rng(3)
    logp = -rng.exponential(1.0, (3, 6))
    ref, old = logp + rng.normal(0, 0.05, logp.shape), logp + rng.normal(0, 0.05, logp.shape)
    ref, old = np.minimum(ref, -1e-3), np.minimum(old, -1e-3)
    mu = logp.copy()
    mu[0, 1], mu[1, 2], mu[2, 3] = np.nan, np.inf, 0.5
    mask = np.ones(logp.shape, bool)
    mask[2, 5] = False
    got = M.batch_partials(logp, ref, old, mask, mu)
    fl = E.flags(logp, ref, old, mu)
    assert got["flagged"] == E.flagged(fl, mask).sum() == 3
    assert got["nonfinite"] == (fl.nonfinite & mask).sum() == 2
    assert got["k3_sum"] == pytest.approx(M.batch_partials(logp, ref, old, mask)["k3_sum"], rel=1e-12)
