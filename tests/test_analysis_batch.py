"""Batch's integer columns read at a few rows (kldiag/analysis/core/batch.py: int_view, at, null_at) against pyarrow's
take: Arrow slices (offsets into the validity bits), nulls, a column of nulls only, another integer width."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from kldiag.analysis.core.batch import Batch


def _batch(rng: np.random.Generator, n: int) -> pa.RecordBatch:
    def col(typ, rate):
        return pa.array([None if rng.random() < rate else int(v) for v in rng.integers(-100, 100, n)], typ)

    return pa.record_batch({
        "step": pa.array(np.zeros(n, np.int64)), "seq": pa.array(np.zeros(n, np.int64)),
        "mask": pa.array(np.ones(n, bool)), **{c: pa.array(np.zeros(n, np.float32)) for c in
                                               ("logp", "logp_old", "logp_ref", "logp_sampler", "advantage")},
        "pos": col(pa.int32(), 0.0), "token_id": col(pa.int32(), 0.3), "iteration": col(pa.int16(), 0.1),
        "group": col(pa.int64(), 1.0), "micro": col(pa.int8(), 0.5)})


def test_at_and_null_at_equal_pyarrows_take_on_slices():
    rng = np.random.default_rng(3)
    whole = _batch(rng, 300)
    for lo, n in ((0, 300), (3, 50), (13, 1), (77, 200), (299, 1), (5, 0)):
        b = Batch.from_arrow(whole.slice(lo, n))
        rows = rng.integers(0, max(n, 1), 40) if n else np.zeros(0, np.int64)
        for name in ("pos", "token_id", "iteration", "group", "micro"):
            taken = b.arrow.column(name).take(pa.array(rows, pa.int64()))
            want = taken.fill_null(-7).to_numpy(zero_copy_only=False).astype(np.int64)
            got = b.at(name, rows, -7)
            assert got.dtype == np.int64
            np.testing.assert_array_equal(got, want)
            np.testing.assert_array_equal(b.null_at(name, rows), np.asarray(taken.is_null()))
