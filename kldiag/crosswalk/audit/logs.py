"""What a trainer logged, read back per metric and step: TensorBoard events, HF/TRL trainer_state.json,
a W&B history export (CSV or JSON lines) and generic JSON-lines metric files.

    logs = read_logs("out/checkpoint-4")        # -> Logs(kind="trainer_state", series={"kl": {1: 0.0012, ...}})

Sources (the kind is detected from SRC, `kind=` forces one):
- "tensorboard": a directory holding events.out.tfevents.* files (searched recursively, e.g.
  output_dir/runs/<date>/), read with tensorboard's EventAccumulator; the HF Trainer's
  TensorBoardCallback (transformers `integrations/integration_utils.py`, `rewrite_logs`) writes
  "train/<key>" at step state.global_step.
- "trainer_state": trainer_state.json (HF `TrainerState.save_to_json`) or a checkpoint directory
  holding one; `log_history` is a list of {"step": global_step, "<key>": value, ...}.
- "csv": a W&B history export (`run.history().to_csv()` or the UI's CSV), one row per logged step.
- "jsonl": one JSON object per line (W&B `run.scan_history()` dumped, or any metric file), or a .json
  holding a list of such objects.
The step of a CSV / JSON-lines row is its first column of STEP_KEYS: the HF WandbCallback logs
"train/global_step" (W&B's own "_step" counts log calls, not optimizer steps).
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from kldiag.errors import KldiagError

KINDS = ("tensorboard", "trainer_state", "csv", "jsonl")
STEP_KEYS = ("train/global_step", "trainer/global_step", "global_step", "step", "_step")
PREFIXES = ("train/", "training/", "trainer/", "charts/", "metrics/")  # logger prefixes, stripped only on a match


class LogsError(KldiagError, ValueError):
    """A metric log kldiag cannot read: an unknown kind, a file without steps, no metric in it."""


@dataclass(frozen=True)
class Logs:
    """series: {logged name: {step: value}} (a value may be NaN: the trainer logged a NaN)."""

    kind: str
    path: str
    series: dict[str, dict[int, float]] = field(default_factory=dict)


def _number(value) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value.strip():
        try:
            return float(value)  # "NaN", "inf" as pandas and W&B write them
        except ValueError:
            return None
    return None


def _add(series: dict[str, dict[int, float]], row: dict, step_key: str | None = None) -> None:
    """One logged row {key: value} into series; the row's step from step_key or STEP_KEYS."""
    keys = (step_key,) if step_key else STEP_KEYS
    step = next((_number(row.get(k)) for k in keys if _number(row.get(k)) is not None), None)
    if step is None or not math.isfinite(step):
        return
    for key, value in row.items():
        v = _number(value)
        if v is not None and key not in STEP_KEYS:
            series.setdefault(key, {})[int(step)] = v  # a later row of the same step wins, as in the UI


def _trainer_state(path: Path) -> dict[str, dict[int, float]]:
    try:
        state = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise LogsError(f"{path}: not a readable trainer_state.json ({e}); pass the file HF Trainer wrote "
                        "(output_dir/checkpoint-N/trainer_state.json)") from e
    history = state.get("log_history") if isinstance(state, dict) else None
    if not isinstance(history, list):
        raise LogsError(f"{path}: no log_history list; is this an HF TrainerState JSON?")
    series: dict[str, dict[int, float]] = {}
    for row in history:
        if isinstance(row, dict):
            _add(series, row, "step")
    return series


def _jsonl(path: Path) -> dict[str, dict[int, float]]:
    text = path.read_text()
    series: dict[str, dict[int, float]] = {}
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        whole = None
    rows = whole if isinstance(whole, list) else None
    if rows is None:
        rows = []
        for i, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise LogsError(f"{path}:{i}: not JSON ({e}); write one JSON object per line") from e
    for row in rows:
        if isinstance(row, dict):
            _add(series, row)
    return series


def _csv(path: Path) -> dict[str, dict[int, float]]:
    series: dict[str, dict[int, float]] = {}
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            _add(series, row)
    return series


def _tensorboard(path: Path) -> dict[str, dict[int, float]]:
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError as e:
        raise LogsError("reading TensorBoard events needs the tensorboard package: pip install tensorboard") from e
    series: dict[str, dict[int, float]] = {}
    dirs = sorted({p.parent for p in path.rglob("events.out.tfevents*")})
    for d in dirs:
        acc = EventAccumulator(str(d), size_guidance={"scalars": 0, "tensors": 0})
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            for ev in acc.Scalars(tag):
                series.setdefault(tag, {})[int(ev.step)] = float(ev.value)
        for tag in acc.Tags().get("tensors", []):  # TF2-style summaries store a scalar as a 0-d tensor
            for ev in acc.Tensors(tag):
                vals = ev.tensor_proto.float_val or ev.tensor_proto.double_val
                if len(vals) == 1:
                    series.setdefault(tag, {})[int(ev.step)] = float(vals[0])
    return series


def detect(src: str | Path) -> tuple[str, Path]:
    """(kind, the file or directory to read) of SRC; LogsError naming the accepted sources otherwise."""
    p = Path(src)
    if not p.exists():
        raise LogsError(f"{src}: no such file or directory; pass a TensorBoard log dir, a trainer_state.json "
                        "(or its checkpoint dir), a W&B history .csv or a .jsonl metric file")
    if p.is_dir():
        if (p / "trainer_state.json").is_file():
            return "trainer_state", p / "trainer_state.json"
        if next(p.rglob("events.out.tfevents*"), None) is not None:
            return "tensorboard", p
        ckpts = sorted(p.glob("checkpoint-*/trainer_state.json"), key=lambda q: _ckpt_number(q.parent))
        if ckpts:
            return "trainer_state", ckpts[-1]  # the last checkpoint's history holds every earlier step
        raise LogsError(f"{src}: a directory with neither events.out.tfevents* files nor a trainer_state.json; "
                        "pass the TensorBoard log dir (e.g. output_dir/runs) or a checkpoint dir")
    name = p.name.lower()
    if name.endswith(".csv"):
        return "csv", p
    if name.endswith((".jsonl", ".ndjson")):
        return "jsonl", p
    if name.endswith(".json"):
        text = p.read_text()
        return ("trainer_state" if text.lstrip().startswith("{") and '"log_history"' in text else "jsonl"), p
    if name.startswith("events.out.tfevents"):
        return "tensorboard", p.parent
    raise LogsError(f"{src}: unknown log format; pass a TensorBoard log dir, trainer_state.json, a W&B history "
                    f".csv or a .jsonl/.json metric file (from Python, force one with kind= {' / '.join(KINDS)})")


def _ckpt_number(p: Path) -> int:
    tail = p.name.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else -1


READERS = {"tensorboard": _tensorboard, "trainer_state": _trainer_state, "csv": _csv, "jsonl": _jsonl}


def read_logs(src: str | Path, kind: str | None = None) -> Logs:
    """Every numeric metric SRC holds, per step (see the module docstring for the sources)."""
    if kind is not None and kind not in KINDS:
        raise LogsError(f"unknown log kind {kind!r}: use one of {', '.join(KINDS)}")
    found, path = detect(src) if kind is None else (kind, Path(src))
    series = READERS[found](path)
    if not series:
        raise LogsError(f"{src}: read as {found}, but it holds no numeric metric with a step "
                        f"(a step column is one of {', '.join(STEP_KEYS)})")
    return Logs(found, str(path), series)


def match_names(logged: list[str] | set[str], columns: list[str]) -> dict[str, str]:
    """{crosswalk column: logged name}. A logged name matches as it is ("actor/kl_loss"); a logger's
    prefix (PREFIXES, e.g. W&B/TensorBoard "train/kl") is stripped only when that makes it a column.
    An exact match wins over a stripped one."""
    out: dict[str, str] = {}
    cols = set(columns)
    for name in sorted(logged):
        if name in cols:
            out[name] = name
    for name in sorted(logged):
        for prefix in PREFIXES:
            bare = name[len(prefix):]
            if name.startswith(prefix) and bare in cols and bare not in out:
                out[bare] = name
    return out
