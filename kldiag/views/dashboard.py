"""What the dashboard reads: every page's reducers, handed to `analyze` in one pass over the parts."""

from __future__ import annotations

from kldiag.analysis.types import AnalysisConfig
from kldiag.diagnosis.core import reducers as diagnosis_reducers
from kldiag.views.estimators import EstimatorReducer

DEFAULT_CONFIG = AnalysisConfig()


def reducers(config: AnalysisConfig = DEFAULT_CONFIG) -> list:
    """What the dashboard's pages read besides the analysis tables, as reducers for
    `analyze(run, config, reducers)`: one read of each part serves the Overview, Distributions, Tokens,
    Mismatch (with its per-turn chart: the diagnosis's `turns` reducer), Estimators (`estimator_reducer`,
    one compiled pass per batch) and Compare pages. Only the Sequence page reads a part again: the one
    that holds its sequence."""
    return [*diagnosis_reducers(), estimator_reducer(config)]


def estimator_reducer(config: AnalysisConfig = DEFAULT_CONFIG) -> EstimatorReducer:
    """The Estimators page's reducer (read in the analysis's pass with `reducers()`, cached per part)."""
    return EstimatorReducer(config.tau, config.weight_limit, config.clamp)
