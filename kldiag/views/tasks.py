"""The dashboard's task selector: the per-step figures of one task (format v1.3's `task` column).

Data from kldiag/analysis/reducers/tasks.py (the diagnosis's `tasks` reducer, read along with the analysis);
shaped here into the frames the Overview and Mismatch pages already chart, so a page swaps its frame
for the selected task's and draws the same charts. No Streamlit.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from kldiag.analysis.reducers import tasks as TK
from kldiag.analysis.runtime.runner import reduced

ALL = "all tasks"
# the steps table's columns a task's figures give (kldiag.analysis.reducers.tasks.FIGURES), by the same names
STEP_FIGURES = tuple(f for f in TK.FIGURES if f != "tokens")
# the Mismatch page's per-step frame (kldiag.mismatch.decompose.by_step) from a task's figures
MISMATCH_FIGURES = {"drift_abs": "drift_abs_mean", "mismatch_abs": "mismatch_abs_mean"}


def _partial(analysis) -> dict:
    return reduced(analysis, TK.TaskReducer())


def names(analysis) -> list[str]:
    """The run's task labels, sorted ([] for a run without tasks)."""
    return [str(t) for t in _partial(analysis)["labels"]]


def choices(analysis) -> list[str]:
    """What the selector offers: ALL, then each task; [] (no selector) with fewer than two tasks."""
    found = names(analysis)
    return [ALL, *found] if len(found) > 1 else []


def overview_steps(analysis, steps: pd.DataFrame, task: str | None) -> pd.DataFrame:
    """The Overview's steps frame for `task`: steps and tokens of that task, the figures a task has
    (STEP_FIGURES) from its tokens, every other column NaN (its charts stay empty, not wrong). `steps`
    itself for ALL or None."""
    if task in (None, ALL):
        return steps
    one = TK.task_steps(_partial(analysis), task)
    out = pd.DataFrame({c: np.full(len(one["step"]), np.nan) for c in steps.columns if c != "step"})
    out.insert(0, "step", one["step"])
    out["tokens"] = one["tokens"]
    for c in STEP_FIGURES:
        if c in out:
            out[c] = one[c]
    return out


def mismatch_by_step(analysis, by_step: pd.DataFrame, task: str | None) -> pd.DataFrame:
    """The Mismatch page's drift-against-mismatch frame (step, drift_abs, mismatch_abs) for `task`, on every
    token of it (the page's own frame reads the token sample); `by_step` itself for ALL or None."""
    if task in (None, ALL):
        return by_step
    one = TK.task_steps(_partial(analysis), task)
    return pd.DataFrame({"step": one["step"], **{k: one[v] for k, v in MISMATCH_FIGURES.items()}})
