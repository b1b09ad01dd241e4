"""Faces read each part once: `kldiag report`, `kldiag analyze` and the dashboard's data open every
part at most once on a cold cache and never while the cache is warm (the one-engine rule). The report's
worst tokens take their context from the analysis's pass (kldiag.analysis.core.around), which reads it
with their batch: no part is opened again for it."""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path

import pytest

from kldiag.cli import main
from kldiag.format import parts as format_parts
from kldiag.tools.synth import SynthConfig, make_run

SAMPLES = Path(__file__).resolve().parent.parent / "sample_logs"


@pytest.fixture
def opens(monkeypatch) -> Counter:
    """Counts every open of a part file, by path (the one way any reader reaches a part's bytes)."""
    counts: Counter = Counter()
    real = format_parts.PartInfo.open

    def counted(self):
        counts[str(self.path)] += 1
        return real(self)

    monkeypatch.setattr(format_parts.PartInfo, "open", counted)
    return counts


def fresh_copy(name: str, tmp_path: Path) -> Path:
    run = tmp_path / name
    shutil.copytree(SAMPLES / name, run, ignore=shutil.ignore_patterns(".kldiag"))
    return run


@pytest.mark.parametrize("name", ["demo_k3", "demo_k3_is", "trl_grpo_tiny"])
def test_report_opens_each_part_once_cold_and_never_warm(name, tmp_path, opens, capsys):
    run = fresh_copy(name, tmp_path)
    parts = [str(p) for p in sorted((run / "tokens").rglob("part-*.parquet"))]
    main(["report", str(run), "-o", str(tmp_path / "cold.html")])
    cold = capsys.readouterr().out
    assert set(opens) == set(parts) and max(opens.values()) == 1, dict(opens)  # the pass, its context with it
    opens.clear()
    main(["report", str(run), "-o", str(tmp_path / "warm.html")])
    assert dict(opens) == {}
    assert capsys.readouterr().out.replace("warm.html", "cold.html") == cold  # the same report from the cache


def test_analyze_and_report_share_one_read(tmp_path, opens, capsys):
    """A multi-part, multi-rank run: `kldiag analyze` then `kldiag report` read each part once in all."""
    make_run(tmp_path / "r", SynthConfig(steps=12, seqs_per_step=8, ranks=2, blowup_step=6, vocab_size=64))
    main(["analyze", str(tmp_path / "r")])
    first = dict(opens)
    assert first and max(first.values()) == 1
    main(["report", str(tmp_path / "r"), "-o", str(tmp_path / "r.html")])
    assert dict(opens) == first  # the worst tokens' context too: kept by the analysis's pass
    opens.clear()
    main(["report", str(tmp_path / "r"), "-o", str(tmp_path / "r2.html")])
    assert dict(opens) == {}  # every partial and the context from the cache


def test_dashboard_data_reads_each_part_once(tmp_path, opens):
    import kldiag
    from kldiag.analysis.runtime import runner
    from kldiag.diagnosis import diagnose
    from kldiag.views import dashboard, estimators, mismatch

    run = fresh_copy("demo_k3_is", tmp_path)
    a = kldiag.analyze(run, kldiag.AnalysisConfig(), dashboard.reducers())
    diagnose(a)
    mismatch.view_of(a)
    mismatch.crosswalk_frame(a, "trl")
    estimators.from_arrays(runner.reduced(a, dashboard.estimator_reducer()))  # the Estimators page's first visit
    assert max(opens.values()) == 1 and len(opens) == 1  # every page but Sequence: read in the analysis's pass
    again = kldiag.analyze(run, kldiag.AnalysisConfig(), dashboard.reducers())
    estimators.from_arrays(runner.reduced(again, dashboard.estimator_reducer()))
    assert max(opens.values()) == 1  # cached: never again


@pytest.mark.parametrize("use_cache", [False, True])
def test_diagnose_of_a_bare_analysis_reads_each_part_once_more(tmp_path, opens, use_cache):
    """The README's `a = kldiag.analyze(run)` then `diagnose(a)`: the diagnosis's reducers, which that analysis was
    not made with, are read together in one more pass (one pass each before: about 7 opens of every part), and
    the diagnosis is the one of an analysis that read them along."""
    import kldiag
    from kldiag.diagnosis import diagnose
    from kldiag.diagnosis.core import reducers

    run = tmp_path / "r"
    make_run(run, SynthConfig(steps=12, seqs_per_step=8, ranks=2, blowup_step=6, blowup_frac=0.02, vocab_size=64))
    a = kldiag.analyze(run, kldiag.AnalysisConfig(use_cache=use_cache))
    assert set(opens.values()) == {1}
    dg = diagnose(a)
    assert set(opens.values()) == {2} and len(opens) == 2  # a part per rank, each read once more
    ref = diagnose(kldiag.analyze(run, kldiag.AnalysisConfig(use_cache=False), reducers()))
    assert dg.verdict == ref.verdict == "unstable"
    assert [(c.cause, c.onset, c.severity, c.evidence) for c in dg.causes] == \
        [(c.cause, c.onset, c.severity, c.evidence) for c in ref.causes]
    assert all(a.reduced[n] is not None for n in ("scan", "tokens", "turns"))


def test_read_along_reads_only_what_the_analysis_lacks(tmp_path, opens):
    """runner.read_along: nothing when the analysis read every reducer along; else the missing ones in one pass,
    after which `reduced` reads no part and gives what a pass of that reducer alone gives."""
    import numpy as np

    import kldiag
    from kldiag.analysis.reducers.scan import ScanReducer
    from kldiag.analysis.reducers.turns import TurnReducer
    from kldiag.analysis.runtime import runner

    run = tmp_path / "r"
    make_run(run, SynthConfig(steps=8, seqs_per_step=8, ranks=2))
    cfg = kldiag.AnalysisConfig(use_cache=False)
    a = kldiag.analyze(run, cfg, [ScanReducer()])
    opens.clear()
    assert runner.read_along(a, [ScanReducer()]) == 0 and dict(opens) == {}
    assert runner.read_along(a, [ScanReducer(), TurnReducer()]) == 1 and set(opens.values()) == {1}
    opens.clear()
    turns, scan = runner.reduced(a, TurnReducer()), runner.reduced(a, ScanReducer())
    assert dict(opens) == {}
    alone = runner.reduced(kldiag.analyze(run, cfg), TurnReducer())
    assert turns.keys() == alone.keys() and all(np.array_equal(turns[k], alone[k], equal_nan=True) for k in turns)
    assert "scan" in a.reduced and scan["sums"].shape[0] == 8


def test_a_report_after_the_dashboard_opens_no_part(tmp_path, opens, capsys):
    """The dashboard's analysis (cache on) holds every partial the report reads, its worst tokens' context
    included: the report then opens no part."""
    import kldiag
    from kldiag.views import dashboard

    run = fresh_copy("demo_k3", tmp_path)
    kldiag.analyze(run, kldiag.AnalysisConfig(), dashboard.reducers())
    assert max(opens.values()) == 1
    opens.clear()
    main(["report", str(run), "-o", str(tmp_path / "r.html")])
    assert "top offending tokens" in capsys.readouterr().out and dict(opens) == {}
