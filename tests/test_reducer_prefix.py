"""The reducers' merged-prefix cache (kldiag/analysis/cache/side_prefix.py): a run read with the dashboard's
reducers as it grows, part by part, gives every reducer's merged partial equal bit for bit to a cold
merge of every part, while a warm read loads one cache file per reducer and the partials after the prefix."""

from __future__ import annotations

import dataclasses
import mmap
import os
import pickle
import warnings
from pathlib import Path

import numpy as np
import test_analysis_prefix
from test_analysis_prefix import publish, split_run

from kldiag.analysis import AnalysisConfig, analyze
from kldiag.analysis import protocol as reduce
from kldiag.analysis.cache import side_prefix as reducer_prefix
from kldiag.analysis.runtime import runner
from kldiag.format import open_run
from kldiag.mismatch.sample import SAMPLE_CAP, SampleReducer
from kldiag.tools.synth import SynthConfig, make_run
from kldiag.views import dashboard as VD

NOCACHE = AnalysisConfig(use_cache=False)
source = test_analysis_prefix.source  # the same synthetic run (a module-scoped fixture)


def small_chunks() -> list:
    """The dashboard's reducers, each merging every 3 partials: the state then holds acc and a buffer."""
    out = []
    for r in VD.reducers():
        every = getattr(r, "merge_every", runner.MERGE_EVERY)
        out.append(dataclasses.replace(r, merge_every=3) if every and hasattr(r, "merge_every") else r)
    return out


def flat(v) -> np.ndarray:
    """A merged column: an array, or a chunk list (the token sample's merge appends the parts' arrays)."""
    return np.concatenate(v) if isinstance(v, list) else np.asarray(v)


def assert_same(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for name in a:
        assert set(a[name]) == set(b[name]), name
        for col in a[name]:
            x, y = flat(a[name][col]), flat(b[name][col])
            assert x.dtype == y.dtype and x.shape == y.shape, (name, col)
            assert np.array_equal(x, y, equal_nan=x.dtype.kind == "f"), (name, col)


def counting(monkeypatch) -> list[Path]:
    loads: list[Path] = []
    real = reduce.load_arrays
    monkeypatch.setattr(reduce, "load_arrays", lambda path, **kw: loads.append(Path(path)) or real(path, **kw))
    return loads


def test_growing_run_equals_cold_merge(source, tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "MERGE_EVERY", 3)
    monkeypatch.setattr(reducer_prefix, "PREFIX_TAIL", 2)  # rewrite the states often
    loads = counting(monkeypatch)
    run = tmp_path / "run"
    staged = split_run(source, run, rows=110)
    assert len(staged) >= 8
    reducers = small_chunks()
    used = 0
    for n, item in enumerate(staged, 1):
        publish(run, item)
        parts = open_run(run).parts()
        states = {r.name: reducer_prefix.load(open_run(run).cache_dir(), parts, runner.bound(r, parts))
                  for r in reducers}
        loads.clear()
        grown = analyze(run, AnalysisConfig(), reducers)
        tail = {r.name: [p for p in loads if p.parent.name == r.name] for r in reducers}
        assert_same(grown.reduced, analyze(run, NOCACHE, reducers).reduced)
        for name, state in states.items():
            if state is not None:  # a prefix: only the parts after it are loaded
                used += 1
                assert len(tail[name]) == n - state.k - 1, name  # the new part has none yet: not even tried
    assert used > len(staged) * len(reducers) // 2
    loads.clear()
    again = analyze(run, AnalysisConfig(), reducers)  # the listing the last states were written for
    assert_same(again.reduced, grown.reduced)
    folders = {p.parent.name for p in loads}
    assert not folders & {r.name for r in reducers}  # no per-part partial of any reducer
    assert len([p for p in loads if p.parent.name == reducer_prefix.FOLDER]) == len(reducers)
    # the result file, or the state of a reducer whose merge is a concatenation (the token sample): its result
    assert sorted(p.suffix for p in loads if p.parent.name == reducer_prefix.FOLDER) == \
        [".result"] * (len(reducers) - 1) + [".state"]


def test_warm_read_opens_a_file_per_reducer(source, tmp_path, monkeypatch):
    run = tmp_path / "run"
    for item in split_run(source, run, rows=70):
        publish(run, item)
    cold = analyze(run, AnalysisConfig(), VD.reducers())
    loads = counting(monkeypatch)
    warm = analyze(run, AnalysisConfig(), VD.reducers())
    assert warm.files_new == 0
    assert_same(warm.reduced, cold.reduced)
    assert len([p for p in loads if p.parent.name == reducer_prefix.FOLDER]) == len(VD.reducers())
    assert not {p.parent.name for p in loads} & {r.name for r in VD.reducers()}
    bare = analyze(run, AnalysisConfig())
    loads.clear()  # runner.reduced of a reducer the analysis did not read along: from its state too
    assert_same({"e": runner.reduced(bare, VD.estimator_reducer())}, {"e": cold.reduced["estimators"]})
    assert loads == []  # the file read above, remembered while it stays the same
    reducer_prefix._memo.clear()
    assert_same({"e": runner.reduced(bare, VD.estimator_reducer())}, {"e": cold.reduced["estimators"]})
    assert [p.suffix for p in loads] == [".result"]


def mapped(v) -> bool:
    while isinstance(v, np.ndarray):
        v = v.base
    return isinstance(v.obj if isinstance(v, memoryview) else v, mmap.mmap)


def test_mapped_state_files_equal_read_ones(source, tmp_path, monkeypatch):
    """reducer_prefix reads its files memory-mapped (reduce.MMAP_BYTES and up): the same arrays, and a
    state rewritten by a later read (a new file renamed over it) leaves the mapped one intact."""
    monkeypatch.setattr(reduce, "MMAP_BYTES", 1)
    monkeypatch.setattr(reducer_prefix, "PREFIX_TAIL", 1)  # the next read rewrites every state
    run = tmp_path / "run"
    staged = split_run(source, run, rows=70)
    for item in staged[:-1]:
        publish(run, item)
    cold = analyze(run, AnalysisConfig(), VD.reducers())
    reducer_prefix._memo.clear()
    warm = analyze(run, AnalysisConfig(), VD.reducers())
    assert_same(warm.reduced, cold.reduced)
    held = {n: dict(warm.reduced[n]) for n in warm.reduced}  # views of the mapped files
    assert any(mapped(v) for arrays in held.values() for v in arrays.values())
    files = {p: p.stat().st_ino for p in (run / ".kldiag" / reducer_prefix.FOLDER).glob("*.state")}
    publish(run, staged[-1])
    analyze(run, AnalysisConfig(), VD.reducers())
    assert all(not p.exists() or p.stat().st_ino != ino for p, ino in files.items())  # replaced
    assert_same(held, cold.reduced)


def test_corrupt_part_is_never_inside_a_state(source, tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "MERGE_EVERY", 3)
    monkeypatch.setattr(reducer_prefix, "PREFIX_TAIL", 1)
    run = tmp_path / "run"
    staged = split_run(source, run, rows=70)
    reducers = small_chunks()
    for item in staged[:6]:
        publish(run, item)
    parts = open_run(run).parts()
    Path(parts[3].path).write_bytes(b"not parquet")  # unreadable (its key changes with its size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = analyze(run, AnalysisConfig(), reducers)
        for item in staged[6:9]:
            publish(run, item)
        grown = analyze(run, AnalysisConfig(), reducers)
        cold = analyze(run, NOCACHE, reducers)
    assert first.skipped and grown.skipped == cold.skipped
    assert_same(grown.reduced, cold.reduced)
    parts = open_run(run).parts()
    for r in reducers:
        state = reducer_prefix.load(open_run(run).cache_dir(), parts, runner.bound(r, parts))
        assert state is None or state.k <= 3, r.name


def test_rewritten_part_invalidates_the_state(source, tmp_path):
    run = tmp_path / "run"
    staged = split_run(source, run, rows=70)
    for item in staged[:5]:
        publish(run, item)
    analyze(run, AnalysisConfig(), VD.reducers())
    parts = open_run(run).parts()
    assert all(reducer_prefix.load(open_run(run).cache_dir(), parts, runner.bound(r, parts)) is not None
               for r in VD.reducers())
    os.utime(parts[0].path, ns=(Path(parts[0].path).stat().st_mtime_ns + 10**9,) * 2)  # rewritten: a new key
    parts = open_run(run).parts()
    assert all(reducer_prefix.load(open_run(run).cache_dir(), parts, runner.bound(r, parts)) is None
               for r in VD.reducers())
    assert_same(analyze(run, AnalysisConfig(), VD.reducers()).reduced, analyze(run, NOCACHE, VD.reducers()).reduced)


def test_reduced_merges_on_first_use(source, tmp_path, monkeypatch):
    run = tmp_path / "run"
    staged = split_run(source, run, rows=70)
    for item in staged[:-1]:
        publish(run, item)
    analyze(run, AnalysisConfig(), VD.reducers())
    publish(run, staged[-1])  # one more part: each reducer's state and the new partial wait to be merged
    merged = []
    real = runner.Accumulator.result
    monkeypatch.setattr(runner.Accumulator, "result", lambda self: merged.append(self.reducer.name) or real(self))
    warm = analyze(run, AnalysisConfig(), VD.reducers())
    assert merged == []  # nothing merged until a face reads it
    assert set(warm.reduced) == {r.name for r in VD.reducers()}
    cold = dict(analyze(run, NOCACHE, VD.reducers()).reduced)
    merged.clear()
    assert_same({"scan": warm.reduced["scan"]}, {"scan": cold["scan"]})
    assert merged == ["scan"]
    copy = pickle.loads(pickle.dumps(warm.reduced))  # every result merged, then pickled
    assert_same(dict(copy), cold)


def test_unreadable_state_files_fall_back(source, tmp_path):
    run = tmp_path / "run"
    for item in split_run(source, run, rows=70):
        publish(run, item)
    cold = dict(analyze(run, NOCACHE, VD.reducers()).reduced)
    analyze(run, AnalysisConfig(), VD.reducers())
    folder = open_run(run).cache_dir() / reducer_prefix.FOLDER
    for path in folder.glob("*.result"):  # a result cut short: the state is merged instead
        path.write_bytes(path.read_bytes()[:-3])
    assert_same(dict(analyze(run, AnalysisConfig(), VD.reducers()).reduced), cold)
    for path in folder.glob("*.state"):  # the state too: the per-part partials are merged again
        path.write_bytes(b"")
    assert_same(dict(analyze(run, AnalysisConfig(), VD.reducers()).reduced), cold)


def test_the_token_sample_is_written_once(source, tmp_path):
    """A concatenation's partials (the token sample's) that a saved state covers are not also written one
    file a part: the state is their one copy. Those of later parts, which no state covers yet, are."""
    run = tmp_path / "run"
    staged = split_run(source, run, rows=70)
    for item in staged[:-1]:
        publish(run, item)
    cold = analyze(run, AnalysisConfig(), VD.reducers())
    cache = open_run(run).cache_dir()
    sample = next(r for r in VD.reducers() if getattr(r, "merge_every", None) == 0)
    parts = open_run(run).parts()
    assert reducer_prefix.load(cache, parts, runner.bound(sample, parts)).k == len(parts)
    assert not list((cache / sample.name).glob("*.part"))  # in the state only
    assert len(list((cache / "scan").glob("*.part"))) == len(parts)  # another reducer's: one a part, as before
    assert_same(dict(analyze(run, AnalysisConfig(), VD.reducers()).reduced), dict(cold.reduced))
    publish(run, staged[-1])  # one part on: no new state due, so its partial is written
    grown = analyze(run, AnalysisConfig(), VD.reducers())
    assert_same(dict(grown.reduced), dict(analyze(run, NOCACHE, VD.reducers()).reduced))
    assert len(list((cache / sample.name).glob("*.part"))) == 1
    parts = open_run(run).parts()
    os.utime(parts[0].path, ns=(Path(parts[0].path).stat().st_mtime_ns + 10**9,) * 2)  # the state invalid
    assert_same(dict(analyze(run, AnalysisConfig(), VD.reducers()).reduced),
                dict(analyze(run, NOCACHE, VD.reducers()).reduced))  # its parts read again


def test_held_partials_are_written_without_a_state(source, tmp_path, monkeypatch):
    """When no state is due (PREFIX_TAIL parts not yet past the last one), every computed partial of a
    concatenation is written as the pass ends, before any face reads the reducer."""
    monkeypatch.setattr(reducer_prefix, "PREFIX_TAIL", 100)
    run = tmp_path / "run"
    staged = split_run(source, run, rows=70)
    for item in staged[:3]:
        publish(run, item)
    analyze(run, AnalysisConfig(), VD.reducers())
    for item in staged[3:5]:
        publish(run, item)
    analyze(run, AnalysisConfig(), VD.reducers())  # its results never read
    sample = next(r for r in VD.reducers() if getattr(r, "merge_every", None) == 0)
    assert len(list((open_run(run).cache_dir() / sample.name).glob("*.part"))) == 2


SYNTH = SynthConfig(steps=40, seqs_per_step=2, seq_len=(5, 30), ranks=1, rows_per_file=120, vocab_size=0)


def sample_decodes(monkeypatch) -> list[str]:
    """The keys of the parts a Pass decodes for the token sample, in order."""
    keys: list[str] = []
    real = runner.Pass._results
    monkeypatch.setattr(runner.Pass, "_results", lambda self, jobs: keys.extend(
        p.key for p, rs in jobs if any(r.name == "tokens" for r in rs)) or real(self, jobs))
    return keys


def sample_of(run: Path, cfg: AnalysisConfig = AnalysisConfig(), cap: int = SAMPLE_CAP) -> dict:
    """The token sample of the run as listed now, from one Pass of its reducer alone."""
    listed = open_run(run)
    parts = listed.parts()
    red = runner.bound(SampleReducer(cap=cap), parts)
    return runner.Pass(listed.cache_dir(), parts, [red], cfg).merged(red)


def check_against_cold(run: Path, decodes: list[str], cap: int = SAMPLE_CAP) -> list[str]:
    """The parts a warm read decoded (cleared after), once its sample equals a cold one's bit for bit."""
    decodes.clear()
    warm = sample_of(run, cap=cap)
    got = list(decodes)
    assert_same({"tokens": warm}, {"tokens": sample_of(run, NOCACHE, cap)})
    decodes.clear()
    return got


def test_a_restart_decodes_only_the_parts_it_changed(tmp_path, monkeypatch):
    """The revert's case (1392cd0): a restart at step 30 supersedes the steps of the parts from there on
    (their keys change) and adds its own. The sample's state, written once, is cut back to the parts
    before it: only the changed and new parts are decoded, not every part."""
    decodes = sample_decodes(monkeypatch)
    make_run(tmp_path / "run", SYNTH)
    old = open_run(tmp_path / "run").parts()
    assert len(check_against_cold(tmp_path / "run", decodes)) == len(old) == 11  # a fresh cache: all
    cache = open_run(tmp_path / "run").cache_dir()
    assert not list((cache / "tokens").glob("*.part"))  # in the state only
    make_run(tmp_path / "run", dataclasses.replace(SYNTH, attempt=1, seed=3), steps=range(30, 40), manifest=False)
    parts = open_run(tmp_path / "run").parts()
    changed = [p.key for p in parts if p.key not in {q.key for q in old}]
    assert len(changed) == 6 and parts[-len(changed)].step_min >= 29
    assert check_against_cold(tmp_path / "run", decodes) == changed
    assert check_against_cold(tmp_path / "run", decodes) == []  # their partials now cached, one a part


def test_appended_rewritten_and_removed_parts(tmp_path, monkeypatch):
    """A part appended (a live run) or rewritten is the only one decoded: the state is cut back to the parts
    before it and the parts after it that it holds are sliced out of it; a removed part decodes nothing.
    Every sample equals a cold one bit for bit."""
    decodes = sample_decodes(monkeypatch)
    make_run(tmp_path / "run", SYNTH)
    last = sorted((tmp_path / "run").rglob("*.parquet"))[-1]
    held = last.read_bytes()
    last.unlink()
    assert len(check_against_cold(tmp_path / "run", decodes)) == 10
    last.write_bytes(held)  # a part appended
    parts = open_run(tmp_path / "run").parts()
    assert check_against_cold(tmp_path / "run", decodes) == [parts[-1].key]
    os.utime(parts[6].path, ns=(Path(parts[6].path).stat().st_mtime_ns + 10**9,) * 2)  # rewritten: a new key
    parts = open_run(tmp_path / "run").parts()
    assert check_against_cold(tmp_path / "run", decodes) == [parts[6].key]
    Path(parts[3].path).unlink()  # a part removed
    assert check_against_cold(tmp_path / "run", decodes) == []
    cache = open_run(tmp_path / "run").cache_dir()
    assert len(list((cache / "tokens").glob("*.part"))) == 2  # the appended and the rewritten part's: no state
    # covers them; the others are in the state only


def test_a_capped_sample_keeps_its_per_part_partials(tmp_path, monkeypatch):
    """A capped sample's state lacks the rows the cap dropped, which a merge of fewer parts may keep: it
    cannot be cut back, so its per-part partials are written too and a restart reads them, not the parts."""
    decodes = sample_decodes(monkeypatch)
    make_run(tmp_path / "run", SYNTH)
    old = open_run(tmp_path / "run").parts()
    check_against_cold(tmp_path / "run", decodes, cap=500)
    cache = open_run(tmp_path / "run").cache_dir()
    assert len(list((cache / "tokens").glob("*.part"))) == len(old)
    assert int(sample_of(tmp_path / "run", cap=500)["share_level"][0]) > 0
    make_run(tmp_path / "run", dataclasses.replace(SYNTH, attempt=1, seed=3), steps=range(30, 40), manifest=False)
    parts = open_run(tmp_path / "run").parts()
    assert check_against_cold(tmp_path / "run", decodes, cap=500) == [p.key for p in parts if p.key not in
                                                                     {q.key for q in old}]


def test_a_state_of_another_cache_version_is_a_miss(source, tmp_path, monkeypatch):
    """The cache's version is in each state's namespace: an old kldiag's state is never read, and the one
    this kldiag writes beside it is."""
    run = tmp_path / "run"
    for item in split_run(source, run, rows=70):
        publish(run, item)
    monkeypatch.setattr(reducer_prefix, "REDUCER_PREFIX_VERSION", 1)
    sample_of(run)
    parts = open_run(run).parts()
    red = runner.bound(SampleReducer(), parts)
    assert reducer_prefix.load(open_run(run).cache_dir(), parts, red) is not None
    monkeypatch.setattr(reducer_prefix, "REDUCER_PREFIX_VERSION", 2)
    assert reducer_prefix.load(open_run(run).cache_dir(), parts, red) is None
    sample_of(run)
    state = reducer_prefix.load(open_run(run).cache_dir(), parts, red)
    assert state.k == len(parts) and sum(state.rows) == len(state.result["step"])


def test_spare_partials_are_written_when_their_state_is_replaced(tmp_path, monkeypatch):
    """A cut state's later parts are handed out of it; when a new state that stops before some of them (at an
    unreadable part) replaces it, their partials are written one a part, so the next read decodes none."""
    monkeypatch.setattr(reducer_prefix, "PREFIX_TAIL", 1)  # a state saved at every read
    decodes = sample_decodes(monkeypatch)
    make_run(tmp_path / "run", SYNTH)
    check_against_cold(tmp_path / "run", decodes)
    parts = open_run(tmp_path / "run").parts()
    os.utime(parts[6].path, ns=(Path(parts[6].path).stat().st_mtime_ns + 10**9,) * 2)
    Path(parts[8].path).write_bytes(b"not parquet")  # unreadable: a state stops before it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        parts = open_run(tmp_path / "run").parts()
        assert check_against_cold(tmp_path / "run", decodes) == [parts[6].key, parts[8].key]
        state = reducer_prefix.load(open_run(tmp_path / "run").cache_dir(), parts,
                                    runner.bound(SampleReducer(), parts))
        assert state.k == 8 and not state.spare
        assert check_against_cold(tmp_path / "run", decodes) == [parts[8].key]  # 9, 10: written


def test_one_ranks_restart_decodes_only_its_parts(tmp_path, monkeypatch):
    """Rank 0 restarts at step 30, rank 1 goes on: the listing (by first step) interleaves the ranks, so the
    state is cut at rank 0's first changed part, and rank 1's later parts come out of it, not decoded."""
    decodes = sample_decodes(monkeypatch)
    two = dataclasses.replace(SYNTH, ranks=2, rows_per_file=240)
    make_run(tmp_path / "run", two)
    old = {p.key for p in open_run(tmp_path / "run").parts()}
    check_against_cold(tmp_path / "run", decodes)
    make_run(tmp_path / "run", dataclasses.replace(two, ranks=1, attempt=1, seed=3), steps=range(30, 40),
             manifest=False)
    parts = open_run(tmp_path / "run").parts()
    changed = [p.key for p in parts if p.key not in old]
    first = next(i for i, p in enumerate(parts) if p.key not in old)
    assert {p.rank for p in parts if p.key not in old} == {0}
    assert any(p.rank == 1 for p in parts[first:])  # rank 1's parts after the cut: in the state
    assert check_against_cold(tmp_path / "run", decodes) == changed
