"""The estimator lab reproduces the known-truth results of docs/metrics.md ("Known truth")."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kldiag.cli import main
from kldiag.tools.lab import LabConfig, kl_normal_grad, kl_normal_grad_reverse, run_lab


def rows_by_key(rows):
    return {(r.estimator, r.param): r for r in rows}


def test_analytic_gradients_match_the_design_figures():
    np.testing.assert_allclose(kl_normal_grad(0, 1, 1, 1.1), (-0.826446, -0.173554), atol=1e-6)
    np.testing.assert_allclose(kl_normal_grad_reverse(0, 1, 1, 1.1), (-1.0, -1.21), atol=1e-12)


def test_analytic_gradient_matches_finite_differences():
    def kl(m1, s1, m2=1.0, s2=1.1):
        return np.log(s2 / s1) + (s1**2 + (m1 - m2) ** 2) / (2 * s2**2) - 0.5

    h = 1e-6
    fd = ((kl(h, 1) - kl(-h, 1)) / (2 * h), (kl(0, 1 + h) - kl(0, 1 - h)) / (2 * h))
    np.testing.assert_allclose(kl_normal_grad(0, 1, 1, 1.1), fd, rtol=1e-6)


def test_on_policy_known_results():
    r = rows_by_key(run_lab(LabConfig(samples=4000, trials=200, seed=1)))
    assert r["k1", "mu"].bias_over_true == pytest.approx(1.0, abs=0.05)
    for name in ("k2", "k3_is"):
        for p in ("mu", "sigma"):
            assert r[name, p].bias_over_true < 0.05, (name, p)
    assert r["k3", "mu"].bias_over_true == pytest.approx(0.21, abs=0.03)
    assert r["k3", "sigma"].bias_over_true == pytest.approx(5.97, rel=0.05)
    # k3 lands on the reverse-KL gradient
    assert r["k3", "mu"].bias_over_true_reverse < 0.02 and r["k3", "sigma"].bias_over_true_reverse < 0.03


def test_off_policy_k3_is_biased_k3_is_is_not():
    r = rows_by_key(run_lab(LabConfig(samples=4000, trials=200, seed=2, mu_old=0.5, sigma_old=1.2)))
    assert r["k3", "mu"].bias_over_true > 0.2 and r["k3", "sigma"].bias_over_true > 5
    assert r["k3_is", "mu"].bias_over_true < 0.05 and r["k3_is", "sigma"].bias_over_true < 0.15
    # k2 (no ratio) loses its on-policy unbiasedness
    assert r["k2", "sigma"].bias_over_true > 0.5


def test_cli_json(capsys):
    assert main(["lab", "--samples", "500", "--trials", "20", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {row["estimator"] for row in out["rows"]} == {"k1", "k2", "k3", "k3_is", "k3_clamped"}
    assert out["config"]["samples"] == 500


def test_cli_table_and_bad_arguments(capsys):
    assert main(["lab", "--samples", "500", "--trials", "20", "--mu-old", "0.3"]) == 0
    assert "off-policy" in capsys.readouterr().out
    with pytest.raises(ValueError, match="sigma"):
        run_lab(LabConfig(sigma_old=-1.0))
