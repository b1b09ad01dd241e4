"""The `kldiag/...` metrics the slime hook adds to slime's logged train-step metrics (W&B, TensorBoard, console).

Read at THUDM/slime@624b824a. slime packs each micro-batch's loss log into one tensor
`[n, *log.values()]` keyed by the first micro-batch's `keys` (backends/megatron_utils/loss.py
l. 1363-1380), sums it over micro-batches and all-reduces it over data x context parallel, then
divides every value by one constant D (the step's tokens x cp_size, or its global batch size:
observability/train_metric_utils.py `reduce_train_step_metrics`); `train` (model.py l. 876-898)
logs `train/<key>` with `logging_utils.log(args, log_dict, step_key="train/step")`.

So every rank returns the same keys, in the same order, at every loss call (zeros when it has
nothing to say), and the figures survive that reduction as follows. At the first loss call of a
rollout, each recording rank (kldiag.integrations.slime: TP 0, CP 0, last stage) reports the
previous rollout's partial sums (step_metrics.StepWindow, from the writer thread, never waited
for): `unit` = 1 from data-parallel rank 0 only, so unit's logged value is 1/D and every
logged sum divided by it is the sum over ranks; maxima go to one slot per data-parallel rank
(`rho_max@r`), the maximum of the slots over unit. `finish`, which kldiag wraps around
`logging_utils.log`, turns the `train/kldiag_partials/...` values into `kldiag/...` (trl_metrics
.log_metrics) plus `kldiag/step` (the rollout the figures describe) before slime logs them.

The figures of rollout r reach the tracker with the first train step of rollout r+1; a late writer
(batches of r not yet converted) leaves r and r+1 out (the run keeps every row); the last rollout's
figures are only in the run.
"""

from __future__ import annotations

from typing import Any

from kldiag.integrations.common.step_metrics import MAX_KEYS, SUM_KEYS, StepWindow
from kldiag.integrations.trl.metrics import METRIC_PREFIX, log_metrics

PARTIALS = "kldiag_partials/"
_FLAGS = ("unit", "ranks", "late", "step", "has_ref")


def keys(world: int) -> list[str]:
    """The loss-log keys every rank returns, in order (world: data-parallel ranks)."""
    return [PARTIALS + k for k in (*_FLAGS, *SUM_KEYS, *(f"{m}@{r}" for m in MAX_KEYS for r in range(world)))]


def report(window: StepWindow | None, step: int, dp_rank: int, world: int) -> dict[str, float]:
    """This rank's values for `keys(world)`: the previous rollout (`step`) from `window`, or zeros
    (window None: a rank that records nothing, or any loss call but a rollout's first)."""
    out = dict.fromkeys(keys(world), 0.0)
    if window is None:
        return out
    partials = window.take()
    flags = {"unit": float(dp_rank == 0), "ranks": 1.0, "late": float(partials is None), "step": float(step),
             "has_ref": float(window.has_ref)}
    out.update({PARTIALS + k: v for k, v in flags.items()})
    if partials is not None:
        out.update({PARTIALS + k: float(partials[k]) for k in SUM_KEYS})
        out.update({f"{PARTIALS}{m}@{dp_rank}": float(partials[m]) for m in MAX_KEYS})
    return out


def finish(log_dict: dict[str, Any]) -> dict[str, float]:
    """Replace slime's reduced `train/.../kldiag_partials/...` in `log_dict` by the `kldiag/...`
    figures (in place); returns what was added (nothing when no rank reported or one was late)."""
    found = {k: k.split(PARTIALS, 1)[1] for k in log_dict if PARTIALS in k}
    p = {name: float(log_dict.pop(k)) for k, name in found.items()}
    if not p or p.get("unit", 0.0) <= 0.0 or p.get("late", 1.0) != 0.0:
        return {}
    unit = p["unit"]  # 1/D, D slime's divisor
    sums = {k: p[k] / unit for k in SUM_KEYS}
    maxima = {m: max(v / unit for k, v in p.items() if k.startswith(m + "@")) for m in MAX_KEYS}
    out = log_metrics(sums | maxima, p["has_ref"] > 0.0)
    out[METRIC_PREFIX + "step"] = float(round(p["step"] / p["ranks"]))
    log_dict.update(out)
    return out


def install_log_hook() -> bool:
    """Wrap slime's `logging_utils.log` (once per process) so that `finish` runs on each logged step."""
    from slime.observability import logging_utils

    original = logging_utils.log
    if getattr(original, "kldiag_finish", False):
        return False

    def log(args: Any, metrics: dict, step_key: str, *a: Any, **kw: Any) -> Any:
        try:
            finish(metrics)
        except Exception:  # noqa: BLE001 - a bad figure never stops slime's own logging
            pass
        return original(args, metrics, step_key, *a, **kw)

    log.kldiag_finish = True  # type: ignore[attr-defined]
    logging_utils.log = log
    return True
