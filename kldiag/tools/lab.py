"""The estimator lab: a known-truth check of every estimator's gradient on Gaussians."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kldiag import estimators as E

LAB_ESTIMATORS = ("k1", "k2", "k3", "k3_is", "k3_clamped")


@dataclass(frozen=True)
class LabConfig:
    mu: float = 0.0
    sigma: float = 1.0
    mu_ref: float = 1.0
    sigma_ref: float = 1.1
    mu_old: float | None = None  # None: on-policy (pi_old = pi_theta)
    sigma_old: float | None = None
    samples: int = 10_000  # per trial
    trials: int = 300
    seed: int = 0


@dataclass(frozen=True)
class LabRow:
    """One estimator and parameter: mean and spread of its gradient over the trials."""

    estimator: str
    param: str  # "mu" or "sigma"
    mean: float
    std: float
    true_forward: float  # d KL(pi_theta||pi_ref) / d param
    true_reverse: float  # d KL(pi_ref||pi_theta) / d param
    bias_over_true: float  # |mean - true_forward| / |true_forward|
    std_over_true: float  # std / |true_forward|
    bias_over_true_reverse: float  # |mean - true_reverse| / |true_reverse|


def normal_logpdf(x: np.ndarray, mu: float, sigma: float) -> np.ndarray:
    """log N(x; mu, sigma^2), float64, shape of x."""
    z = (x - mu) / sigma
    return -0.5 * z * z - np.log(sigma) - 0.5 * np.log(2 * np.pi)


def normal_score(x: np.ndarray, mu: float, sigma: float) -> tuple[np.ndarray, np.ndarray]:
    """(d/dmu, d/dsigma) of log N(x; mu, sigma^2)."""
    return (x - mu) / sigma**2, ((x - mu) ** 2 - sigma**2) / sigma**3


def kl_normal_grad(mu1: float, s1: float, mu2: float, s2: float) -> tuple[float, float]:
    """Gradient of KL(N(mu1, s1)||N(mu2, s2)) w.r.t. (mu1, s1): analytic."""
    return (mu1 - mu2) / s2**2, -1.0 / s1 + s1 / s2**2


def kl_normal_grad_reverse(mu1: float, s1: float, mu2: float, s2: float) -> tuple[float, float]:
    """Gradient of KL(N(mu2, s2)||N(mu1, s1)) w.r.t. (mu1, s1): analytic."""
    return (mu1 - mu2) / s1**2, 1.0 / s1 - (s2**2 + (mu2 - mu1) ** 2) / s1**3


def sampled_gradients(cfg: LabConfig, name: str, x: np.ndarray) -> np.ndarray:
    """Per-trial gradient estimates, shape [trials, 2], for samples x of shape [trials, samples]."""
    logp = normal_logpdf(x, cfg.mu, cfg.sigma)
    logp_ref = normal_logpdf(x, cfg.mu_ref, cfg.sigma_ref)
    mu_old = cfg.mu if cfg.mu_old is None else cfg.mu_old
    sigma_old = cfg.sigma if cfg.sigma_old is None else cfg.sigma_old
    logp_old = normal_logpdf(x, mu_old, sigma_old)
    w = E.weight(name, logp, logp_ref, logp_old)
    score_mu, score_sigma = normal_score(x, cfg.mu, cfg.sigma)
    return np.stack([(w * score_mu).mean(axis=1), (w * score_sigma).mean(axis=1)], axis=1)


def run_lab(cfg: LabConfig = LabConfig(), estimators: tuple[str, ...] = LAB_ESTIMATORS) -> list[LabRow]:
    """Every estimator's gradient bias and spread, from the same samples for all of them."""
    for name in estimators:
        E.get_estimator(name)  # unknown names fail before any sampling
    if cfg.samples < 2 or cfg.trials < 2:
        raise ValueError(f"samples and trials must be >= 2 (got {cfg.samples}, {cfg.trials})")
    if (cfg.sigma_old is not None and cfg.sigma_old <= 0) or cfg.sigma <= 0 or cfg.sigma_ref <= 0:
        raise ValueError("every sigma must be > 0; pass --sigma-old with a positive value")
    rng = np.random.default_rng(cfg.seed)
    mu_old = cfg.mu if cfg.mu_old is None else cfg.mu_old
    sigma_old = cfg.sigma if cfg.sigma_old is None else cfg.sigma_old
    x = rng.normal(mu_old, sigma_old, size=(cfg.trials, cfg.samples))
    fwd = kl_normal_grad(cfg.mu, cfg.sigma, cfg.mu_ref, cfg.sigma_ref)
    rev = kl_normal_grad_reverse(cfg.mu, cfg.sigma, cfg.mu_ref, cfg.sigma_ref)
    rows = []
    for name in estimators:
        g = sampled_gradients(cfg, name, x)
        for i, param in enumerate(("mu", "sigma")):
            mean, std = float(g[:, i].mean()), float(g[:, i].std(ddof=1))
            rows.append(LabRow(name, param, mean, std, fwd[i], rev[i], abs(mean - fwd[i]) / abs(fwd[i]),
                               std / abs(fwd[i]), abs(mean - rev[i]) / abs(rev[i])))
    return rows


def format_table(cfg: LabConfig, rows: list[LabRow]) -> str:
    """Plain-text table of the lab's rows, one line per estimator and parameter."""
    policy = ("on-policy (samples from pi_theta)" if cfg.mu_old is None and cfg.sigma_old is None else
              f"off-policy (samples from pi_old = N({cfg.mu_old if cfg.mu_old is not None else cfg.mu}, "
              f"{cfg.sigma_old if cfg.sigma_old is not None else cfg.sigma}))")
    head = (f"pi_theta = N({cfg.mu}, {cfg.sigma}), pi_ref = N({cfg.mu_ref}, {cfg.sigma_ref}), {policy}\n"
            f"{cfg.trials} trials x {cfg.samples} samples; gradient = mean(weight(x) * score(x))\n")
    cols = f"{'estimator':<11}{'param':<7}{'mean grad':>11}{'true fwd':>11}{'bias/true':>11}" \
           f"{'stdev/true':>12}{'true rev':>11}{'bias/rev':>10}"
    lines = [head, cols, "-" * len(cols)]
    for r in rows:
        lines.append(f"{r.estimator:<11}{r.param:<7}{r.mean:>11.4f}{r.true_forward:>11.4f}{r.bias_over_true:>11.3f}"
                     f"{r.std_over_true:>12.3f}{r.true_reverse:>11.4f}{r.bias_over_true_reverse:>10.3f}")
    lines.append("\nbias/true = |mean - true| / |true| for grad KL(pi_theta||pi_ref) (fwd) and "
                 "KL(pi_ref||pi_theta) (rev).\nAn estimator fit for a KL(pi_theta||pi_ref) penalty has bias/true "
                 "near 0; k3 lands on the reverse KL on-policy and on neither off-policy.")
    return "\n".join(lines)
