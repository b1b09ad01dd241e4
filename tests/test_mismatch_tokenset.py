"""TokenSets (kldiag.mismatch.tokenset): dense_inverse equals np.unique's inverse, and the bounded fit sample
keeps whole prompt groups at every step and finds what the whole sample finds."""

from __future__ import annotations

import numpy as np
import pytest
from test_diagnosis_parity import engine_table

from kldiag.mismatch import parity as P
from kldiag.mismatch import tokenset as TS


def test_dense_inverse_is_np_unique_inverse():
    rng = np.random.default_rng(1)
    for key in (rng.integers(0, 300, 5000), rng.integers(-40, 40, 100), rng.integers(0, 1 << 40, 50),
                np.zeros(0, np.int64), np.array([7])):
        want = np.unique(key, return_inverse=True)[1].reshape(-1)
        np.testing.assert_array_equal(TS.dense_inverse(key), want)


def test_keep_groups_keeps_whole_groups_at_every_step():
    ts = TS.from_table(engine_table(steps=6, groups=40, group_size=4, length=5))
    keep = TS.keep_groups(ts.group, ts.seq, 0.25)
    g = ts.group % 100  # engine_table's group ids are step * 100 + g: the same prompt g at every step
    assert 0.1 < keep.mean() < 0.4
    for gid in np.unique(ts.group):  # a group is kept whole or not at all
        assert len(set(keep[ts.group == gid])) == 1
    np.testing.assert_array_equal(keep, TS.keep_groups(ts.group, ts.seq, 0.25))  # the same choice every call
    assert set(ts.step[keep]) == set(ts.step)
    no_group = TS.keep_groups(np.full(len(ts), -1), ts.seq, 0.5)  # a sequence without a group is its own
    for s in np.unique(ts.seq):
        assert len(set(no_group[ts.seq == s])) == 1
    assert len(np.unique(g[keep])) < len(np.unique(g))
    cut = TS.fit_share(ts, len(ts) // 4)
    assert len(cut) < len(ts) and set(cut.step) == set(ts.step) and TS.fit_share(ts, 0) is ts


def test_keep_groups_with_steps_keeps_a_group_at_every_step():
    """Two groups a step at a share of 0.05: by the hash alone most steps lose both; with the steps every step
    keeps its group of the smaller hash, and the groups under the share stay."""
    ts = TS.from_table(engine_table(steps=40, groups=2, group_size=4, length=5))
    plain = TS.keep_groups(ts.group, ts.seq, 0.05)
    keep = TS.keep_groups(ts.group, ts.seq, 0.05, ts.step)
    assert len(set(ts.step[plain])) < 40 and set(ts.step[keep]) == set(ts.step)
    assert (keep | ~plain).all()  # a superset of the plain choice
    u = np.repeat(*TS.group_runs(ts.group, ts.seq))
    for s in range(40):
        at = ts.step == s
        assert set(ts.group[at & keep]) >= {ts.group[at][np.argmin(u[at])]}


def test_bounded_fit_finds_the_temperature_of_the_whole_sample():
    """The fit on a quarter of the prompt groups finds the engine's temperature as the fit on all of them."""
    ts = TS.from_table(engine_table(1.3, steps=6, groups=24, group_size=8, length=5))
    whole = P.check(ts)
    part = P.check(TS.fit_share(ts, len(ts) // 4))
    assert whole.temperature and part.temperature
    assert part.fit.tokens < len(ts) // 2
    assert part.fit.implied_temperature == pytest.approx(1.3, abs=0.02)
    assert part.fit.implied_temperature == pytest.approx(whole.fit.implied_temperature, abs=0.02)


def test_lazy_sets_equal_eager_ones_and_gather_only_what_is_read():
    """from_columns(lazy=True) (the token sample's sets): array for array the eager set, with reuse iterations,
    rows out of order, chunks and keep masks; an array is copied only when read."""
    import pickle
    from dataclasses import fields

    t = engine_table(steps=4, groups=6, group_size=2, length=5)
    cols = TS.columns_of(t)
    rng = np.random.default_rng(0)
    order = rng.permutation(len(t))
    again = {c: v[order] for c, v in cols.items()}  # the rows again, shuffled, as a second reuse iteration
    again["iteration"] = again["iteration"] + 1
    chunked = {c: [cols[c], again[c]] for c in cols}
    for all_iterations in (False, True):
        for keep in (None, [rng.random(len(t)) < 0.7, np.ones(len(t), bool)]):
            lazy = TS.from_columns(chunked, all_iterations, 2, keep, lazy=True)
            eager = TS.from_columns(chunked, all_iterations, 2, keep)
            assert type(eager) is TS.TokenSet and "token_id" not in lazy.__dict__
            assert lazy.has_sampler and "mask" in lazy.__dict__ and "token_id" not in lazy.__dict__
            for f in fields(TS.TokenSet):
                a, b = getattr(lazy, f.name), getattr(eager, f.name)
                if isinstance(b, np.ndarray):
                    assert a.dtype == b.dtype, f.name
                    np.testing.assert_array_equal(a, b, err_msg=f.name)
                else:
                    assert a == b, f.name
            assert len(lazy.take(np.arange(3))) == 3
            plain = pickle.loads(pickle.dumps(lazy))  # as the eager set: its arrays gathered
            assert type(plain) is TS.TokenSet and np.array_equal(plain.token_id, eager.token_id)


def test_sorted_check_in_blocks_sees_a_pair_across_a_block_edge(monkeypatch):
    """_sorted checks (step, seq, pos) order block by block: a pair out of order anywhere, the pair straddling
    two blocks included, makes it false; ties in pos within a sequence are out of order (pos strictly grows)."""
    monkeypatch.setattr(TS, "SORT_BLOCK", 8)
    n = 64
    step, seq, pos = np.repeat(np.arange(4), 16), np.repeat(np.arange(8), 8), np.tile(np.arange(8), 8)
    assert TS._sorted(step, seq, pos)
    assert TS._sorted(step[:1], seq[:1], pos[:1]) and TS._sorted(step[:0], seq[:0], pos[:0])
    for i in range(1, n):  # swap rows i - 1 and i: out of order whatever block edge lies between them
        order = np.arange(n)
        order[[i - 1, i]] = order[[i, i - 1]]
        assert not TS._sorted(step[order], seq[order], pos[order]), i
    tie = pos.copy()
    tie[8] = tie[9]  # sequence 1's first two tokens both at position 1
    assert not TS._sorted(step, seq, tie)
