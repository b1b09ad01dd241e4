"""The side scan's compiled pass (kldiag.analysis.kernels.side_scan): runs found inside chunks, absent columns."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa

from kldiag.analysis.kernels.side_scan import CHUNK, run_sums
from kldiag.analysis.reducers import scan as S

LOG_CONF = math.log(0.99)


def _runs_in_numpy(step, mask, logp, old, smp, ent):
    """Per run of equal consecutive steps, the SUMS in numpy (float64): the definition the kernel sums."""
    cut = np.flatnonzero(np.diff(step)) + 1
    lo, hi = np.r_[0, cut], np.r_[cut, len(step)]
    f = [np.asarray(a, np.float64) for a in (logp, old, smp, ent)]
    logp, old, smp, ent = f
    old = np.where(np.isnan(old), logp, old)
    with np.errstate(invalid="ignore", over="ignore"):
        tmpe = np.exp(np.abs(old - smp))
    e_ok, t_ok = mask & np.isfinite(ent), mask & np.isfinite(tmpe)
    rows = np.stack([mask, e_ok, np.where(e_ok, ent, 0.0), mask & (logp > LOG_CONF), t_ok,
                     np.where(t_ok, tmpe, 0.0)], 1).astype(np.float64)
    return step[lo], np.array([rows[a:b].sum(0) for a, b in zip(lo, hi, strict=True)]).reshape(-1, 6)


def test_runs_that_end_inside_a_chunk_or_on_its_edge_and_a_step_that_comes_back():
    rng = np.random.default_rng(5)
    n = 3 * CHUNK + 77
    step = np.repeat(np.array([4, 5, 6, 4, 7, 8], np.int64), [CHUNK, 10, CHUNK - 10, 1, CHUNK + 30, 36])
    mask = rng.random(n) < 0.8
    logp, old, smp = (np.where(rng.random(n) < 0.1, np.nan, -rng.exponential(1.0, n)).astype(np.float32)
                      for _ in range(3))
    ent = rng.exponential(1.0, n).astype(np.float32)
    smp[:5], ent[7:9], logp[:20] = -np.inf, np.inf, -1e-4  # a tmpe and entropies not finite; confident tokens
    steps, sums = run_sums(step, mask, logp, old, smp, ent, LOG_CONF)
    want_steps, want = _runs_in_numpy(step, mask, logp, old, smp, ent)
    assert steps.tolist() == want_steps.tolist() == [4, 5, 6, 4, 7, 8]
    np.testing.assert_array_equal(sums[:, [0, 1, 3, 4]], want[:, [0, 1, 3, 4]])  # counts: exact
    np.testing.assert_allclose(sums, want, rtol=1e-12)  # float sums: another order of the additions


def test_no_rows_and_more_runs_than_the_first_allocation():
    steps, sums = run_sums(np.zeros(0, np.int64), np.zeros(0, bool), *(np.zeros(0, np.float32),) * 4, LOG_CONF)
    assert steps.shape == (0,) and sums.shape == (0, 6)
    step = np.arange(100, dtype=np.int64) % 7  # 100 runs of one row
    one = np.full(100, -0.5, np.float32)
    steps, sums = run_sums(step, np.ones(100, bool), one, one, one, one, LOG_CONF)
    assert steps.tolist() == step.tolist() and sums[:, 0].tolist() == [1.0] * 100


def test_a_column_of_nulls_counts_nothing():
    """A run without entropy (the column all null): no entropy counted, the other sums as with it."""
    n = 2000
    rng = np.random.default_rng(1)
    cols = {"step": pa.array(np.repeat([1, 2], n // 2)), "mask": pa.array(rng.random(n) < 0.9),
            **{k: pa.array(-rng.exponential(1.0, n).astype(np.float32)) for k in ("logp", "logp_old", "logp_sampler")}}
    with_ent = S.batch_sums(pa.record_batch({**cols, "entropy": pa.array(np.ones(n, np.float32))}))
    without = S.batch_sums(pa.record_batch({**cols, "entropy": pa.nulls(n, pa.float32())}))
    for s in (1, 2):
        assert without[s][1] == without[s][2] == 0.0 and without[s][0] == with_ent[s][0] > 0
        np.testing.assert_array_equal(without[s][3:], with_ent[s][3:])


def test_no_sampler_takes_no_exp_and_gives_the_same_sums():
    """has_m False (no row has logp_sampler): the sums of the full computation, bit for bit."""
    rng = np.random.default_rng(2)
    n = 2 * CHUNK + 5
    step = np.repeat(np.array([1, 2, 1], np.int64), [CHUNK + 3, CHUNK, 2])
    logp, old, ent = (-rng.exponential(1.0, n).astype(np.float32) for _ in range(3))
    smp = np.full(n, np.nan, np.float32)
    args = (step, rng.random(n) < 0.7, logp, old, smp, ent, LOG_CONF)
    full, skipped = run_sums(*args), run_sums(*args, False)
    np.testing.assert_array_equal(full[0], skipped[0])
    np.testing.assert_array_equal(full[1], skipped[1])
    assert (skipped[1][:, 4:] == 0).all() and (skipped[1][:, 0] > 0).all()
