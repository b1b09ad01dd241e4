"""Exact equality of two Analysis results (NaN equal to NaN): shared by the engine tests."""

from __future__ import annotations

import numpy as np

TABLES = ("steps", "sequences", "flags", "alerts", "steps_by_rank", "trainer_kl", "superseded")


def assert_same_analysis(a, b) -> None:
    """Every table, histogram, skipped part and count of `a` equals `b`'s, bit for bit."""
    for name in TABLES:
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is None:
            continue
        assert x.schema.equals(y.schema), name
        assert x.num_rows == y.num_rows, name
        for col in x.column_names:
            u, v = x.column(col).to_numpy(zero_copy_only=False), y.column(col).to_numpy(zero_copy_only=False)
            if u.dtype.kind == "f":
                np.testing.assert_array_equal(u, v, err_msg=f"{name}.{col}")  # NaN == NaN here
            else:
                assert list(u) == list(v), f"{name}.{col}"
    np.testing.assert_array_equal(a.histograms.steps, b.histograms.steps)
    for k, v in b.histograms.counts.items():
        np.testing.assert_array_equal(a.histograms.counts[k], v, err_msg=k)
    for f in ("step", "sequences", "known", "masked"):  # the off-policy mask at every delta of the grid
        np.testing.assert_array_equal(getattr(a.opsm, f), getattr(b.opsm, f), err_msg=f"opsm.{f}")
    assert a.skipped == b.skipped and a.files == b.files
    assert a.info["rows"] == b.info["rows"]
