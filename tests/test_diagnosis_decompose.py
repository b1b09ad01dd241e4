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
