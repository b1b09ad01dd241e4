"""kldiag/mismatch/parity.py's report_for: the fit kept in the run's result store, so that a fresh process
(the Mismatch page's first visit after the Overview's diagnosis) reads it instead of fitting again."""

from __future__ import annotations

import pytest
from test_analysis_store import CFG, entries, same

from kldiag.analysis import AnalysisConfig, analyze
from kldiag.mismatch import kept as K
from kldiag.mismatch import parity as P
from kldiag.tools.synth import make_run
from kldiag.views import dashboard


def test_parity_report_read_from_the_store_equals_the_fit(tmp_path, monkeypatch):
    run = tmp_path / "run"
    make_run(run, CFG)
    first = P.report_for(analyze(run, AnalysisConfig(), dashboard.reducers()))
    assert first is not None and len(entries(run, "parity")) == 1
    K.forget()  # nothing kept in this process: only the store can spare the fit
    a = analyze(run, AnalysisConfig(), dashboard.reducers())  # another process's analysis of the same parts
    monkeypatch.setattr(P, "tokens_for", lambda *x, **k: pytest.fail("the fit's tokens made on a hit"))
    hit = P.report_for(a)
    monkeypatch.undo()
    same(hit, first)
    same(hit, P.check(P.tokens_for(a)))
    other = P.ParityConfig(float_noise=0.5)  # other thresholds: another entry
    same(P.report_for(a, other), P.check(P.tokens_for(a, other), other))
    assert len(entries(run, "parity")) == 2
