"""What the dashboard reads: every page's reducers, handed to `analyze` in one pass over the parts."""

from __future__ import annotations

from kldiag.analysis.types import AnalysisConfig
from kldiag.diagnosis.core import reducers as diagnosis_reducers
from kldiag.views.estimators import EstimatorReducer

DEFAULT_CONFIG = AnalysisConfig()


def reducers(config: AnalysisConfig = DEFAULT_CONFIG) -> list:
    """What the dashboard's pages read besides the analysis tables, as reducers for
    `analyze(run, config, reducers)`: one read of each part serves the Overview, Distributions, Tokens,
    Mismatch (with its per-turn chart: the diagnosis's `turns` reducer) and Compare pages. The Sequence
    page reads the one part that holds its sequence, and the Estimators page its own reducer
    (`estimator_reducer`) on its first visit, once: it costs about 20x the analysis per token (numpy),
    too much to make every first render wait for it."""
    return diagnosis_reducers()


def estimator_reducer(config: AnalysisConfig = DEFAULT_CONFIG) -> EstimatorReducer:
    """The Estimators page's reducer (cached per part like every reducer: read once, then never)."""
    return EstimatorReducer(config.tau, config.weight_limit, config.clamp)
