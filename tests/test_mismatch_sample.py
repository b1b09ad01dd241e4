"""The shared token sample (kldiag.mismatch.sample): its merge keeps the parts' arrays as chunks (no
concatenated copy) and at most `cap` rows whatever the bound stride; TokenSets made from chunks equal those
made from one concatenated table."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from kldiag.analysis import protocol as reduce
from kldiag.analysis.runtime import part_fold
from kldiag.mismatch import sample as SS
from kldiag.mismatch import tokenset as TS


def partial(steps: np.ndarray, seed: int, stride: int = 1) -> dict:
    """A part's sample partial (SampleReducer.finish's layout): 10 rows a step, 2 sequences of 5 tokens."""
    rng = np.random.default_rng(seed)
    step = np.repeat(steps, 10)
    n = len(step)
    cols = {c: rng.integers(0, 50, n) for c in TS.INT_COLUMNS}
    cols.update(step=step, seq=np.repeat(np.arange(len(steps) * 2) + 1000 * seed, 5), pos=np.tile(np.arange(5), 2 * len(steps)),
                group=np.repeat(np.arange(len(steps)) + 100 * seed, 10), iteration=np.zeros(n, np.int64))
    cols.update({c: rng.normal(-1.0, 0.5, n).astype(np.float32) for c in TS.FLOAT_COLUMNS})
    cols.update(mask=rng.random(n) < 0.9, old_valid=rng.random(n) < 0.8, stride=np.array([stride], np.int64))
    return cols


def concat(parts: list[dict]) -> dict:
    return {c: np.concatenate([p[c] for p in parts]) for c in parts[0] if c != "stride"}


def test_merge_keeps_the_parts_arrays_without_copying_them():
    parts = [partial(np.arange(8 * i, 8 * i + 8), i) for i in range(4)]
    red = SS.SampleReducer(stride=1, cap=10_000)
    got = red.merge(parts)
    assert int(got["stride"][0]) == 1
    for c in ("step", "logp", "mask"):
        assert all(a is p[c] for a, p in zip(got[c], parts, strict=True)), c  # the same arrays: no copy
    again = red.merge([red.merge(parts[:2]), red.merge(parts[2:3]), parts[3]])  # any grouping, in order
    for c in concat(parts):
        np.testing.assert_array_equal(np.concatenate(again[c]), concat(parts)[c], err_msg=c)


@pytest.mark.parametrize("grouping", [[4], [1, 1, 1, 1], [3, 1], [1, 3]])
def test_merge_caps_the_sample_by_prompt_groups(grouping):
    """Past `cap` rows the merge keeps, at every step of the bound stride, the prompt groups whose hash is under
    the first SHARE_LADDER level that leaves at most `cap` rows; merging the parts in any grouping, in order,
    keeps the same rows, stride and level."""
    parts = [partial(np.arange(0, 64, 2) + 64 * i, i, stride=2) for i in range(4)]  # 4 x 32 steps x 10 rows
    for p in parts:  # 4 prompt groups a step (of 2 sequences x 5 tokens: 20 groups per 10 steps)
        p["group"] = np.repeat(np.arange(len(p["step"]) // 5) + 1000 * int(p["step"][0]), 5)
    red = SS.SampleReducer(stride=2, cap=300)
    merged, at = None, 0
    for size in grouping:
        merged = red.merge(([merged] if merged is not None else []) + parts[at:at + size])
        at += size
    want = concat(parts)
    u = np.repeat(*TS.group_runs(want["group"], want["seq"]))
    kept = np.array([(u < s).sum() for s in SS.SHARE_LADDER])
    level = int(np.argmax(kept <= red.cap))
    assert level > 0 and kept[level - 1] > red.cap >= kept[level]
    assert int(merged["stride"][0]) == 2 and int(merged["share_level"][0]) == level
    keep = u < SS.SHARE_LADDER[level]
    for c in want:
        np.testing.assert_array_equal(np.concatenate(merged[c]), want[c][keep], err_msg=c)
    sample = SS.Sample(merged, 2)
    assert sample.stride == 2 and len(sample) == keep.sum() and sample.share == SS.SHARE_LADDER[level]
    ts = sample.tokens(True)
    assert ts.step_stride == 2 and ts.group_share == sample.share
    assert np.all(ts.step % 2 == 0)  # the stride's steps, with fewer of their groups
    # a fit's share is of every group, so it keeps a subset of the sample's rows: about fit_tokens of them
    fit = sample.thinned(10_000, all_iterations=True, fit_tokens=100)
    assert fit.group_share == pytest.approx(sample.share * 100 / len(sample))
    u_fit = np.repeat(*TS.group_runs(fit.group, fit.seq))
    under = u_fit < fit.group_share  # the groups under the fit's share, and per step the one of smallest hash
    for s in np.unique(fit.step):
        at = fit.step == s
        assert under[at].all() or (not under[at].any() and len(np.unique(fit.group[at])) == 1)
    assert set(fit.step) == set(ts.step)  # every step of the sample keeps a group
    again = TS.fit_share(ts, 100)
    np.testing.assert_array_equal(again.pos, fit.pos)
    assert again.group_share == pytest.approx(fit.group_share)


def test_a_capped_partial_thins_the_parts_merged_after_it_even_under_the_cap():
    """A large part capped alone, then a small one merged in under the cap: the small part's rows go by the
    same share as in one merge of both (the rows kept never depend on the grouping)."""
    big, small = partial(np.arange(0, 40), 0), partial(np.arange(40, 41), 1)
    for p in (big, small):
        p["group"] = p["seq"]
    red = SS.SampleReducer(stride=1, cap=300)
    once = red.merge([big, small])
    twice = red.merge([red.merge([big]), small])
    assert int(once["share_level"][0]) == int(twice["share_level"][0]) > 0
    for c in once:
        np.testing.assert_array_equal(np.concatenate(TS.chunks(twice[c])), np.concatenate(TS.chunks(once[c])),
                                      err_msg=c)


def test_capped_sample_stays_near_the_cap_whatever_the_runs_length():
    """The merged sample of a run 1x, 3x and 10x as long holds cap * 2^(-1/8) .. cap rows (the stride's
    doubling left it anywhere in (cap / 2, cap])."""
    for n_parts in (4, 12, 40):
        parts = [partial(np.arange(0, 40) + 40 * i, i) for i in range(n_parts)]
        for p in parts:
            p["group"] = p["seq"]  # a prompt group a sequence: many groups
        merged = SS.SampleReducer(stride=1, cap=1000).merge(parts)
        n = len(np.concatenate(merged["step"]))
        assert 1000 * 2 ** (-1 / 8) * 0.9 < n <= 1000, (n_parts, n)


def test_sample_of_chunks_equals_sample_of_one_table(tmp_path):
    """TokenSets and thinned sets made from a merged sample's chunks equal those made from the concatenated
    columns, and from the cache file the chunks are written to (one after the other, never concatenated)."""
    parts = [partial(np.arange(10 * i, 10 * i + 10), i) for i in range(3)]
    parts[1]["iteration"][::3] = 1  # reuse iterations: first iterations found across chunks
    merged = SS.SampleReducer(stride=1, cap=10_000).merge(parts)
    path = tmp_path / "sample.part"
    assert reduce.save_arrays(path, merged)
    loaded = reduce.load_arrays(path)
    flat = SS.Sample(concat(parts), 1)
    for other in (SS.Sample(merged, 1), SS.Sample(loaded, 1)):
        for all_iterations in (False, True):
            for got, want in ((other.tokens(all_iterations), flat.tokens(all_iterations)),
                              (other.thinned(120, all_iterations), flat.thinned(120, all_iterations)),
                              (other.thinned(1000, all_iterations, 60), flat.thinned(1000, all_iterations, 60))):
                assert len(got) == len(want) and got.step_stride == want.step_stride
                for f in ("step", "seq", "group", "pos", "logp", "logp_old", "logp_sampler", "mask", "has_old"):
                    np.testing.assert_array_equal(getattr(got, f), getattr(want, f), err_msg=f)
                    assert getattr(got, f).dtype == getattr(want, f).dtype
    for c in ("logp_sampler", "entropy"):
        assert SS.Sample(merged, 1).has_values(c) == flat.has_values(c)


def test_sample_reducer_finish_then_merge_round_trip(tmp_path):
    """finish() gives a chunk per batch of each column (no concatenated copy) and the bound stride; merge() of
    finished parts caps them, and the cache file holds the chunks as one array."""
    step = np.repeat(np.arange(0, 40), 10)
    batch = TS._fill(pa.record_batch({"step": pa.array(step), "seq": pa.array(np.arange(len(step)))}))
    red = SS.SampleReducer(stride=4, cap=50)
    state: list = []
    red.add(state, batch.slice(0, 200))
    red.add(state, batch.slice(200))
    one = red.finish(state, 0)
    assert [len(c) for c in one["step"]] == [50, 50] and int(one["stride"][0]) == 4
    assert reduce.save_arrays(tmp_path / "p", one)
    loaded = reduce.load_arrays(tmp_path / "p")
    for c in one:
        np.testing.assert_array_equal(loaded[c], np.concatenate(TS.chunks(one[c])), err_msg=c)
    merged = red.merge([one])
    n = TS.rows(merged)
    assert int(merged["stride"][0]) == 4 and int(merged["share_level"][0]) > 0 and 30 < n <= 50


@pytest.mark.parametrize("order, stride", [("steps", 4), ("one step", 64), ("shuffled", 4), ("step a row", 2)])
def test_add_takes_the_kept_steps_as_slices_and_equals_arrows_filter(order, stride):
    """SampleReducer.add keeps the same rows, as the same arrays, whether they come in runs of whole steps
    (slices: the recorder's step order; copied, so that no view holds the whole batch) or scattered (Arrow's
    filter), with nulls in the columns."""
    rng = np.random.default_rng(4)
    n = 6000
    step = np.repeat(np.arange(60), n // 60) if order != "step a row" else np.arange(n)  # more runs than RUNS
    if order == "shuffled":
        step = rng.permutation(step)
    cols = {c: pa.array(rng.integers(0, 50, n), mask=rng.random(n) < 0.05) for c in TS.INT_COLUMNS}
    cols["step"] = pa.array(step)
    cols.update({c: pa.array(rng.normal(-1.0, 0.5, n).astype(np.float32), mask=rng.random(n) < 0.05)
                 for c in TS.FLOAT_COLUMNS})
    cols["mask"] = pa.array(rng.random(n) < 0.9, mask=rng.random(n) < 0.05)
    batch = pa.RecordBatch.from_pydict({c: cols[c] for c in TS.COLUMNS})
    keep = SS._keep_every(step, stride)
    assert isinstance(TS.kept_runs(keep), list if order in ("steps", "one step") else np.ndarray)
    red = SS.SampleReducer(stride=stride)
    state: list = []
    red.add(state, batch)
    want = TS.columns_of(batch.filter(pa.array(keep)))
    assert list(state[0]) == list(want)
    for c in want:
        assert state[0][c].dtype == want[c].dtype, c
        np.testing.assert_array_equal(state[0][c], want[c], err_msg=c)
        assert state[0][c].base is None or order in ("shuffled", "step a row"), c  # a copy: no batch buffer held
    empty: list = []
    red.add(empty, batch.filter(pa.array(~keep)))  # no kept step: nothing appended
    assert empty == []


@pytest.mark.parametrize("step, every", [(np.repeat(np.arange(10), 7), 4), (np.arange(3000) // 2, 2),
                                         (np.array([3, 3, 1, 8, 8, 0, 0, 5]), 1), (np.zeros(0, np.int64), 2),
                                         (np.array([4, 4, 2, 2, 6, 8, 1]), 2)])
def test_kept_step_runs_are_the_runs_of_the_kept_rows(step, every):
    """kept_step_runs gives the (start, end) runs of rows whose step % every == 0, adjacent ones joined, and
    -1 when they do not fit its buffer (then add() masks the batch, as the shuffled case above)."""
    keep = step % every == 0
    edge = np.flatnonzero(np.diff(np.r_[0, keep.astype(np.int8), 0]))
    want = edge.reshape(-1, 2)
    out = np.empty(2 * SS.RUNS, np.int64)
    k = SS.kept_step_runs(step.astype(np.int64), every, out)
    if len(want) > SS.RUNS:
        assert k == -1
    else:
        np.testing.assert_array_equal(out[:2 * k].reshape(-1, 2), want)


def test_a_capped_samples_share_reaches_the_crosswalk_and_the_caption(tmp_path):
    """Below a share of 1 the crosswalk says which share of the groups its per-step figures read, and the
    Mismatch page's caption says it too."""
    from types import SimpleNamespace

    from kldiag.crosswalk import crosswalk
    from kldiag.format import open_run
    from kldiag.tools.synth import SynthConfig, make_run
    from kldiag.views import mismatch as VM

    make_run(tmp_path / "run", SynthConfig(steps=6, seqs_per_step=16))
    run = open_run(tmp_path / "run")
    red = SS.SampleReducer(stride=1, cap=10_000_000)
    whole = red.merge([part_fold.compute_part(p, [red], 1 << 16)[red.name] for p in run.parts()])
    capped = SS.SampleReducer(stride=1, cap=rows_of(whole) // 2).merge([whole])
    sample = SS.Sample(capped, 1)
    assert sample.share < 1 and len(sample) <= rows_of(whole) // 2
    meta = crosswalk(run, "verl", sample=sample).schema.metadata
    assert float(meta[b"kldiag.group_share"]) == sample.share and meta[b"kldiag.step_stride"] == b"1"
    caption = VM.sample_caption(SimpleNamespace(step_stride=1, group_share=sample.share))
    assert f"every step and {sample.share:.0%} of each step's prompt groups" in caption


def rows_of(cols: dict) -> int:
    return TS.rows(cols)


@pytest.mark.parametrize("seed", range(4))
def test_kept_step_runs_gallop_over_ordered_steps(seed):
    """On a step-ordered batch (runs of every length, 1 to thousands of rows) the galloping search finds the
    same runs as a row-by-row scan; one step out of order anywhere makes it scan."""
    rng = np.random.default_rng(seed)
    step = np.repeat(np.arange(40), rng.integers(1, 3000, 40)).astype(np.int64)
    cases = [step, step[::-1].copy()]
    cases[1][:len(step) // 2] = np.sort(cases[1][:len(step) // 2])  # unordered
    for s in cases:
        keep = SS._keep_every(s, 4)
        want = np.flatnonzero(np.diff(np.r_[0, keep.astype(np.int8), 0])).reshape(-1, 2)
        out = np.empty(2 * SS.RUNS, np.int64)
        k = SS.kept_step_runs(s, 4, out)
        np.testing.assert_array_equal(out[:2 * k].reshape(-1, 2), want)


def test_kept_columns_of_a_batch_without_nulls_are_its_own_arrays():
    """Runs of a batch whose columns hold no null: the same arrays as Arrow's filter, each one fresh array
    (no view of the batch's buffers keeps every row alive)."""
    rng = np.random.default_rng(5)
    n = 5000
    cols = {c: pa.array(rng.integers(0, 50, n)) for c in TS.INT_COLUMNS}
    cols["step"] = pa.array(np.repeat(np.arange(50), n // 50))
    cols.update({c: pa.array(rng.normal(-1.0, 0.5, n).astype(np.float32)) for c in TS.FLOAT_COLUMNS})
    cols["mask"] = pa.array(rng.random(n) < 0.9)
    batch = pa.RecordBatch.from_pydict({c: cols[c] for c in TS.COLUMNS}).slice(3)
    for runs in ([(10, 400)], [(0, 97), (497, 597), (4000, 4997)]):
        got = SS.kept_columns(batch, runs)
        keep = np.zeros(batch.num_rows, bool)
        for a, b in runs:
            keep[a:b] = True
        want = TS.columns_of(batch.filter(pa.array(keep)))
        assert list(got) == list(want)
        for c in want:
            assert got[c].dtype == want[c].dtype and got[c].base is None, c
            np.testing.assert_array_equal(got[c], want[c], err_msg=c)


@pytest.mark.parametrize("j", [0, 1, 2, 4])
def test_rows_of_a_merge_are_the_merge_of_those_parts(tmp_path, j):
    """slice_rows(merge(parts), rows of parts[:j]) merged with the parts after j, and the merge of the slices of
    each part, equal the merge of every part bit for bit, from the merge or from its cache file (one array a
    column); a capped merge cannot be cut (None)."""
    parts = [partial(np.arange(8 * i, 8 * i + 8), i) for i in range(4)]
    red = SS.SampleReducer(stride=1, cap=10_000)
    assert reduce.save_arrays(tmp_path / "state", red.merge(parts))
    ends = np.cumsum([0, *(red.length(p) for p in parts)])
    want = red.merge(parts)
    for merged in (red.merge(parts), reduce.load_arrays(tmp_path / "state")):
        head = red.slice_rows(merged, 0, ends[j])
        assert TS.rows(head) == ends[j]
        each = [red.slice_rows(merged, ends[m], ends[m + 1]) for m in range(j, 4)]
        for got in (red.merge([head, *parts[j:]]), red.merge([head, *each])):
            assert set(got) == set(want)
            for c in want:
                np.testing.assert_array_equal(np.concatenate(TS.chunks(got[c])), np.concatenate(TS.chunks(want[c])))
    assert red.slice_rows(merged, 0, ends[-1] + 1) is None  # more rows than it holds
    capped = SS.SampleReducer(stride=1, cap=100).merge(parts)
    assert int(capped["share_level"][0]) > 0 and SS.SampleReducer(stride=1, cap=100).slice_rows(capped, 0, 0) is None
