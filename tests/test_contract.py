"""The parity-contract partial (kldiag.analysis.reducers.contract.batch_partial, its compiled pass
kernels/contract.py) against a straightforward numpy reference, on batches with nulls, NaN, inf, columns absent or
all null, rows out of sequence order, many steps and sliced Arrow buffers; and base.raw, which reads them."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from kldiag.analysis.reducers import contract as K
from kldiag.analysis.reducers.base import raw


def _get(batch, name, fill, dtype):
    """(values with nulls filled, valid) as the reference reads a column (pyarrow's own conversions)."""
    n = batch.num_rows
    if name not in batch.schema.names:
        return np.full(n, fill, dtype), np.zeros(n, bool)
    col = batch.column(name)
    valid = col.is_valid().to_numpy(zero_copy_only=False)
    return col.fill_null(fill).to_numpy(zero_copy_only=False).astype(dtype), valid


def reference(batch, tol):
    """The partial from its definition (module docstring of reducers/contract.py), in numpy."""
    step, it, micro, seq, pos = (_get(batch, k, 0, np.int64)[0] for k in ("step", "iteration", "micro", "seq", "pos"))
    mask = _get(batch, "mask", False, bool)[0]
    (logp, ok_s), (old, ok_o), (mu, ok_m) = (_get(batch, k, np.nan, np.float64)
                                             for k in ("logp", "logp_old", "logp_sampler"))
    version, ok_v = _get(batch, "policy_version", -1, np.int64)
    first = it == 0
    b = np.where(ok_o, old, np.where(first & ok_s, logp, np.nan))
    base = mask & np.isfinite(b)
    sel1 = base & first & (micro == 0) & ok_o & ok_s & np.isfinite(logp)
    checks = [(base & ok_m & np.isfinite(mu), mu), (sel1, logp), (sel1 & ok_v & (version == step), logp)]
    r, f = {k: [] for k in ("check", "step", "n_tokens", "n_off", "max_abs", "sum_abs")}, {
        k: [] for k in ("check", "step", "seq", "min_pos")}
    for c, (sel, a) in enumerate(checks):
        with np.errstate(invalid="ignore"):  # inf - inf: NaN, not compared
            d = np.abs(a - b)
        for s in np.unique(step[sel]):
            at = sel & (step == s)
            off = at & (d > tol)
            for k, v in zip(r, (c, s, at.sum(), off.sum(), d[at].max(), d[at].sum()), strict=True):
                r[k].append(v)
            if off.any():
                low = seq[off].min()
                for k, v in zip(f, (c, s, low, pos[off & (seq == low)].min()), strict=True):
                    f[k].append(v)
    out = {f"r_{k}": np.asarray(v, np.float64 if k in ("max_abs", "sum_abs") else np.int64) for k, v in r.items()}
    out.update({f"f_{k}": np.asarray(v, np.int64) for k, v in f.items()})
    return out


def assert_same(got, want):
    if got is None:
        assert not len(want["r_step"])
        return
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k].dtype == v.dtype, k
        if k == "r_sum_abs":  # the pass adds in vector lanes (fastmath reassoc): to rounding of the sum's terms
            np.testing.assert_allclose(got[k], v, rtol=1e-12, atol=0)
        else:
            np.testing.assert_array_equal(got[k], v, err_msg=k)


def _noisy(rng, x, share):
    x = x.copy()
    x[rng.random(len(x)) < share] = np.nan
    x[rng.random(len(x)) < share / 2] = np.inf
    return x


def make_batch(n=7000, seed=0, nulls=True, steps=(3, 4, 9), far=False):
    """Steps in runs (the second one longer than a block), sequences of 40 rows, some out of order; log-probs one
    ulp or more apart; NaN, inf and (with nulls) nulls in every optional column."""
    rng = np.random.default_rng(seed)
    step = np.repeat(np.asarray(steps, np.int64), [n // 4, n // 2, n - n // 4 - n // 2])
    if far:
        step[-10:] = 1 << 20  # a step range beyond the offset's: the sorted-unique path
    seq = np.arange(n) // 40
    seq[rng.random(n) < 0.02] = rng.integers(0, n // 40, 1)[0]
    logp = rng.normal(-1, 0.5, n).astype(np.float32)
    old = np.where(rng.random(n) < 0.6, logp, np.nextafter(logp, np.float32(0)))
    mu = np.where(rng.random(n) < 0.5, old, old + rng.normal(0, 1e-3, n).astype(np.float32))
    cols = {"step": step, "iteration": rng.integers(0, 2, n).astype(np.int16),
            "micro": rng.integers(0, 2, n).astype(np.int32), "seq": seq, "pos": (np.arange(n) % 40).astype(np.int32),
            "mask": rng.random(n) < 0.9, "logp": _noisy(rng, logp, 0.01), "logp_old": _noisy(rng, old, 0.01),
            "logp_sampler": _noisy(rng, mu, 0.01), "policy_version": step - rng.integers(0, 2, n)}
    arrays = {k: pa.array(v, mask=(rng.random(n) < 0.05) if nulls and k in ("logp", "logp_old", "logp_sampler",
                                                                               "policy_version", "mask", "micro")
                          else None) for k, v in cols.items()}
    return pa.RecordBatch.from_pydict(arrays)


def _variants(b):
    yield b
    yield b.slice(5, b.num_rows - 13)  # Arrow offsets inside the buffers and bitmaps
    for drop in ("logp_sampler", "logp_old", "policy_version", "logp", "iteration"):
        yield b.drop_columns([drop])
    for name in ("logp_old", "logp_sampler"):  # all null: as absent
        yield b.set_column(b.schema.get_field_index(name), name, pa.nulls(b.num_rows, pa.float32()))
    yield b.drop_columns(["logp_old", "logp_sampler"])


@pytest.mark.parametrize("tol", [0.0, 1e-4])
@pytest.mark.parametrize("kw", [dict(), dict(nulls=False), dict(far=True, seed=1), dict(steps=(5, 5, 5), seed=2)])
def test_partial_equals_numpy_reference(kw, tol):
    for b in _variants(make_batch(**kw)):
        assert_same(K.batch_partial(b, tol), reference(b, tol))


def test_small_batches_and_one_row():
    b = make_batch(n=64, seed=3)
    for i in range(0, 64, 7):
        part = b.slice(i, 1 + i % 5)
        assert_same(K.batch_partial(part, 0.0), reference(part, 0.0))


def test_raw_reads_buffers_with_offsets_and_validity():
    arr = pa.array([1.5, None, 3.0, 4.0, None, 6.0], pa.float32())
    b = pa.RecordBatch.from_pydict({"x": arr, "m": pa.array([True, False, None, True, True, False]),
                                    "e": pa.nulls(6, pa.int64()), "h": pa.array([1, 2, 3, 4, 5, 6], pa.float16())})
    s = b.slice(1, 4)
    values, valid = raw(s, "x")
    np.testing.assert_array_equal(valid, [False, True, True, False])
    np.testing.assert_array_equal(values[valid], [3.0, 4.0])
    m, ok = raw(s, "m")
    assert m.dtype == bool and list(m[ok]) == [False, True, True] and list(ok) == [True, False, True, True]
    assert raw(s, "e") == (None, None) and raw(s, "absent") == (None, None)
    h, ok = raw(s, "h")  # not a kernel dtype: float64
    assert h.dtype == np.float64 and ok is None and list(h) == [2, 3, 4, 5]
    assert raw(b, "x")[1] is not None and raw(b.slice(2, 2), "x")[1] is None  # no null in the slice


def test_first_token_off_found_across_blocks_of_one_step():
    """One sequence over many blocks, positions descending: its lowest position off is in the last block."""
    n = 5000
    logp = np.full(n, -1.0, np.float32)
    mu = logp.copy()
    mu[[3, 2500, 4990]] = -1.5
    b = pa.RecordBatch.from_pydict({"step": np.zeros(n, np.int64), "iteration": np.zeros(n, np.int16),
                                    "micro": np.zeros(n, np.int32), "seq": np.full(n, 7),
                                    "pos": np.arange(n, 0, -1).astype(np.int32), "mask": np.ones(n, bool),
                                    "logp": logp, "logp_old": logp, "logp_sampler": mu})
    got = K.batch_partial(b, 0.0)
    assert_same(got, reference(b, 0.0))
    assert list(got["f_check"]) == [0] and list(got["f_min_pos"]) == [n - 4990] and got["r_n_off"][0] == 3
