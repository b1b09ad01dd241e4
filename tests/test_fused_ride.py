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
from test_estimator_kernel import _batch

TH = Thresholds(tau=20.0, weight_limit=10.0, clamp=10.0, clip_low=0.2, clip_high=0.28, top_k=50)
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


def full_batch(seed: int, n: int, absent: tuple[str, ...] = ()) -> pa.RecordBatch:
    """test_estimator_kernel's batch (special values, nulls, mask holes) with every column the analysis reads."""
    b = _batch(seed, n=n, absent=absent)
    pos = np.arange(n) % 30
    extra = {"micro": np.zeros(n, np.int64), "iteration": np.zeros(n, np.int64), "group": np.arange(n) // 60,
             "pos": pos, "token_id": (np.arange(n) * 7) % 1000}
    return pa.RecordBatch.from_arrays([*b.columns, *(pa.array(v, pa.int64()) for v in extra.values())],
                                      names=[*b.schema.names, *extra])


def ridden(batch: pa.RecordBatch, red: VE.EstimatorReducer, seed: int):
    """(analysis BatchResult, estimator arrays) from the one ridden pass."""
    state = {"seed": seed, "parts": []}
    res = stats.batch_partials(batch, 3, TH, ride=red.ride(state))
    return res, state["parts"][0]


@pytest.mark.parametrize("seed", [0, 1, 3])
@pytest.mark.parametrize("absent", [(), ("logp_old",), ("logp_ref",), ("logp_old", "logp_sampler")])
def test_ridden_batch_equals_the_two_passes(seed, absent):
    batch = full_batch(seed, 5000, absent)
    red = VE.EstimatorReducer(tau=[20.0, 5.0, 0, 100.0][seed], weight_limit=[10.0, 2.0, 0, 50.0][seed],
                              clamp=10.0, sample_size=300)
    got_a, got_e = ridden(batch, red, seed)
    want_a = stats.batch_partials(batch, 3, TH)
    want_e = VE.batch_arrays(batch, red.config(), red.sample_size, seed)
    for t in ("steps", "seqs", "top", "bad"):
        assert_same(getattr(got_a, t), getattr(want_a, t), t)
    assert_same(got_e, want_e, "estimators")
    assert want_e["tokens"][0] and want_e["flagged"][0] or "logp_ref" in absent
