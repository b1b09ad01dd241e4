"""What the dashboard reads: every page's reducers, handed to `analyze` in one pass over the parts."""

from __future__ import annotations

from kldiag.analysis.types import AnalysisConfig
from kldiag.diagnosis.core import reducers as diagnosis_reducers
from kldiag.views.estimators import EstimatorReducer

DEFAULT_CONFIG = AnalysisConfig()


def reducers(config: AnalysisConfig = DEFAULT_CONFIG) -> list:
    """Everything the dashboard's pages read besides the analysis tables, as reducers for
    `analyze(run, config, reducers)`: one read of each part serves every page (the Sequence page
    alone reads the one part that holds its sequence)."""
    return [*diagnosis_reducers(), EstimatorReducer(config.tau, config.weight_limit, config.clamp)]
