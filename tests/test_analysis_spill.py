"""What is derived from a sequence-row chunk file (kldiag/analysis/spill.py): the per-step counts and sums
kept beside it are read by a fresh process instead of the chunk's rows, and give the same analysis."""

from __future__ import annotations

import os

import pytest
from analysis_same import assert_same_analysis

from kldiag.analysis import AnalysisConfig, analyze, prefix, reduce, seqrows, spill, tables
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
