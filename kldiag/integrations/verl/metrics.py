"""The `kldiag/...` metrics the verl hook adds to the metrics verl's trainer logs (W&B, TensorBoard, console).

The same figures as the TRL hook's (kldiag.integrations.trl.metrics.log_metrics), per recorded step:

- Worker side (`report`, in the process that runs the recording loss): the recorder's writer
  thread computes each recorded micro-batch's partial sums (trl_metrics.batch_partials) from the
  host copies it writes and merges them into a window (step_metrics.StepWindow). The loss never
  waits for it: at the first loss call of step s, if the writer has converted every batch
  recorded so far (checked, not waited for), the window is exactly step s-1 on this rank and its
  partials go into that call's metrics dict under `kldiag_partials/...`; if not, the call reports `kldiag_partials/late_max` = 1, as does the
  next call (its window holds the rest of both steps): those steps are left out of the tracker
  (the run keeps every row).
- verl carries loss metrics to the driver as it does its own (verl 0.9.1, workers/engine/utils.py
  `postprocess_batch_func`, engine_workers.py `_postprocess_output` (all-gather over DP) and
  `train_mini_batch`), and the driver's `_update_actor` reduces them with
  `verl.utils.metric.reduce_metrics` (trainer_base.py l. 1860-1864): plain floats, mean over
  the ranks unless the key holds "max" (max) or "min" (min). Every recording rank reports once
  per step, so a ratio of two means is the ratio of the sums over ranks, a `*_max` is the
  maximum, and a count is the mean times the DP world size.
- Driver side (`finish`, called by kldiag's trainer subclass after verl's `_update_actor`): pops
  the `actor/kldiag_partials/...` keys and adds `kldiag/...` (log_metrics) plus `kldiag/step`,
  the recorded step the figures describe.

So the figures of step s reach verl's tracker with step s+1's metrics (`kldiag/step` = s), and
those of the last step of a run only the run itself.
"""

from __future__ import annotations

from typing import Any

from kldiag.integrations.common.step_metrics import SUM_KEYS, StepWindow
from kldiag.integrations.trl.metrics import METRIC_PREFIX, log_metrics

PARTIALS = "kldiag_partials/"  # what the loss reports; verl's driver prefixes it with "actor/"
_DRIVER = "actor/" + PARTIALS


def report(window: StepWindow, step: int, world: int) -> dict[str, float]:
    """The loss metrics of the first loss call after `step` ended on this rank (never waits)."""
    partials = window.take()
    out = {"step_min": float(step), "step_max": float(step), "late_max": 0.0 if partials is not None else 1.0,
           "world_min": float(world), "has_ref_min": float(window.has_ref), **(partials or {})}
    return {PARTIALS + k: float(v) for k, v in out.items()}


def finish(metrics: dict[str, Any]) -> dict[str, float]:
    """Driver: replace verl's reduced `actor/kldiag_partials/...` in `metrics` by the `kldiag/...` figures.

    Returns what was added: nothing when no rank reported, when a rank was late, or when the
    ranks reported different steps.
    """
    p = {k[len(_DRIVER):]: float(metrics.pop(k)) for k in [k for k in metrics if k.startswith(_DRIVER)]}
    if not p or p.get("late_max", 1.0) != 0.0 or p["step_min"] != p["step_max"] or "tokens" not in p:
        return {}
    world = p["world_min"]
    for k in SUM_KEYS:
        p[k] *= world  # verl averaged them over the ranks
    out = log_metrics(p, bool(p["has_ref_min"])) | {METRIC_PREFIX + "step": p["step_min"]}
    metrics.update(out)
    return out
