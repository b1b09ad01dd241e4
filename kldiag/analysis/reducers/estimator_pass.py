"""The Estimators page's per-token pass, as the page's reducer (kldiag.views.estimators) uses it.

The compiled loop lives in kldiag.analysis.kernels.estimators (alone, `token_pass`) and
kldiag.analysis.kernels.ride (riding in the analysis's own pass, `EstimatorRide`); this module is
their public face: the entry points, the layout of their outputs (`Layout`), and the part reading
the reducer needs, so that no code outside kldiag.analysis imports a kernel module.
"""

from __future__ import annotations

from dataclasses import dataclass

from kldiag.analysis.core.batch import Batch, bools
from kldiag.analysis.core.stats import ABS_GRID
from kldiag.analysis.kernels import estimators as _K
from kldiag.analysis.kernels.ride import EstimatorRide
from kldiag.analysis.runtime.part_fold import PartFold, compute_part

token_pass = _K.token_pass
token_rows = _K.token_rows
token_rows_at = _K.token_rows_at


@dataclass(frozen=True)
class Layout:
    """Indices into the pass's outputs: float sums (F_*), integer counts (I_*), scalars (S_*); CHUNK rows a chunk."""

    CHUNK: int = _K.CHUNK
    F_VALUE: int = _K.F_VALUE
    F_WABS: int = _K.F_WABS
    F_WFLAG: int = _K.F_WFLAG
    F_WMAX: int = _K.F_WMAX
    I_NONFINITE: int = _K.I_NONFINITE
    S_CLAMP: int = _K.S_CLAMP
    S_FLAGGED: int = _K.S_FLAGGED
    S_TOKENS: int = _K.S_TOKENS
    S_TOP: int = _K.S_TOP
    S_WORST: int = _K.S_WORST


LAYOUT = Layout()

__all__ = ["ABS_GRID", "LAYOUT", "Batch", "EstimatorRide", "PartFold", "bools", "compute_part", "token_pass",
           "token_rows", "token_rows_at"]
