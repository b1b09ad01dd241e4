"""Decomposition log(pi_theta/mu) = drift + mismatch: the identity, the buckets, and the demo's
low-probability pitfall (the engine at temperature 1.2 flattens mu, so mismatch grows as mu's probability falls)."""

from __future__ import annotations

import numpy as np
import pytest

from kldiag.mismatch import decompose as D
from kldiag.mismatch import tokenset as TS

DEMO = "sample_logs/demo_k3"


@pytest.fixture(scope="module")
def ts():
    return TS.load(DEMO)


def test_terms_add_up_and_steps_agree_with_the_tokens(ts):
    t = D.terms(ts)
    np.testing.assert_allclose(t["total"], ts.logp - ts.logp_sampler, rtol=0, atol=1e-12)
    table = D.by_step(ts).to_pylist()
    assert len(table) == 200 and table[0]["drift_abs"] == 0.0  # step 0: pi_theta is pi_old
    sel = ts.step == 37
    row = table[37]
    assert row["mismatch_abs"] == pytest.approx(np.abs(ts.logp_old[sel] - ts.logp_sampler[sel]).mean())
    assert row["drift_abs"] == pytest.approx(np.abs(ts.logp[sel] - ts.logp_old[sel]).mean())


def test_low_probability_pitfall_on_the_demo(ts):
    b = D.by_sampler_prob(ts).to_pylist()
    assert sum(r["tokens"] for r in b) == len(ts)
    low, high = b[0], b[-1]
    assert low["hi"] <= 0.01 and high["lo"] >= 0.1
    assert low["mismatch_abs"] > 5 * high["mismatch_abs"]
    assert low["mismatch_k3"] > 10 * high["mismatch_k3"]


def test_position_and_entropy_buckets(ts):
    pos = D.by_position(ts).to_pylist()
    assert [(r["lo"], r["hi"]) for r in pos] == [(0, 1), (1, 2), (2, 4), (4, 8)]  # 8-token completions
    assert [r["tokens"] for r in pos] == [12800, 12800, 25600, 51200]
    assert D.by_entropy(ts) is None  # the demo records no entropy
    ts2 = TS.load("sample_logs/trl_grpo_tiny")
    ent = D.by_entropy(ts2)
    assert ent is not None and sum(ent.column("tokens").to_pylist()) == int(ts2.mask.sum())


def test_summary_share(ts):
    s = D.summary(ts)
    assert s["tokens"] == 102400
    assert s["mismatch_share"] == pytest.approx(s["mismatch_abs"] / (s["drift_abs"] + s["mismatch_abs"]))


def test_mismatch_k3_keeps_precision_near_zero():
    """K3 of KL(mu || pi_old) for a tiny log-ratio d: exp(d) - d - 1 gives 0 at d = 1e-9 (cancellation);
    the expm1 form (kldiag.estimators) matches the series d^2/2 + d^3/6 + d^4/24 to a few 1e-7."""
    m = np.array([-1e-9, 1e-9, -0.5 - 1e-9, -1e-6, -3e-5])  # log mu; one token per step
    o = np.array([0.0, 0.0, -0.5, 0.0, 0.0])  # log pi_old
    n = len(m)
    ints = np.arange(n, dtype=np.int64)
    ts = TS.TokenSet(step=ints, seq=np.zeros(n, np.int64), group=np.full(n, -1), pos=np.zeros(n, np.int64),
                     token_id=np.full(n, -1), iteration=np.zeros(n, np.int64), micro=np.zeros(n, np.int64),
                     rank=np.zeros(n, np.int64), logp=o.copy(), logp_old=o, logp_ref=np.full(n, np.nan),
                     logp_sampler=m, advantage=np.full(n, np.nan), mask=np.ones(n, bool), entropy=np.full(n, np.nan),
                     has_old=np.ones(n, bool))
    d = o - m  # exact in float64 (Sterbenz), the d decompose sees
    series = d**2 / 2 + d**3 / 6 + d**4 / 24
    got = np.array(D.by_step(ts).column("mismatch_k3").to_pylist())
    np.testing.assert_allclose(got, series, rtol=1e-6)
    assert np.exp(d[0]) - d[0] - 1 == 0.0  # what the naive form gives: every digit lost
