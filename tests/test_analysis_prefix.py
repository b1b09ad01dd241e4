"""The merged-prefix cache (kldiag/analysis/cache/prefix.py): a run analysed as it grows, part by
part, with the prefix rewritten often, equals a full recompute bit for bit, and a refresh
loads only the partials it needs."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from analysis_same import assert_same_analysis

from kldiag.analysis import AnalysisConfig, analyze
from kldiag.analysis import protocol as reduce
from kldiag.analysis.cache import prefix
from kldiag.analysis.core import partials, seqrows, spill
from kldiag.analysis.runtime import part_fold
from kldiag.errors import CorruptPartError
from kldiag.format import open_run, part_name, publish_part, rank_dir
from kldiag.tools.synth import SynthConfig, make_run

NOCACHE = AnalysisConfig(use_cache=False)


def split_run(src: Path, dst: Path, rows: int) -> list[tuple[int, Path]]:
    """Each rank of `src` re-cut into parts of `rows` rows, not at step boundaries (a step
    spans 3+ parts); returns (rank, file) in the order a reader lists them, unpublished (in dst/staged)."""
    dst.mkdir(parents=True)
    shutil.copy(src / "run.json", dst / "run.json")
    staged = []
    table = open_run(src).read()
    for rank in sorted(set(table.column("rank").to_pylist())):
        t = table.filter(pa.compute.equal(table.column("rank"), rank))
        for index, start in enumerate(range(0, t.num_rows, rows)):
            chunk = t.slice(start, rows)
            step = chunk.column("step").to_numpy()
            name = part_name(int(step[0]), int(step[-1]), index)
            staged.append((int(step[0]), rank, index, chunk, name))
    staged.sort(key=lambda s: s[:3])
    return staged


def publish(dst: Path, item) -> None:
    _, rank, _, chunk, name = item
    publish_part(chunk, rank_dir(dst, rank), name)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("prefix") / "src"
    make_run(run, SynthConfig(steps=8, seqs_per_step=6, seq_len=(5, 40), ranks=2, blowup_step=4,
                              blowup_frac=0.05, nonfinite=((5, "logp"),), vocab_size=0))
    return run


@pytest.mark.parametrize("spilled", [False, True])
def test_growing_run_equals_full_recompute(source, tmp_path, monkeypatch, spilled):
    monkeypatch.setattr(prefix, "PREFIX_TAIL", 2)  # rewrite the prefix often
    if spilled:  # every sealed sequence row to a chunk file, every sequence table to Parquet
        monkeypatch.setattr(spill, "SPILL_CHUNK_ROWS", 1)
        monkeypatch.setattr(prefix, "SEAL_EVERY", 2)
        monkeypatch.setattr(seqrows, "SPILL_ROWS", 0)
    loads = []
    real_load = reduce.load_arrays
    monkeypatch.setattr(reduce, "load_arrays", lambda path, **kw: loads.append(path) or real_load(path, **kw))
    staged = split_run(source, tmp_path / "run", rows=70)
    assert len(staged) > 12
    cfg = AnalysisConfig(per_rank=True, trainer_compatible=True)
    used = 0
    for n, item in enumerate(staged, 1):
        publish(tmp_path / "run", item)
        loads.clear()
        parts = open_run(tmp_path / "run").parts()
        pre = prefix.load(open_run(tmp_path / "run").cache_dir(), parts, prefix_th(tmp_path / "run", cfg))
        grown = analyze(tmp_path / "run", cfg)
        assert grown.files == n and grown.files_new == 1
        assert_same_analysis(grown, analyze(tmp_path / "run", AnalysisConfig(use_cache=False, per_rank=True,
                                                                             trainer_compatible=True)))
        part_loads = [p for p in loads if p.parent.name == "analysis"]
        if pre is not None:  # per-part partials read: the prefix's open parts and the tail only
            used += 1
            opened = sum(p.step_max >= pre.step_cut for p in parts[:pre.k])
            assert len(part_loads) == opened + n - pre.k - 1  # the new part has none yet: not even tried
    assert used >= len(staged) - 3
    assert len(part_loads) < len(staged) // 2  # the last refresh read a few partials, not all of them
    # the prefix file: read by the load above and by the analysis, not kept in memory between two
    # analyses (its sealed sequence rows grow with the run)
    assert len(loads) - len(part_loads) == 2
    chunk_files = list((tmp_path / "run" / ".kldiag" / "prefix" / "seqs").glob("*.seqs"))
    assert bool(chunk_files) == spilled


def prefix_th(run: Path, cfg: AnalysisConfig = AnalysisConfig()):
    from kldiag.analysis.pipeline import thresholds

    return thresholds(cfg, open_run(run).manifest)


def test_a_part_listed_inside_the_prefix_invalidates_it(source, tmp_path, monkeypatch):
    """A slow rank publishes an early part after later ones: the listing no longer starts
    with the prefix's parts, so it is not used, and the result is still exact."""
    monkeypatch.setattr(prefix, "PREFIX_TAIL", 1)
    staged = split_run(source, tmp_path / "run", rows=90)
    late = next(i for i, s in enumerate(staged) if s[1] == 1 and i > 2)
    for i, item in enumerate(staged):
        if i != late:
            publish(tmp_path / "run", item)
    analyze(tmp_path / "run")
    publish(tmp_path / "run", staged[late])
    assert_same_analysis(analyze(tmp_path / "run"), analyze(tmp_path / "run", NOCACHE))


def test_corrupt_part_is_never_inside_the_prefix(source, tmp_path, monkeypatch):
    monkeypatch.setattr(prefix, "PREFIX_TAIL", 1)
    run = tmp_path / "run"
    shutil.copytree(source, run)
    parts = open_run(run).parts()
    bad = parts[len(parts) // 2]
    Path(bad.path).write_bytes(b"not parquet")
    for _ in range(3):  # computed, then from the prefix and the per-part cache: skipped by name each time
        with pytest.warns(UserWarning, match="skipping part"):
            cached = analyze(run)
        assert cached.skipped == [bad.path]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert_same_analysis(cached, analyze(run, NOCACHE))
        with pytest.raises(CorruptPartError, match="part-"):
            analyze(run, AnalysisConfig(strict=True))
    meta = list((run / ".kldiag" / "prefix").glob("*.json"))
    assert len(meta) == 1 and len(list((run / ".kldiag" / "prefix").glob("*.part"))) == 1
    assert prefix.load(run / ".kldiag", parts, prefix_th(run)).k == len(parts) // 2


def test_combine_without_prefix_is_merge(source):
    from kldiag.analysis.pipeline import thresholds

    run = open_run(source)
    th = thresholds(AnalysisConfig(), run.manifest)
    ps = [part_fold.partial_of(p, th, 1 << 20) for p in run.parts()]
    a, b = prefix.combine(None, [], ps, th.top_k), partials.merge(ps, th.top_k)
    for t in partials.TABLES:
        for col, v in getattr(b, t).items():
            np.testing.assert_array_equal(getattr(a, t)[col], v)


def test_restart_invalidates_the_prefix(tmp_path, monkeypatch):
    """A later attempt supersedes steps of parts inside the prefix: their keys change, so the
    prefix no longer matches the listing and the cached analysis still equals a recompute."""
    import dataclasses

    monkeypatch.setattr(prefix, "PREFIX_TAIL", 1)
    cfg = SynthConfig(steps=8, seqs_per_step=6, seq_len=(5, 30), ranks=2, rows_per_file=150, vocab_size=0)
    make_run(tmp_path / "run", cfg)
    analyze(tmp_path / "run")
    run = open_run(tmp_path / "run")
    assert prefix.load(run.cache_dir(), run.parts(), prefix_th(tmp_path / "run")) is not None
    make_run(tmp_path / "run", dataclasses.replace(cfg, attempt=1, seed=3), steps=range(2, 4), manifest=False)
    run = open_run(tmp_path / "run")
    assert prefix.load(run.cache_dir(), run.parts(), prefix_th(tmp_path / "run")) is None
    again = analyze(tmp_path / "run")
    assert again.info["superseded_rows"] > 0
    assert_same_analysis(again, analyze(tmp_path / "run", NOCACHE))


@pytest.mark.parametrize("seal_every", [1, 2, 5])
def test_the_streaming_merge_equals_one_merge_bit_for_bit(source, tmp_path, monkeypatch, seal_every):
    """prefix.Stream (the cold path: partials merged as they arrive, rows below the next part's first
    step sealed) gives exactly partials.merge of every part's partial, with two ranks' parts interleaved."""
    from kldiag.analysis.pipeline import thresholds

    monkeypatch.setattr(prefix, "SEAL_EVERY", seal_every)
    for item in split_run(source, tmp_path / "run", rows=70):
        publish(tmp_path / "run", item)
    run = open_run(tmp_path / "run")
    parts = run.parts()
    th = thresholds(AnalysisConfig(per_rank=True), run.manifest)
    red = partials.AnalysisReducer(th)
    each = [partials.from_arrays(part_fold.compute_part(p, [red], 1 << 20)[red.name]) for p in parts]
    stream = prefix.Stream(parts, th.top_k)
    for i, p in enumerate(each):
        stream.add(i, p)
    got, want = stream.result(), partials.merge(each, th.top_k)
    assert len(parts) > 8 and stream.cut > -(1 << 62)  # it did seal
    for table in partials.TABLES:
        g, w = getattr(got, table), getattr(want, table)
        assert sorted(g) == sorted(w), table
        for col in w:
            np.testing.assert_array_equal(g[col], w[col], err_msg=f"{table}.{col}")
    assert got.rows == want.rows
