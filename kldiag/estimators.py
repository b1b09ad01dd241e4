"""Per-token KL estimators, their gradient weights, and the per-token flags.

Notation (docs/metrics.md, "Per-token estimators"), every argument an array of log-probs of the *sampled*
token, any shape, broadcastable:

    s = logp       log pi_theta   current policy (the gradient flows through it)
    o = logp_old   log pi_old     the behaviour policy the loss assumes
    r = logp_ref   log pi_ref     reference policy
    d = r - s      log(pi_ref / pi_theta)
    rho = exp(s - o)              importance ratio pi_theta / pi_old

Estimators follow Schulman, "Approximating KL Divergence" (2020): with samples from
pi_theta, k1 = -log(ratio), k2 = 0.5 log(ratio)^2, k3 = (ratio - 1) - log(ratio) where
ratio = pi_ref / pi_theta = exp(d). The corrected estimator is DeepSeek-V3.2 eq. 7
("unbiased KL estimate"): k3_is = rho * k3, with rho differentiable.

A *gradient weight* is d(value)/d(s): the coefficient that multiplies grad(log pi_theta)
of that token when the value is used as a loss. Its expectation under the sampling policy
is the estimator's expected gradient (the table in docs/metrics.md, "Per-token estimators").

Everything is computed in float64, whatever comes in. Overflow of exp(d) yields +inf (a
flag), never NaN: numpy warnings about overflow are silenced on purpose.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from kldiag.errors import UnknownEstimatorError

# Default thresholds of the per-token flags (docs/metrics.md, "Per-token flags").
TAU = 20.0  # theta_ll_ref: pi_theta at least TAU times below pi_ref
WEIGHT_LIMIT = 10.0  # weight_blowup: |1 - exp(d)| above this
CLAMP = 10.0  # clamp_saturated: k3 above the value verl/OpenRLHF/ROLL/AReaL clamp to

ArrayLike = np.ndarray | float


def as_f64(x) -> np.ndarray:
    """x as a float64 numpy array (no copy when it is one already): a scalar, a sequence, a numpy
    array, or a pyarrow Array / ChunkedArray, whose nulls become NaN."""
    if type(x).__module__.startswith("pyarrow"):
        x = x.to_numpy(zero_copy_only=False)
    return np.asarray(x, dtype=np.float64)


def log_ratio(logp, logp_ref) -> np.ndarray:
    """d = log(pi_ref / pi_theta) = logp_ref - logp, float64, same shape as the inputs."""
    return as_f64(logp_ref) - as_f64(logp)


def rho(logp, logp_old) -> np.ndarray:
    """Importance ratio pi_theta / pi_old = exp(logp - logp_old); +inf on overflow."""
    with np.errstate(over="ignore"):
        return np.exp(as_f64(logp) - as_f64(logp_old))


# ---- values -------------------------------------------------------------------------


def k1(logp, logp_ref) -> np.ndarray:
    """k1 = s - r = log(pi_theta / pi_ref). Unbiased for KL(pi_theta||pi_ref), high variance."""
    return as_f64(logp) - as_f64(logp_ref)


def k2(logp, logp_ref) -> np.ndarray:
    """k2 = 0.5 * d^2 (Schulman 2020). Low variance, biased as a value."""
    return 0.5 * log_ratio(logp, logp_ref) ** 2


def k3_of_log_ratio(d) -> np.ndarray:
    """k3 = exp(d) - d - 1 of a log-ratio d, computed as expm1(d) - d; +inf at d = +inf.

    Written as exp(d) - d - 1 it loses every digit below |d| ~ 1e-8 (it gives 0 at d = 1e-9, where
    k3 = 5e-19); expm1(d) - d keeps a relative error of about 1e-16 / |d| (1.5e-7 at d = 1e-9)."""
    d = as_f64(d)
    with np.errstate(over="ignore", invalid="ignore"):
        out = np.expm1(d) - d
    # expm1(+inf) - inf is NaN; the true limit is +inf.
    return np.where(d == np.inf, np.inf, out)


def k3(logp, logp_ref) -> np.ndarray:
    """k3 = exp(d) - d - 1 >= 0 (Schulman 2020). Unbiased for KL(pi_theta||pi_ref) on-policy."""
    return k3_of_log_ratio(log_ratio(logp, logp_ref))


def k3_is(logp, logp_ref, logp_old) -> np.ndarray:
    """k3_is = rho * k3, DeepSeek-V3.2 eq. 7 (TRL `use_bias_correction_kl`).

    Bounded where k3 is not: rho * exp(d) = pi_ref / pi_old.
    """
    r_, v = rho(logp, logp_old), k3(logp, logp_ref)
    with np.errstate(invalid="ignore"):
        out = r_ * v
    return _nan_to_inf_product(out, r_, v)


def k3_clamped(logp, logp_ref, clamp: float = CLAMP) -> np.ndarray:
    """min(k3, clamp): verl, OpenRLHF, ROLL and AReaL clamp the k3 value to [-clamp, clamp]."""
    return np.minimum(k3(logp, logp_ref), clamp)


def kl_rev(logp, logp_ref) -> np.ndarray:
    """Schulman's estimator of the reverse KL(pi_ref||pi_theta) from samples of pi_theta.

    ratio * log(ratio) - (ratio - 1) = d * exp(d) - expm1(d) >= 0.
    """
    d = log_ratio(logp, logp_ref)
    with np.errstate(over="ignore", invalid="ignore"):
        out = d * np.exp(d) - np.expm1(d)
    return np.where(d == np.inf, np.inf, out)


# ---- gradient weights d(value)/d(logp) ---------------------------------------------


def weight_k1(logp, logp_ref) -> np.ndarray:
    """d k1 / d s = 1: its expected gradient is E[score] = 0 on-policy."""
    return np.ones(np.broadcast_shapes(np.shape(logp), np.shape(logp_ref)))


def weight_k2(logp, logp_ref) -> np.ndarray:
    """d k2 / d s = s - r: expected gradient = grad KL(pi_theta||pi_ref), on-policy."""
    return as_f64(logp) - as_f64(logp_ref)


def weight_k3(logp, logp_ref) -> np.ndarray:
    """d k3 / d s = 1 - exp(d): unbounded below when pi_theta << pi_ref (DeepSeek-V3.2 3.1).

    Its expectation on-policy is grad KL(pi_ref||pi_theta), the *reverse* KL.
    """
    with np.errstate(over="ignore"):
        return -np.expm1(log_ratio(logp, logp_ref))


def weight_k3_is(logp, logp_ref, logp_old) -> np.ndarray:
    """d (rho k3) / d s = rho * (s - r), DeepSeek-V3.2 eq. 9: unbiased off-policy too."""
    r_ = rho(logp, logp_old)
    w = weight_k2(logp, logp_ref)
    with np.errstate(invalid="ignore"):
        out = r_ * w
    return _nan_to_inf_product(out, r_, w)


def weight_k3_clamped(logp, logp_ref, clamp: float = CLAMP) -> np.ndarray:
    """Gradient of min(k3, clamp): K3's weight, and 0 once k3 > clamp (the gradient is lost)."""
    return np.where(k3(logp, logp_ref) > clamp, 0.0, weight_k3(logp, logp_ref))


def weight_kl_rev(logp, logp_ref) -> np.ndarray:
    """d kl_rev / d s = -d * exp(d)."""
    d = log_ratio(logp, logp_ref)
    with np.errstate(over="ignore", invalid="ignore"):
        out = -d * np.exp(d)
    return np.where(np.isnan(out) & ~np.isnan(d), -np.sign(d) * np.inf, out)


def _nan_to_inf_product(out: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """0 * inf is NaN in IEEE; for finite inputs whose factors under/overflow, say inf.

    The product of a ratio that underflowed to 0 and a value that overflowed to inf is
    mathematically finite but unknown; we report it as +-inf (a flag) rather than NaN,
    so it is counted as a blow-up and never poisons a mean. NaN inputs stay NaN.
    """
    bad = np.isnan(out) & ~np.isnan(a) & ~np.isnan(b)
    if not np.any(bad):
        return out
    sign = np.sign(np.where(np.isinf(a), a, 1.0)) * np.sign(np.where(np.isinf(b), b, 1.0))
    return np.where(bad, sign * np.inf, out)


# ---- registry ------------------------------------------------------------------------


class Estimator(NamedTuple):
    """An estimator: its value, its gradient weight, and which log-probs it needs."""

    name: str
    value: Callable[..., np.ndarray]
    weight: Callable[..., np.ndarray]
    needs_old: bool
    target: str  # what the expected gradient equals (docs/metrics.md, the estimator table)


ESTIMATORS: dict[str, Estimator] = {
    "k1": Estimator("k1", k1, weight_k1, False, "0 on-policy"),
    "k2": Estimator("k2", k2, weight_k2, False, "grad KL(theta||ref), on-policy only"),
    "k3": Estimator("k3", k3, weight_k3, False, "grad KL(ref||theta) on-policy; biased off-policy"),
    "k3_is": Estimator("k3_is", k3_is, weight_k3_is, True, "grad KL(theta||ref), also off-policy"),
    "k3_clamped": Estimator("k3_clamped", k3_clamped, weight_k3_clamped, False, "lost above the clamp"),
    "kl_rev": Estimator("kl_rev", kl_rev, weight_kl_rev, False, "value: KL(ref||theta)"),
}


def get_estimator(name: str) -> Estimator:
    """Look an estimator up by name; an unknown name lists the valid ones."""
    try:
        return ESTIMATORS[name]
    except KeyError:
        valid = ", ".join(sorted(ESTIMATORS))
        raise UnknownEstimatorError(f"unknown estimator {name!r}; choose one of: {valid}") from None


def value(name: str, logp, logp_ref, logp_old=None) -> np.ndarray:
    """Value of estimator `name`; `logp_old` defaults to `logp` (on-policy, rho = 1)."""
    est = get_estimator(name)
    if est.needs_old:
        return est.value(logp, logp_ref, logp if logp_old is None else logp_old)
    return est.value(logp, logp_ref)


def weight(name: str, logp, logp_ref, logp_old=None) -> np.ndarray:
    """Gradient weight of estimator `name` w.r.t. logp; `logp_old` defaults to `logp`."""
    est = get_estimator(name)
    if est.needs_old:
        return est.weight(logp, logp_ref, logp if logp_old is None else logp_old)
    return est.weight(logp, logp_ref)


# ---- per-token flags (docs/metrics.md, "Per-token flags") -----------------------------


def flag_theta_ll_ref(logp, logp_ref, tau: float = TAU) -> np.ndarray:
    """pi_theta at least `tau` times below pi_ref: d > log(tau)."""
    with np.errstate(invalid="ignore"):
        return log_ratio(logp, logp_ref) > np.log(tau)


def flag_weight_blowup(logp, logp_ref, limit: float = WEIGHT_LIMIT) -> np.ndarray:
    """K3's gradient weight beyond `limit`: |1 - exp(d)| > limit."""
    with np.errstate(invalid="ignore"):
        return np.abs(weight_k3(logp, logp_ref)) > limit


def flag_clamp_saturated(logp, logp_ref, clamp: float = CLAMP) -> np.ndarray:
    """k3 > clamp: frameworks that clamp the value give this token no KL gradient."""
    with np.errstate(invalid="ignore"):
        return k3(logp, logp_ref) > clamp


def flag_nonfinite(*logps) -> np.ndarray:
    """Any given log-prob is NaN or +-inf (None arguments are skipped: column absent)."""
    present = [~np.isfinite(as_f64(x)) for x in logps if x is not None]
    return np.logical_or.reduce(present) if present else np.zeros((), dtype=bool)


def flag_invalid(*logps) -> np.ndarray:
    """Any given log-prob is finite and > 0, i.e. a probability above one (+inf is nonfinite)."""
    present = []
    for x in logps:
        if x is not None:
            x = as_f64(x)
            with np.errstate(invalid="ignore"):
                present.append(np.isfinite(x) & (x > 0))
    return np.logical_or.reduce(present) if present else np.zeros((), dtype=bool)


class Flags(NamedTuple):
    """Boolean arrays of the per-token flags, all of the inputs' broadcast shape."""

    theta_ll_ref: np.ndarray
    weight_blowup: np.ndarray
    clamp_saturated: np.ndarray
    nonfinite: np.ndarray
    invalid: np.ndarray


FLAG_NAMES = Flags._fields


def flags(
    logp,
    logp_ref,
    logp_old=None,
    logp_sampler=None,
    tau: float = TAU,
    limit: float = WEIGHT_LIMIT,
    clamp: float = CLAMP,
) -> Flags:
    """All per-token flags (docs/metrics.md, "Per-token flags") at once; shapes broadcast."""
    shape = np.broadcast_shapes(*(np.shape(x) for x in (logp, logp_ref, logp_old, logp_sampler) if x is not None))
    everything = (logp, logp_ref, logp_old, logp_sampler)
    return Flags(
        theta_ll_ref=flag_theta_ll_ref(logp, logp_ref, tau),
        weight_blowup=flag_weight_blowup(logp, logp_ref, limit),
        clamp_saturated=flag_clamp_saturated(logp, logp_ref, clamp),
        nonfinite=np.broadcast_to(flag_nonfinite(*everything), shape),
        invalid=np.broadcast_to(flag_invalid(*everything), shape),
    )


def flagged(fl: Flags, mask=True) -> np.ndarray:
    """The one definition of a flagged token (docs/metrics.md, "Flagged tokens"): in the loss (`mask`)
    and with at least one per-token flag; the analysis kernel's count (flagged_frac) is this one's."""
    any_flag = fl.theta_ll_ref | fl.weight_blowup | fl.clamp_saturated | fl.nonfinite | fl.invalid
    return any_flag & np.asarray(mask, bool)


def opsm_drop(advantage, gap_sum, n, delta: float) -> np.ndarray:
    """DeepSeek-V3.2's off-policy sequence mask (TRL's `off_policy_mask_threshold`): drop a sequence
    when its advantage is negative and the mean over its n loss tokens of log mu - log pi_theta
    (gap_sum / n; n = 0 counts as 1, as TRL divides) exceeds delta. Arrays [S]; NaN advantage: kept."""
    with np.errstate(invalid="ignore"):
        mean = as_f64(gap_sum) / np.maximum(as_f64(n), 1.0)
        return (as_f64(advantage) < 0) & (mean > delta)
