"""The Estimators page's compiled pass equals its numpy reference (views.pages.derive, estimators.py):
counts, histograms and the token sample exactly, sums and maxima to 1e-12 (numba's exp and expm1 are
libm's, numpy's its own vectorised ones: they differ by an ulp on some inputs)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from logp_batches import logp_columns

from kldiag import estimators as E
from kldiag.analysis.core.bins import abs_bins
from kldiag.analysis.core.stats import ABS_GRID
from kldiag.analysis.kernels import estimators as K
from kldiag.analysis.types import ABS_EDGES, AnalysisConfig
from kldiag.views import estimators as VE
from kldiag.views.pages import LOGP_COLUMNS, derive, nulls

SPECIAL = np.array([np.nan, np.inf, -np.inf, 0.5, 3.0, 0.0, -0.0, -1e-30, -80.0, -3e38], np.float32)


def _numpy_partial(batch, config: AnalysisConfig, sample_size: int, seed: int) -> VE.EstimatorPartial:
    """The partial as numpy computes it (the reducer's code before it was compiled)."""
    cols = {c: E.as_f64(batch.column(c)) for c in LOGP_COLUMNS}
    absent = nulls(batch)
    keep = np.asarray(batch.column("mask").to_numpy(zero_copy_only=False), dtype=bool) & ~absent["logp_ref"]
    part = VE.EstimatorPartial(rows=batch.num_rows, tokens=int(keep.sum()))
    q = derive({c: v[keep] for c, v in cols.items()}, config, {c: v[keep] for c, v in absent.items()})
    part.flagged = int(q["flagged"].sum())
    part.clamp_saturated = int(q["clamp_saturated"].sum())
    with np.errstate(invalid="ignore"):
        lost = np.abs(q["weight_k3"][q["clamp_saturated"]])
    part.k3_weight_lost = float(lost[np.isfinite(lost)].sum())
    for name, (value, weight) in VE.values_and_weights(q, config).items():
        finite_v = np.isfinite(value)
        part.value_sum[name] = float(value[finite_v].sum())
        part.value_nonfinite[name] = int((~finite_v).sum())
        w = np.abs(weight)
        finite_w = np.isfinite(w)
        part.weight_abs_sum[name] = float(w[finite_w].sum())
        part.weight_abs_flagged[name] = float(w[finite_w & q["flagged"]].sum())
        part.weight_abs_max[name] = float(np.nanmax(w)) if w.size and not np.all(np.isnan(w)) else 0.0
        part.weight_hist[name] = np.bincount(abs_bins(w[~np.isnan(w)]), minlength=len(ABS_EDGES) + 1)
    pick, kind = VE.sample_pick(q["weight_k3"], q["flagged"], sample_size, seed)
    ids = {c: batch.column(c).to_numpy()[keep][pick] for c in ("step", "seq")}
    part.sample = pd.DataFrame({**ids, **{c: q[c][pick] for c in VE.SAMPLE_COLUMNS if c not in ids and c != "kind"},
                                "kind": kind})
    return part


def _batch(seed: int, n: int = 3000, absent: tuple[str, ...] = (), repeat_keys: bool = False) -> pa.RecordBatch:
    """Log-probs from ordinary to extreme, special values (NaN, +-inf, positive) and nulls scattered in."""
    rng = np.random.default_rng(seed)
    cols = logp_columns(rng, n, SPECIAL, absent=absent)
    seq = np.repeat(np.arange(n // 30 + 1), 30)[:n]
    if repeat_keys:  # a sequence's rows split in two runs within the batch
        seq = np.concatenate([seq[n // 2:], seq[: n // 2]])
    return pa.RecordBatch.from_pydict({"step": pa.array(seq // 7, pa.int64()), "seq": pa.array(seq, pa.int64()),
                                       **cols})


def _assert_equal(got: VE.EstimatorPartial, want: VE.EstimatorPartial) -> None:
    for k in ("rows", "tokens", "flagged", "clamp_saturated"):
        assert getattr(got, k) == getattr(want, k), k
    np.testing.assert_allclose(got.k3_weight_lost, want.k3_weight_lost, rtol=1e-12)
    assert list(got.value_sum) == list(want.value_sum) == list(VE.COMPARED)
    for name in VE.COMPARED:
        assert got.value_nonfinite[name] == want.value_nonfinite[name], name
        np.testing.assert_array_equal(got.weight_hist[name], want.weight_hist[name])
        for k in ("value_sum", "weight_abs_sum", "weight_abs_flagged", "weight_abs_max"):
            np.testing.assert_allclose(getattr(got, k)[name], getattr(want, k)[name], rtol=1e-12, err_msg=k)
    pd.testing.assert_frame_equal(got.sample, want.sample)  # derive's values at the same rows: exact


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("absent", [(), ("logp_old",), ("logp_ref",), ("logp_old", "logp_sampler")])
def test_compiled_partial_equals_numpy(seed, absent):
    batch = _batch(seed, absent=absent, repeat_keys=seed == 2)
    config = AnalysisConfig(tau=[20.0, 5.0, 100.0][seed], weight_limit=[10.0, 2.0, 50.0][seed], clamp=10.0)
    got = VE._batch_partial(batch, config, 50, seed)
    want = _numpy_partial(batch, config, 50, seed)
    assert got.tokens and got.flagged and got.clamp_saturated or "logp_ref" in absent
    _assert_equal(got, want)
    # the cached format (to_arrays) is the same too: same keys, dtypes and shapes
    a, b = VE.to_arrays(got), VE.to_arrays(want)
    assert {k: (v.dtype, v.shape) for k, v in a.items()} == {k: (v.dtype, v.shape) for k, v in b.items()}


def test_compiled_partial_of_an_empty_batch_and_a_table():
    empty = _batch(0).slice(0, 0)
    _assert_equal(VE._batch_partial(empty, AnalysisConfig(), 10, 0), _numpy_partial(empty, AnalysisConfig(), 10, 0))
    table = pa.Table.from_batches([_batch(3, n=500), _batch(4, n=400)])
    _assert_equal(VE._batch_partial(table, AnalysisConfig(), 10, 0), _numpy_partial(table, AnalysisConfig(), 10, 0))


def _pass(batch, tau=20.0, limit=10.0, clamp=10.0):
    """token_pass over a batch with its per-token trace: (tokens, kept sets, K3 weight and flagged per token,
    mask, null masks, the tokens' rows)."""
    raw = {c: batch.column(c).to_numpy(zero_copy_only=False) for c in LOGP_COLUMNS}
    absent, n = nulls(batch), batch.num_rows
    mask = np.asarray(batch.column("mask").to_numpy(zero_copy_only=False), bool)
    w_k3, flagged, rows = np.empty(n), np.empty(n, bool), np.empty(n, np.int64)
    scal = np.zeros(5, np.int64)
    sums = np.zeros((4, 5)), np.zeros((1, 5), np.int64), np.zeros((5, len(ABS_EDGES) + 1), np.int64)
    kept = np.empty(VE.KEEP_TOP), np.empty(VE.KEEP_TOP, np.int64), np.empty(VE.KEEP_FLAGGED), \
        np.empty(VE.KEEP_FLAGGED, np.int64)
    K.token_pass(*(raw[c] for c in ("logp", "logp_old", "logp_ref", "logp_sampler")),
                 *(absent[c] for c in ("logp", "logp_old", "logp_ref", "logp_sampler")), mask, np.log(tau), limit,
                 clamp, ABS_GRID, *sums, scal, *kept, w_k3, flagged, rows, np.empty(0, np.int64))
    m = scal[K.S_TOKENS]
    top, worst = kept[1][: scal[K.S_TOP]], kept[3][: scal[K.S_WORST]]
    return m, top, worst, w_k3[:m], flagged[:m], mask, absent, rows[:m]


def test_token_values_within_two_ulp_of_estimators():
    """The kernel's K3 weight per token equals estimators.weight_k3 within 2 ulp; its flagged bit and the
    tokens it keeps (in the loss, with a reference log-prob) exactly those of derive."""
    batch = _batch(5, n=20000)
    m, top, worst, w_k3, flagged, mask, absent, rows = _pass(batch)
    keep = mask & ~absent["logp_ref"]
    np.testing.assert_array_equal(rows, np.flatnonzero(keep))
    s, r = (E.as_f64(batch.column(c))[keep] for c in ("logp", "logp_ref"))
    want = E.weight_k3(s, r)
    np.testing.assert_array_equal(np.isfinite(w_k3), np.isfinite(want))
    ok = np.isfinite(want)
    ulp = np.spacing(np.abs(want[ok]))
    assert np.all(np.abs(w_k3[ok] - want[ok]) <= 2 * ulp)
    cols = {c: E.as_f64(batch.column(c))[keep] for c in LOGP_COLUMNS}
    q = derive(cols, AnalysisConfig(), {c: v[keep] for c, v in absent.items()})
    np.testing.assert_array_equal(flagged, q["flagged"])


@pytest.mark.parametrize("ties", [False, True])
def test_kept_tokens_are_largest_sets(ties):
    """The pass's running selection keeps the sets `largest` gives (NaN as +inf, of equal weights the
    first tokens), and kept_pick then draws exactly sample_pick's sample."""
    batch = _batch(6, n=20000)
    if ties:  # five distinct weights (NaN among them): every cut falls inside a run of equal ones
        n = batch.num_rows
        r = np.resize(np.array([-0.5, 0.5, np.nan, -1.0, 2.5], np.float32), n)
        for c, v in (("logp", np.full(n, -1.0, np.float32)), ("logp_ref", r)):
            batch = batch.set_column(batch.schema.get_field_index(c), c, pa.array(v))
    m, top, worst, w_k3, flagged, *_ = _pass(batch)
    w = np.abs(w_k3)
    w = np.where(np.isnan(w), np.inf, w)
    assert set(top) == set(VE.largest(w, VE.KEEP_TOP))
    at = np.flatnonzero(flagged)
    assert set(worst) == set(at[VE.largest(w[at], VE.KEEP_FLAGGED)])
    assert len(worst) == min(VE.KEEP_FLAGGED, len(at)) and len(top) == min(VE.KEEP_TOP, m)
    for size in (0, 100, m):
        got, want = VE.kept_pick(top, worst, m, size, 7), VE.sample_pick(w_k3, flagged, size, 7)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])



@pytest.mark.parametrize("ties", [False, True])
def test_pass_without_trace_skips_chunks_and_finds_the_same_tokens(ties):
    """Without a trace the pass only counts the chunks that cannot add a kept token: its kept sets, counts and
    sums equal the traced pass's, and token_rows maps token numbers to the traced pass's rows."""
    batch = _batch(8, n=60000)
    if ties:  # few distinct weights: chunks tie with the roots of full sets
        n = batch.num_rows
        r = np.resize(np.array([-0.5, 0.5, np.nan, -1.0, 2.5, -9.0], np.float32), n)
        for c, v in (("logp", np.full(n, -1.0, np.float32)), ("logp_ref", r)):
            batch = batch.set_column(batch.schema.get_field_index(c), c, pa.array(v))
    m, top, worst, w_k3, flagged, mask, absent, rows = _pass(batch)
    raw = {c: batch.column(c).to_numpy(zero_copy_only=False) for c in LOGP_COLUMNS}
    n = batch.num_rows
    out = [np.zeros((4, 5)), np.zeros((1, 5), np.int64), np.zeros((5, len(ABS_EDGES) + 1), np.int64),
           np.zeros(5, np.int64), np.empty(VE.KEEP_TOP), np.empty(VE.KEEP_TOP, np.int64), np.empty(VE.KEEP_FLAGGED),
           np.empty(VE.KEEP_FLAGGED, np.int64)]
    chunk_j = np.empty(-(-n // K.CHUNK) + 1, np.int64)
    K.token_pass(*(raw[c] for c in ("logp", "logp_old", "logp_ref", "logp_sampler")),
                 *(absent[c] for c in ("logp", "logp_old", "logp_ref", "logp_sampler")), mask, np.log(20.0), 10.0,
                 10.0, ABS_GRID, *out, np.empty(0), np.empty(0, bool), np.empty(0, np.int64), chunk_j)
    scal = out[3]
    assert scal[K.S_TOKENS] == m and chunk_j[-1] == m
    np.testing.assert_array_equal(np.sort(out[5][: scal[K.S_TOP]]), np.sort(top))
    np.testing.assert_array_equal(np.sort(out[7][: scal[K.S_WORST]]), np.sort(worst))
    pick = np.unique(np.r_[0, m - 1, top, worst, np.random.default_rng(1).choice(m, 500, replace=False)])
    at = np.empty(len(pick), np.int64)
    K.token_rows(mask, absent["logp_ref"], chunk_j, pick, at)
    np.testing.assert_array_equal(at, rows[pick])

def _same_arrays(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, k
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_numpy_merge_equals_the_pandas_merge():
    """The reducer's finish and merge (merge_arrays, numpy) give to_arrays(merge_partials(...)) exactly: sums
    in the same order, the per-sequence rows (a sequence split across batches, NaN advantages first), the
    re-selected kept tokens and the weighted draw of the others."""
    batches = [_batch(s, n=2000) for s in (7, 8, 9)]
    config = AnalysisConfig()
    parts = [VE.batch_arrays(b.slice(o, 700), config, 40, s) for s, b in enumerate(batches) for o in (0, 700, 1400)]
    for size, seed in ((30, 5), (10**6, 0)):
        want = VE.to_arrays(VE.merge_partials([VE.from_arrays(p) for p in parts], sample_size=size, seed=seed))
        _same_arrays(VE.merge_arrays(parts, sample_size=size, seed=seed), want)
    want = VE.to_arrays(VE.merge_partials([VE.from_arrays(p) for p in parts]))
    _same_arrays(VE.EstimatorReducer().merge(parts), want)
    empty = VE.batch_arrays(batches[0].slice(0, 0), config, 10, 0)
    _same_arrays(VE.merge_arrays([empty, empty]), VE.to_arrays(VE.merge_partials([VE.from_arrays(empty)] * 2)))
    _same_arrays(VE.merge_arrays([]), VE.to_arrays(VE.merge_partials([])))
