"""A cause's evidence names the task that carries it, when the run recorded task labels (format v1.3).

For a cause with a per-task figure (CAUSE_FIGURE), its figure per task over the steps from the cause's
onset (kldiag.analysis.reducers.tasks.by_task): the carrier is the one task whose figure is at least CARRY x every
other task's. Its name goes into evidence["task"], the figures per task into evidence["by_task"], and the
summary says so. Nothing changes on a run without tasks, or with one task only.
"""

from __future__ import annotations

import warnings

import numpy as np

from kldiag.analysis.reducers import tasks as T
from kldiag.analysis.runtime.runner import reduced
from kldiag.diagnosis.types import Cause

CARRY = 2.0  # the carrier's figure over every other task's
MIN_TOKENS = 100  # a task's figure needs this many tokens
CAUSE_FIGURE = {
    "k3_weight_blowup": "weight_k3_abs_max", "offpolicy_drift": "drift_abs_mean", "async_staleness": "drift_abs_mean",
    "engine_mismatch": "mismatch_kl", "engine_precision": "mismatch_kl", "engine_stale_weights": "mismatch_kl",
    "engine_async_lag": "mismatch_kl", "engine_wrong_token": "mismatch_kl", "engine_raw_logprobs": "mismatch_kl",
    "engine_temperature_mismatch": "mismatch_kl", "engine_truncated_sampling": "mismatch_kl",
    "engine_retokenization": "mismatch_kl",
}


def carrier(m: dict, figure: str, since: int | None) -> tuple[str | None, dict]:
    """(the task that carries `figure` from step `since`, or None; {task: figure} of tasks with enough tokens)."""
    bt = T.by_task(m, since)
    ok = [i for i, n in enumerate(bt["tokens"]) if n >= MIN_TOKENS and np.isfinite(bt[figure][i])]
    table = {bt["task"][i]: float(bt[figure][i]) for i in ok}
    if len(ok) < 2:
        return None, table
    v = np.array([bt[figure][i] for i in ok])
    top = int(np.argmax(v))
    rest = np.delete(v, top)
    return (bt["task"][ok[top]] if v[top] > 0 and v[top] >= CARRY * rest.max() else None), table


def name_carriers(analysis, causes: list[Cause]) -> None:
    """Add the carrying task to each cause's evidence and summary (in place); a failure is warned about."""
    wanted = [c for c in causes if c.cause in CAUSE_FIGURE]
    if not wanted:
        return
    try:
        m = reduced(analysis, T.TaskReducer())
    except Exception as e:  # the diagnosis never fails on its per-task split
        warnings.warn(f"kldiag: per-task split skipped ({type(e).__name__}: {e})", stacklevel=2)
        return
    if len(m["labels"]) < 2:
        return
    for c in wanted:
        name, table = carrier(m, CAUSE_FIGURE[c.cause], c.onset)
        c.evidence["by_task"] = {"figure": CAUSE_FIGURE[c.cause], "tasks": table}
        if name is not None:
            c.evidence["task"] = name
            c.summary += f" (carried by task {name!r})"
