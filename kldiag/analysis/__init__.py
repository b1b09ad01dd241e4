"""Streaming analysis of a run: `kldiag.analyze(run_dir, config=AnalysisConfig()) -> Analysis`.

The contract is types.py (AnalysisConfig, Analysis; column names documented in docs/metrics.md), the entry
point pipeline.py (`analyze`: every part read once, its partials cached, merged, the tables built). Every
pass over a run's tokens is a reducer on one protocol (protocol.py). The rooms, lowest first:

  kernels/    the compiled loops (numba only; internal)
  core/       the analysis's own reducer: one record batch -> partials -> tables
  cache/      what RUN/.kldiag keeps: merged prefixes, derived results
  runtime/    where reducers run: the runner, part reading, threads, Ray, lost parts
  reducers/   the side reducers (routing, staleness, tasks, turns, topk, scan, estimators)
  rules/      per-step alert rules, episodes, early warnings

Code outside kldiag.analysis imports this face, types, or a room's public modules (its __all__), never a
kernel. docs/architecture.md follows one batch through them. The CLI is kldiag/cli/analyze.py.
"""

from kldiag.analysis.pipeline import analyze, thresholds
from kldiag.analysis.types import Analysis, AnalysisConfig, Histograms

__all__ = ["Analysis", "AnalysisConfig", "Histograms", "analyze", "thresholds"]
