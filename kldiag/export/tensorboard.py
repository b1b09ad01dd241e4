"""The analysis as TensorBoard scalars and histograms (behind `kldiag export tensorboard RUN LOGDIR`).

Every numeric column of the steps table becomes a scalar `kldiag/<column>`; the per-step
histograms of d, |k3 weight|, |k3_is weight| and rho (Analysis.histograms) become
TensorBoard histograms `kldiag/<name>`. Events go through the tensorboard package's own
EventFileWriter (tensorboard 2.x, tensorboard/summary/writer/event_file_writer.py: the
writer torch.utils.tensorboard.SummaryWriter wraps), so TensorBoard and W&B's
`wandb.init(sync_tensorboard=True)` / `wandb.tensorboard.patch(root_logdir=LOGDIR)` read them.

Incremental: LOGDIR/kldiag_export.json remembers the run and the last step written; a
second export appends a new events file with the newer steps only (the analysis itself is
incremental through RUN/.kldiag/). `hold_last` leaves the newest step for the next export,
for a run that may still be recording it.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from kldiag.analysis import analyze
from kldiag.analysis.types import Analysis, AnalysisConfig, Histograms
from kldiag.errors import ExportError

STATE_FILE = "kldiag_export.json"
PREFIX = "kldiag/"
FILE_SUFFIX = ".kldiag"


@dataclass
class ExportResult:
    """What one export wrote: steps first..last (None when nothing was new), the events file."""

    logdir: Path
    steps_written: int = 0
    first_step: int | None = None
    last_step: int | None = None
    events_file: Path | None = None
    scalars: int = 0
    histograms: int = 0


def tensorboard_modules() -> tuple[Any, Any, Any]:
    """(EventFileWriter, event_pb2, summary_pb2), or ExportError naming the extra."""
    try:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
    except ImportError as e:
        raise ExportError("kldiag export tensorboard needs the tensorboard package: "
                          "pip install 'kldiag[tensorboard]' (or pip install tensorboard)") from e
    return EventFileWriter, event_pb2, summary_pb2


# ---- pure maths: one binned histogram as TensorBoard's HistogramProto fields ------------


def histogram_fields(counts: np.ndarray, edges: np.ndarray) -> dict[str, Any] | None:
    """HistogramProto fields of one step's counts [len(edges) + 1] over `edges` (Histograms'
    bins: bin 0 below edges[0], bin i in [edges[i-1], edges[i]), the last at or above edges[-1]).

    bucket_limit is each kept bin's upper edge (the overflow bin's is its lower edge times 2
    for log edges, + 1 otherwise: TensorBoard needs a finite limit); empty bins at both ends
    are dropped. min/max are the outer edges of the first/last non-empty bin; sum and
    sum_squares use each bin's centre (geometric on log edges), so they are approximations.
    None when the step has no counts.
    """
    counts = np.asarray(counts, dtype=np.float64)
    used = np.flatnonzero(counts)
    if used.size == 0:
        return None
    log = bool(np.all(edges > 0))
    top = edges[-1] * 2.0 if log else edges[-1] + 1.0
    lo = np.concatenate([[0.0 if log else edges[0] - 1.0], edges])
    hi = np.concatenate([edges, [top]])
    if log:
        centre = np.where(lo > 0, np.sqrt(np.maximum(lo, 1e-300) * hi), hi / 2.0)
    else:
        centre = (lo + hi) / 2.0
    first, last = int(used[0]), int(used[-1]) + 1
    c, mid = counts[first:last], centre[first:last]
    return {"min": float(lo[first]), "max": float(hi[last - 1]), "num": float(c.sum()),
            "sum": float((c * mid).sum()), "sum_squares": float((c * mid * mid).sum()),
            "bucket_limit": hi[first:last].tolist(), "bucket": c.tolist()}


def scalar_columns(steps: pd.DataFrame) -> list[str]:
    """The steps table's numeric columns other than `step`: each one a scalar tag."""
    return [c for c in steps.columns if c != "step" and pd.api.types.is_numeric_dtype(steps[c])]


# ---- events -------------------------------------------------------------------------------


def step_events(step: int, values: dict[str, float], hists: dict[str, dict[str, Any]],
                wall_time: float | None = None) -> list[Any]:
    """TensorBoard Event protos of one step: one Summary with every scalar, one per histogram."""
    _, event_pb2, summary_pb2 = tensorboard_modules()
    wall = time.time() if wall_time is None else wall_time
    scalars = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=PREFIX + k, simple_value=float(v))
                                         for k, v in values.items()])
    events = [event_pb2.Event(wall_time=wall, step=int(step), summary=scalars)] if values else []
    for name, fields in hists.items():
        histo = summary_pb2.HistogramProto(**fields)
        value = summary_pb2.Summary.Value(tag=PREFIX + name, histo=histo)
        events.append(event_pb2.Event(wall_time=wall, step=int(step), summary=summary_pb2.Summary(value=[value])))
    return events


def _state(logdir: Path) -> dict[str, Any]:
    path = logdir / STATE_FILE
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ExportError(f"{path} is unreadable ({e}); delete it to export every step again") from e


def _save_state(logdir: Path, state: dict[str, Any]) -> None:
    tmp = logdir / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    os.replace(tmp, logdir / STATE_FILE)


def run_identity(run: str | os.PathLike) -> str:
    """How LOGDIR's state names its run: a local run by its resolved absolute path (the same run typed
    from any working directory, or through a symlink, is the same run), a URI without a trailing slash."""
    text = str(run)
    return text.rstrip("/") if "://" in text else str(Path(text).resolve())


def check_logdir(logdir: Path, run: str | os.PathLike) -> dict[str, Any]:
    """LOGDIR's state, after checking that LOGDIR is a directory (or new) and holds no other run's export."""
    if logdir.exists() and not logdir.is_dir():
        raise ExportError(f"LOGDIR {logdir} is a file: pass a directory (new, or this run's earlier export)")
    state = _state(logdir)
    if state and run_identity(state.get("run") or "") != run_identity(run):
        raise ExportError(f"{logdir} holds the export of another run ({state.get('run')}); "
                          "give each run its own LOGDIR (TensorBoard compares runs by subdirectory)")
    return state


def _hist_rows(hist: Histograms) -> dict[int, int]:
    return {int(s): i for i, s in enumerate(hist.steps.tolist())}


def write_analysis(a: Analysis, logdir: str | os.PathLike, run_id: str, hold_last: bool = False) -> ExportResult:
    """Append the steps of `a` newer than LOGDIR's last export as events; see the module doc."""
    EventFileWriter, _, _ = tensorboard_modules()
    logdir = Path(logdir)
    state = check_logdir(logdir, run_id)
    logdir.mkdir(parents=True, exist_ok=True)
    steps = a.steps.to_pandas()
    after = state.get("last_step")
    todo = steps if after is None else steps[steps["step"] > after]
    if hold_last and len(todo):
        todo = todo[todo["step"] < steps["step"].max()]
    out = ExportResult(logdir=logdir)
    if todo.empty:
        return out
    rows, cols = _hist_rows(a.histograms), scalar_columns(steps)
    before = set(logdir.glob("events.out.tfevents.*"))
    writer = EventFileWriter(str(logdir), filename_suffix=FILE_SUFFIX)
    try:
        for rec in todo.to_dict("records"):
            step = int(rec["step"])
            values = {c: rec[c] for c in cols if rec[c] is not None and not pd.isna(rec[c])}
            hists = {}
            if step in rows:
                for name, counts in a.histograms.counts.items():
                    fields = histogram_fields(counts[rows[step]], a.histograms.edges[name])
                    if fields is not None:
                        hists[name] = fields
            for event in step_events(step, values, hists):
                writer.add_event(event)
            out.scalars += len(values)
            out.histograms += len(hists)
    finally:
        writer.close()
    out.events_file = next(iter(sorted(set(logdir.glob("events.out.tfevents.*")) - before)), None)
    out.steps_written, out.first_step, out.last_step = len(todo), int(todo["step"].min()), int(todo["step"].max())
    _save_state(logdir, {"run": run_identity(run_id), "last_step": out.last_step, "written": time.time(),
                         "steps_exported": int(state.get("steps_exported", 0)) + out.steps_written})
    return out


def export_tensorboard(run: str | os.PathLike, logdir: str | os.PathLike, config: AnalysisConfig | None = None,
                       hold_last: bool = False) -> ExportResult:
    """Analyse RUN (incrementally) and append its new steps to LOGDIR as TensorBoard events."""
    tensorboard_modules()  # fail before analysing when tensorboard is missing
    check_logdir(Path(logdir), run)  # and when LOGDIR cannot take this run's export
    a = analyze(run, config)
    return write_analysis(a, logdir, str(a.run_dir), hold_last=hold_last)
