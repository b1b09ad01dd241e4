"""Per-step `kldiag/...` figures computed in the recorder's writer thread, for hooks whose trainer logs
once per step (verl_metrics, slime_metrics): the same partial sums and metrics as the TRL hook's
(trl_metrics.batch_partials, log_metrics), never waited for on the training thread."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from kldiag.integrations.trl.metrics import _MAX_KEYS, _SUM_KEYS, batch_partials, merge_partials, warm_kernel

SUM_KEYS, MAX_KEYS = _SUM_KEYS, _MAX_KEYS  # partials summed / maximised across batches and ranks


def empty_partials() -> dict[str, float]:
    """The partials of no token (what a rank without rows in a step reports)."""
    return batch_partials(np.zeros((0, 0), np.float32), None, None, np.zeros((0, 0), bool))


class StepWindow:
    """Partial sums of the batches the writer converted since the last `take` (one per recording process).

    The writer calls `observe` with each recorded batch's host columns; the training thread calls
    `take` once per step, before recording the step's first batch: the window then holds the
    previous step only, if the writer has converted every batch recorded so far (checked, not
    waited for). When it has not, that step and the next are late: the batches still in flight
    would land in the next window.
    """

    def __init__(self, recorder: Any):
        warm_kernel()  # compiled (or loaded from numba's cache) now, not in the writer beside the first steps
        self.recorder = recorder
        self.window: dict[str, float] | None = None
        self.has_ref = False
        self.lock = threading.Lock()
        self.error: BaseException | None = None
        self.stale = False
        recorder.observe(self.observe)

    def observe(self, columns: dict[str, Any]) -> None:
        """Writer thread: merge one recorded batch (the columns the recorder writes)."""
        try:
            mask = columns["mask"] if "mask" in columns else columns["completion"]
            p = batch_partials(columns["logp"], columns.get("logp_ref"), columns.get("logp_old"), mask,
                               columns.get("logp_sampler"))
        except Exception as e:  # noqa: BLE001 - the step is reported late, never an error in the writer
            self.error = e
            return
        with self.lock:
            self.window = p if self.window is None else merge_partials(self.window, p)
            self.has_ref = self.has_ref or "logp_ref" in columns

    def take(self) -> dict[str, float] | None:
        """The previous step's partials (empty_partials() when it had no row), or None when late."""
        converted = self.recorder.wait_converted(0.0) and self.error is None
        ready, self.stale = converted and not self.stale, not converted
        with self.lock:
            window, self.window, self.error = self.window, None, None
        if not ready:
            return None
        return window if window is not None else empty_partials()
