"""Streaming analysis of a run: `kldiag.analyze(run_dir, config=AnalysisConfig()) -> Analysis`.

Modules: types (the contract), kernel/tokens/stats (one record batch -> partials),
keyed/partials (mergeable partial results and their cache), tables/alerts (the result),
engine (orchestration), cli (`kldiag analyze`). Metrics are documented in docs/metrics.md.
"""

from kldiag.analysis.engine import analyze
from kldiag.analysis.types import Analysis, AnalysisConfig

__all__ = ["Analysis", "AnalysisConfig", "analyze"]
