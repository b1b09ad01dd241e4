"""Live TensorBoard histograms from the TRL hook (opt in: `attach(trainer, run, histograms=True)`).

Between two of TRL's logs the hook bins the loss tokens of every micro-batch it records
(d, |k3 weight|, |k3_is weight|, rho, on the analysis' shared edges, HIST_EDGES); at each
log (`Trainer.log`, the moment TRL's own metrics go out) the counts become TensorBoard
histograms `kldiag/<name>` at `state.global_step` and are reset.

Where they go: `histograms=True` writes through the trainer's own TensorBoardCallback writer
(transformers integration_utils.py, `report_to="tensorboard"`: torch's SummaryWriter,
`add_histogram_raw`), so they land beside TRL's scalars and in W&B when it syncs
TensorBoard; a path writes its own event files there (tensorboard's EventFileWriter).
Only the main process writes, from its own tokens (ranks are not merged live; `kldiag
export tensorboard` afterwards has every rank).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from kldiag import estimators as E
from kldiag.analysis.core.bins import abs_bins, d_bins
from kldiag.analysis.types import HIST_EDGES
from kldiag.export.tensorboard import FILE_SUFFIX, PREFIX, histogram_fields, step_events, tensorboard_modules


def token_counts(logp: np.ndarray, logp_ref: np.ndarray | None, logp_old: np.ndarray | None,
                 mask: np.ndarray) -> dict[str, np.ndarray]:
    """Counts over HIST_EDGES bins of one micro-batch's loss tokens. Inputs [B, T]; logp_old None
    is on-policy (rho = 1); without logp_ref only rho is binned. NaN values are not binned."""
    keep = np.asarray(mask, dtype=bool)
    s = np.asarray(logp, dtype=np.float64)[keep]
    o = s if logp_old is None else np.asarray(logp_old, dtype=np.float64)[keep]
    values = {"rho": E.rho(s, o)}
    if logp_ref is not None:
        r = np.asarray(logp_ref, dtype=np.float64)[keep]
        with np.errstate(all="ignore"):
            values.update(d=E.log_ratio(s, r), weight_k3_abs=np.abs(E.weight_k3(s, r)),
                          weight_k3_is_abs=np.abs(E.weight_k3_is(s, r, o)))
    out = {}
    for name, v in values.items():
        v = np.asarray(v, dtype=np.float64)
        v = v[~np.isnan(v)]
        bins = d_bins(v) if name == "d" else abs_bins(np.abs(v))
        out[name] = np.bincount(bins, minlength=len(HIST_EDGES[name]) + 1)
    return out


class LiveHistograms:
    """Counts since the last log, written as TensorBoard histograms at each log."""

    def __init__(self, target: bool | str | os.PathLike):
        self.target = target
        self.counts: dict[str, np.ndarray] = {}
        self._own = None  # EventFileWriter when target is a path
        tensorboard_modules()  # the tensorboard package is needed either way: fail at attach, naming the extra

    def observe(self, logp: np.ndarray, logp_ref: np.ndarray | None, logp_old: np.ndarray | None,
                mask: np.ndarray) -> None:
        for name, c in token_counts(logp, logp_ref, logp_old, mask).items():
            self.counts[name] = self.counts[name] + c if name in self.counts else c

    def flush(self, trainer: Any) -> int:
        """Write the counts at trainer.state.global_step (main process only); returns histograms written."""
        counts, self.counts = self.counts, {}
        if not counts or not bool(getattr(trainer.accelerator, "is_main_process", True)):
            return 0
        step = int(trainer.state.global_step)
        fields = {n: f for n, c in counts.items() if (f := histogram_fields(c, HIST_EDGES[n])) is not None}
        writer = self._callback_writer(trainer) if self.target is True else None
        if writer is not None:
            for name, f in fields.items():
                writer.add_histogram_raw(PREFIX + name, f["min"], f["max"], f["num"], f["sum"], f["sum_squares"],
                                         f["bucket_limit"], f["bucket"], global_step=step)
            writer.flush()
            return len(fields)
        own = self._writer(trainer)
        for event in step_events(step, {}, fields):
            own.add_event(event)
        own.flush()
        return len(fields)

    def _callback_writer(self, trainer: Any) -> Any:
        """The SummaryWriter of the trainer's TensorBoardCallback, when it has one."""
        for cb in getattr(trainer.callback_handler, "callbacks", []):
            if type(cb).__name__ == "TensorBoardCallback":
                if getattr(cb, "tb_writer", None) is None and hasattr(cb, "_init_summary_writer"):
                    cb._init_summary_writer(trainer.args)
                return getattr(cb, "tb_writer", None)
        return None

    def _writer(self, trainer: Any) -> Any:
        if self._own is None:
            EventFileWriter, _, _ = tensorboard_modules()
            logdir = (os.path.join(trainer.args.output_dir, "kldiag_tensorboard") if self.target is True
                      else os.fspath(self.target))
            self._own = EventFileWriter(logdir, filename_suffix=FILE_SUFFIX)
        return self._own

    def close(self) -> None:
        if self._own is not None:
            self._own.close()
            self._own = None
