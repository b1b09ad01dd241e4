"""Streaming analysis of a run: `kldiag.analyze(run_dir, config=AnalysisConfig()) -> Analysis`.

Modules: types (the contract: AnalysisConfig, Analysis), engine (analyze), reduce and runner (the
reducer protocol and the one engine that runs reducers per part, cached), worker, engines and
ray_engine (where a part's work runs), kernel/fused/fastexp/bins/stats/scans (one record batch ->
partials), keyed/partials/prefix (mergeable partial results and their caches), tables/alerts (the
result), episodes (the alert rules), context (the tokens around the worst ones), coverage (what a
run cannot give), slime_kl/verl_kl (a framework's own KL). The CLI is kldiag/cli/analyze.py.
Metrics are documented in docs/metrics.md.
"""

from kldiag.analysis.engine import analyze
from kldiag.analysis.types import Analysis, AnalysisConfig

__all__ = ["Analysis", "AnalysisConfig", "analyze"]
