"""kldiag/views/mismatch.py: `held(analysis)` makes the token sample's set once for everything a Mismatch page
render (or a report) reads from it: the view, a what-if, the crosswalk; released on leaving."""

from __future__ import annotations

import gc

from kldiag.analysis import AnalysisConfig, analyze
from kldiag.mismatch import sample as SS
from kldiag.mismatch import whatif as W
from kldiag.tools.synth import SynthConfig, make_run
from kldiag.views import dashboard
from kldiag.views import mismatch as VM

CFG = SynthConfig(steps=12, seqs_per_step=8, seq_len=(8, 40), seed=3)


def test_held_makes_the_token_set_once_for_the_view_a_whatif_and_the_crosswalk(tmp_path, monkeypatch):
    make_run(tmp_path / "run", CFG)
    a = analyze(tmp_path / "run", AnalysisConfig(), dashboard.reducers())  # the store empty: every result computed
    sample = SS.sample_of(a)
    assert not sample.reused()  # one TokenSet serves all three (a reused run's crosswalk reads a second)
    made = []
    real = SS.from_columns
    monkeypatch.setattr(SS, "from_columns", lambda *x, **k: made.append(1) or real(*x, **k))
    with VM.held(a):
        view = VM.view_of(a)
        gc.collect()  # the set is weakly kept by the sample: only the hold keeps it between sections
        assert not VM.whatif_frame(view, W.WhatIf()).empty
        gc.collect()
        table, _ = VM.crosswalk_frame(a, "verl")
        assert len(table)
    assert made == [1]
    assert a.memo[VM.HOLDS] == []  # released on leaving (test_report_mismatch: then made again)


def test_nested_holds_release_only_their_own(tmp_path):
    make_run(tmp_path / "run", CFG)
    a = analyze(tmp_path / "run", AnalysisConfig(), dashboard.reducers())
    with VM.held(a):
        with VM.held(a):
            ts = VM.tokens_of(a)
            assert [len(p) for p in a.memo[VM.HOLDS]] == [1, 1]
        assert len(a.memo[VM.HOLDS]) == 1 and a.memo[VM.HOLDS][0][0] is ts
    assert a.memo[VM.HOLDS] == []
