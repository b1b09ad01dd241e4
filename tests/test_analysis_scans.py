"""The row scans around the kernel (kldiag/analysis/kernels/scans.py): top_candidates gives the rows np.flatnonzero
gives of the plain-numpy candidate mask it replaced, with words of 8 rows with and without hits, at a batch's
edges and on lengths that are not a multiple of 8."""

from __future__ import annotations

import numpy as np

from kldiag.analysis.kernels import scans


def _reference(s, r, mask, d_hi, d_lo):
    with np.errstate(invalid="ignore"):
        d = r.astype(np.float64) - s.astype(np.float64)
        return np.flatnonzero(mask & ((d >= d_hi) | (d <= d_lo)))


def test_top_candidates_equal_the_numpy_mask():
    rng = np.random.default_rng(5)
    for n in (0, 1, 7, 8, 9, 63, 64, 65, 2000, 4099):
        s = rng.normal(-1, 0.3, n).astype(np.float32)
        r = (s + rng.normal(0, 0.05, n)).astype(np.float32)
        r[rng.random(n) < 0.01] = np.nan
        s[rng.random(n) < 0.01] = -np.inf
        hits = rng.integers(0, max(n, 1), 4)
        r[hits[hits < n]] += 3.0
        if n:
            r[[0, n - 1]] += 3.0  # the first and last rows
        r[64:1024] = s[64:1024]  # words with no hit at all
        mask = rng.random(n) < 0.9
        for d_hi, d_lo in ((0.1, -0.1), (2.0, -np.inf), (np.inf, -np.inf), (-np.inf, -np.inf)):
            got = scans.top_candidates(s, r, mask, d_hi, d_lo)
            assert got.dtype == np.int64
            np.testing.assert_array_equal(got, _reference(s, r, mask, d_hi, d_lo))
