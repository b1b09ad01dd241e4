"""The Estimators page's reducer riding in the analysis's compiled pass (analysis/fused_ride.py) gives the
partials the two give apart: the analysis's and the estimators' counts, maxima, histograms, kept rows and
token sample exactly, their sums to rounding (added in other chunks)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from kldiag.analysis import stats
from kldiag.analysis.kernel import Thresholds
from kldiag.analysis.types import AnalysisConfig
from kldiag.views import estimators as VE

# test_estimator_kernel's special values, -2000 for its -3e38: d of +-3e38 cancel in a sum to an order-dependent
# rounding error of 1e22 (to 1e-12 of the largest term); -2000 still overflows exp and expm1
SPECIAL = np.array([np.nan, np.inf, -np.inf, 0.5, 3.0, 0.0, -0.0, -1e-30, -80.0, -2000.0], np.float32)
SUMS = ("sum_", "value_sum/", "weight_abs_sum/", "weight_abs_flagged/", "k3_weight_lost")


def assert_same(got: dict, want: dict, what: str) -> None:
    """Equal named arrays: exactly, sums (by name) to 1e-12 relative."""
    assert list(got) == list(want), what
    for k in want:
        g, w = np.asarray(got[k]), np.asarray(want[k])
        assert g.dtype == w.dtype and g.shape == w.shape, (what, k)
        if any(k.startswith(p) or f"/{p}" in f"/{k}" for p in SUMS) and g.dtype.kind == "f":
            np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-300, err_msg=f"{what} {k}")
        else:
            np.testing.assert_array_equal(g, w, err_msg=f"{what} {k}")


def full_batch(seed: int, n: int, absent: tuple[str, ...] = (), odd: float = 0.03, seq_len: int = 30,
               steps: int = 7) -> pa.RecordBatch:
    """Log-probs from ordinary to extreme, special values (NaN, +-inf, positive) at rate `odd` per column,
    nulls, mask holes, sequences of seq_len rows, `steps` sequences a step: every column the analysis reads."""
    rng = np.random.default_rng(seed)
    s = -rng.exponential(2.0, n)
    cols = {"logp": s, "logp_ref": s + rng.normal(0, rng.choice([0.01, 1.0, 8.0], n)),
            "logp_old": s + rng.normal(0, 0.3, n), "logp_sampler": s + rng.normal(0, 0.05, n)}
    arrays = {}
    for c, v in cols.items():
        v = v.astype(np.float32)
        bad = rng.random(n) < odd
        v[bad] = rng.choice(SPECIAL, bad.sum())
        null = np.ones(n, bool) if c in absent else rng.random(n) < (0.0 if c == "logp" else odd)
        arrays[c] = pa.array(v, mask=null)
    seq = np.arange(n) // seq_len
    adv = rng.normal(0, 1, n)
    adv[rng.random(n) < 0.2] = np.nan
    ints = {"step": seq // steps, "seq": seq, "micro": np.zeros(n), "iteration": np.zeros(n), "group": seq // 4,
            "pos": np.arange(n) % seq_len, "token_id": (np.arange(n) * 7) % 1000}
    return pa.RecordBatch.from_pydict({
        **{k: pa.array(v.astype(np.int64)) for k, v in ints.items()}, "advantage": pa.array(adv.astype(np.float32)),
        "mask": pa.array(rng.random(n) < 0.8, mask=rng.random(n) < 0.01), **arrays})


def thresholds(red: VE.EstimatorReducer) -> Thresholds:
    return Thresholds(red.tau, red.weight_limit, red.clamp, clip_low=0.2, clip_high=0.28, top_k=50)


def ridden(batch: pa.RecordBatch, red: VE.EstimatorReducer, seed: int):
    """(analysis BatchResult, estimator arrays) from the one ridden pass."""
    state = {"seed": seed, "parts": []}
    res = stats.batch_partials(batch, 3, thresholds(red), ride=red.ride(state))
    return res, state["parts"][0]


@pytest.mark.parametrize("seed", [0, 1, 3])
@pytest.mark.parametrize("absent", [(), ("logp_old",), ("logp_ref",), ("logp_old", "logp_sampler")])
@pytest.mark.parametrize("odd", [0.03, 0.0005])
def test_ridden_batch_equals_the_two_passes(seed, absent, odd):
    """Special values often (most chunks run the estimators' own loop) and rarely (most take the analysis's
    sums), sequences shorter and longer than a chunk."""
    batch = full_batch(seed, 6000, absent, odd, seq_len=[30, 700, 0, 257][seed])
    red = VE.EstimatorReducer(tau=[20.0, 5.0, 0, 100.0][seed], weight_limit=[10.0, 2.0, 0, 50.0][seed],
                              clamp=[10.0, 1.0, 0, 30.0][seed], sample_size=300)
    got_a, got_e = ridden(batch, red, seed)
    want_a = stats.batch_partials(batch, 3, thresholds(red))
    want_e = VE.batch_arrays(batch, red.config(), red.sample_size, seed)
    for t in ("steps", "seqs", "top", "bad"):
        assert_same(getattr(got_a, t), getattr(want_a, t), t)
    assert_same(got_e, want_e, "estimators")
    assert want_e["tokens"][0] and want_e["flagged"][0] and want_e["clamp_saturated"][0] or "logp_ref" in absent
