"""Flagged tokens, defined once (docs/metrics.md, "Flagged tokens"): a token in the loss with at least one
per-token flag (kldiag.estimators.flagged). Every face shows the run's figure from here, or says which
subset it shows ("the 1,000 worst of 6,229 flagged")."""

from __future__ import annotations

from typing import Any

import numpy as np


def _column(steps: Any, name: str) -> np.ndarray:
    col = steps[name] if hasattr(steps, "columns") else steps.column(name)  # pandas or pyarrow
    values = col.to_numpy() if hasattr(col, "to_numpy") else np.asarray(col)
    return np.asarray(values, dtype=np.float64)


def run_flagged(steps: Any) -> tuple[int, int]:
    """(flagged tokens, tokens in the loss) of a run, from its steps table (pyarrow or pandas):
    sum over steps of flagged_frac x tokens (a step's exact count: its fraction is count / tokens),
    over the sum of tokens."""
    if steps is None or len(steps) == 0:
        return 0, 0
    tokens = np.nan_to_num(_column(steps, "tokens"))
    frac = np.nan_to_num(_column(steps, "flagged_frac"))
    return int(np.rint(frac * tokens).sum()), int(tokens.sum())


def flagged_text(count: int, tokens: int) -> str:
    """'6,229 of 102,400 tokens in the loss (6.083%)': the run's flagged figure as every face words it."""
    share = f"{100 * count / tokens:.3f}%" if tokens else "no token"
    return f"{count:,} of {tokens:,} tokens in the loss ({share})"


def subset_text(shown: int, count: int) -> str:
    """'the 1,000 worst of 6,229 flagged' (or 'all 12 flagged'): for a view that lists only some."""
    return f"all {count:,} flagged" if shown >= count else f"the {shown:,} worst of {count:,} flagged"
