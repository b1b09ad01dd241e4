"""The report's context reducer (kldiag/analysis/context.py): its preselection keeps exactly the rows a
full sort ranks first, ties at the threshold included, and its membership test equals np.isin."""

from __future__ import annotations

import numpy as np
import pytest

from kldiag.analysis.context import _contenders, _member, _order


@pytest.mark.parametrize("keep", [1, 3, 32, 500])
def test_contenders_keep_the_fully_sorted_first_rows(keep):
    rng = np.random.default_rng(keep)
    n = 400
    t = {c: rng.integers(0, 5, n) for c in ("step", "rank", "seq", "iteration", "pos")}
    t["w"] = rng.choice([-np.inf, 0.5, 1.0, 2.0, 7.0], n)  # many ties, at the threshold too
    want = {c: v[_order(t)[:keep]] for c, v in t.items()}
    pre = _contenders(t, keep)
    got = {c: v[_order(pre)[:keep]] for c, v in pre.items()}
    for c in t:
        np.testing.assert_array_equal(got[c], want[c], err_msg=c)
    assert len(pre["w"]) < n or keep >= n


def test_member_equals_isin():
    rng = np.random.default_rng(0)
    h = rng.integers(-50, 50, 1000)
    for of in (np.array([], np.int64), np.array([7]), rng.integers(-60, 60, 40)):
        np.testing.assert_array_equal(_member(h, of), np.isin(h, of))
