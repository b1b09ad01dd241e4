"""The Estimators page's off-policy sequence mask (DeepSeek-V3.2; TRL's `off_policy_mask_threshold`):
what share of sequences it drops at each delta, over the run and per step.

From `Analysis.opsm` (kldiag.analysis.types.OpsmCounts: per-step counts at every delta of OPSM_DELTAS,
made in the analysis from its per-sequence rows), so the page holds no row per sequence. Shares are of
the sequences with an advantage, as the step table's opsm_masked_frac.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from kldiag.analysis.core.tables import ratio
from kldiag.analysis.types import OpsmCounts
from kldiag.errors import KldiagError


def column(counts: OpsmCounts, delta: float) -> int:
    """The index of `delta` in the counted grid."""
    for i, d in enumerate(counts.deltas):
        if d == delta:
            return i
    raise KldiagError(f"delta {delta:g} is not counted: pick one of {', '.join(f'{d:g}' for d in counts.deltas)}")


def summary(counts: OpsmCounts, delta: float) -> tuple[int, int]:
    """(sequences masked at `delta`, sequences with an advantage) over the whole run."""
    return int(counts.masked[:, column(counts, delta)].sum()), int(counts.known.sum())


def by_step(counts: OpsmCounts, delta: float) -> pd.DataFrame:
    """step, masked_frac: the share of each step's sequences with an advantage that the mask drops
    (NaN where the step has none)."""
    return pd.DataFrame({"step": counts.step.astype(np.int64),
                         "masked_frac": ratio(counts.masked[:, column(counts, delta)], counts.known)})


def curve(counts: OpsmCounts, deltas: Sequence[float] | None = None) -> pd.DataFrame:
    """delta, masked_frac over the run, for each delta (default: every counted delta above 0)."""
    deltas = [d for d in counts.deltas if d > 0] if deltas is None else list(deltas)
    known = counts.known.sum()
    frac = [float(ratio(counts.masked[:, column(counts, d)].sum(), known)) for d in deltas]
    return pd.DataFrame({"delta": deltas, "masked_frac": frac})
