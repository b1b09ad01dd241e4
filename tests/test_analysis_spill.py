"""What is derived from a sequence-row chunk file (kldiag/analysis/core/spill.py): the per-step counts and sums
kept beside it are read by a fresh process instead of the chunk's rows, and give the same analysis."""

from __future__ import annotations

import os

import pytest
from analysis_same import assert_same_analysis

from kldiag.analysis import AnalysisConfig, analyze
from kldiag.analysis import protocol as reduce
from kldiag.analysis.cache import prefix
from kldiag.analysis.core import seqrows, spill, tables
from kldiag.tools.synth import SynthConfig, make_run

CFG = AnalysisConfig(per_rank=True, trainer_compatible=True)
DERIVE = ("_counts", "_opsm_rows", "_micro_sums")


@pytest.fixture()
def chunked(tmp_path, monkeypatch):
    """A run whose cached prefix lists chunk files of 40 sequence rows, its uncached analysis to compare
    with, and a counter of the per-chunk sums derived from rows."""
    run = tmp_path / "run"
    make_run(run, SynthConfig(steps=12, seqs_per_step=9, seq_len=(5, 40), ranks=2, blowup_step=6,
                              blowup_frac=0.05, vocab_size=0, rows_per_file=500))
    want = analyze(run, AnalysisConfig(use_cache=False, per_rank=True, trainer_compatible=True))
    monkeypatch.setattr(seqrows, "SPILL_ROWS", 0)
    monkeypatch.setattr(spill, "SPILL_CHUNK_ROWS", 40)
    monkeypatch.setattr(prefix, "SEAL_EVERY", 2)
    analyze(run, CFG)  # cold: the prefix lists chunk files
    calls = []
    for name in DERIVE:
        real = getattr(tables, name)
        monkeypatch.setattr(tables, name, lambda *a, _real=real, _n=name: calls.append(_n) or _real(*a))
    return run, want, calls


def test_a_fresh_process_reads_the_sums_kept_beside_the_chunk_files(chunked):
    run, want, calls = chunked
    assert_same_analysis(analyze(run, CFG), want)  # warm: the sums written beside the chunk files
    folder = run / ".kldiag" / "prefix" / "seqs"
    kept = sorted(p.name for p in folder.glob("*.seqs.*.arrays"))
    chunks = [p for p in os.listdir(folder) if p.endswith(spill.SUFFIX)]
    assert len(kept) >= 3 * len(chunks) > 0  # counts, per-rank counts, opsm and micro sums of each chunk
    spill._memo.clear()  # what a fresh process remembers
    calls.clear()
    assert_same_analysis(analyze(run, CFG), want)
    assert len(calls) < len(kept)  # only the rows after the prefix's chunk files are summed again
    assert sorted(p.name for p in folder.glob("*.seqs.*.arrays")) == kept


def test_unwritable_or_corrupt_sums_are_derived_again(chunked, monkeypatch):
    run, want, calls = chunked
    analyze(run, CFG)
    folder = run / ".kldiag" / "prefix" / "seqs"
    for p in folder.glob("*.seqs.*.arrays"):
        p.write_bytes(p.read_bytes()[:-3])  # truncated: not what was written
    monkeypatch.setattr(reduce, "save_arrays", lambda path, arrays: False)  # a read-only folder
    spill._memo.clear()
    calls.clear()
    assert_same_analysis(analyze(run, CFG), want)
    assert calls  # derived from the rows again


def test_a_fresh_process_opens_one_file_per_sum_for_all_the_chunk_files(chunked, monkeypatch):
    """The sums of every chunk file a prefix lists are also kept in one file per kind (spill.kept_all): a warm
    analysis opens a few files however many chunks the run has, and the result is the same."""
    run, want, calls = chunked
    assert_same_analysis(analyze(run, CFG), want)  # writes the files of all the chunks
    folder = run / ".kldiag" / "prefix" / "seqs"
    chunks = [p for p in os.listdir(folder) if p.endswith(spill.SUFFIX)]
    whole = sorted(p.name for p in folder.glob(f"*{spill.SUFFIX}.all.*.arrays"))
    assert len(chunks) >= 3 and 0 < len(whole) <= 4  # one per kind of sums: not one per chunk
    opened = []
    real = reduce.load_arrays
    monkeypatch.setattr(reduce, "load_arrays", lambda path, **kw: opened.append(path) or real(path, **kw))
    spill._memo.clear()  # what a fresh process remembers
    calls.clear()
    assert_same_analysis(analyze(run, CFG), want)
    sums = [p for p in opened if p.parent == folder and p.name.endswith(".arrays")]
    assert sorted(p.name for p in sums) == whole  # no chunk's own sums file


def test_the_sums_of_a_longer_chunk_list_replace_the_shorter_ones(tmp_path, monkeypatch):
    """A prefix rewritten over more chunk files keeps its sums of all of them under a new name; the old ones go."""
    monkeypatch.setattr(seqrows, "SPILL_ROWS", 0)
    monkeypatch.setattr(spill, "SPILL_CHUNK_ROWS", 40)
    monkeypatch.setattr(prefix, "SEAL_EVERY", 2)
    run = tmp_path / "run"
    cfg = SynthConfig(steps=16, seqs_per_step=30, seq_len=(5, 40), rows_per_file=300, vocab_size=0)
    make_run(run, cfg, steps=range(0, 8))
    analyze(run, CFG)
    analyze(run, CFG)
    folder = run / ".kldiag" / "prefix" / "seqs"
    before = {p.name for p in folder.glob(f"*{spill.SUFFIX}.all.*.arrays")}
    make_run(run, cfg, steps=range(8, 16), manifest=False)
    monkeypatch.setattr(prefix, "PREFIX_TAIL", 1)  # the prefix is rewritten over the new parts at once
    analyze(run, CFG)
    spill._memo.clear()
    got = analyze(run, CFG)
    after = {p.name for p in folder.glob(f"*{spill.SUFFIX}.all.*.arrays")}
    assert before and after and not before & after
    assert_same_analysis(got, analyze(run, AnalysisConfig(use_cache=False, per_rank=True, trainer_compatible=True)))
