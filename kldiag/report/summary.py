"""The JSON summary of one run: what `kldiag analyze RUN --json` prints and the MCP server's tools return
(docs/metrics.md, "kldiag analyze RUN --json", lists the keys)."""

from __future__ import annotations

import math
import os
from typing import Any

from kldiag.analysis import analyze
from kldiag.analysis.core import coverage
from kldiag.analysis.core.flagged import run_flagged
from kldiag.analysis.reducers import contract as K
from kldiag.analysis.reducers import signal as SG
from kldiag.analysis.reducers import topk
from kldiag.analysis.reducers.coverage_table import coverage_of
from kldiag.analysis.reducers.routing import routing_of
from kldiag.analysis.reducers.staleness import OPSM_DELTA, StalenessReducer
from kldiag.analysis.reducers.staleness import summary as staleness_summary
from kldiag.analysis.reducers.tasks import TaskReducer
from kldiag.analysis.reducers.tasks import summary as tasks_summary
from kldiag.analysis.reducers.turns import turns_of
from kldiag.analysis.runtime import runner
from kldiag.analysis.types import Analysis, AnalysisConfig
from kldiag.diagnosis import diagnose
from kldiag.diagnosis.signal import beta_of
from kldiag.report.build import reducers as report_reducers
from kldiag.mismatch import whatif as W
from kldiag.views import mismatch as VM

FLAG_ROWS = 20  # worst tokens in the summary


def analyze_run(run_dir: str | os.PathLike, config: AnalysisConfig = AnalysisConfig()) -> Analysis:
    """The analysis `kldiag analyze` makes: with what the diagnosis and `kldiag report` read, in the
    same one read of each part (a report after it reads no whole part: only the row groups of its worst
    tokens' sequences), and the top-k figures."""
    return analyze(run_dir, config, [*report_reducers(), topk.TopkReducer()])


def json_default(v: Any) -> Any:
    if hasattr(v, "item"):
        return v.item()
    return str(v)


def clean(v: Any) -> Any:
    """JSON has no NaN or infinity: a missing value is null, an overflow the string "inf"."""
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else ("inf" if v > 0 else "-inf")
    return v


def clean_nested(v: Any) -> Any:
    """clean through dicts and lists (the top-k figures: bounds may be infinite)."""
    if isinstance(v, dict):
        return {k: clean_nested(x) for k, x in v.items()}
    if isinstance(v, list):
        return [clean_nested(x) for x in v]
    return clean(v)


def rows(table: Any) -> list[dict[str, Any]]:
    """A table's rows as JSON-able dicts (clean)."""
    return [{k: clean(v) for k, v in r.items()} for r in table.to_pylist()]


def summary(a: Analysis, diagnosis=None) -> dict[str, Any]:
    """What --json prints: run facts, the per-step table, alerts (episodes), worst tokens (first 20),
    the diagnosis (verdict and causes) and the per-turn figures; docs/metrics.md, "kldiag analyze RUN --json",
    lists the keys."""
    if diagnosis is None:
        diagnosis = diagnose(a)
    return {
        "run_dir": str(a.run_dir), "trainer": a.manifest.trainer, "config": a.manifest.config,
        "files": a.files, "files_new": a.files_new, "skipped": a.skipped,
        "lost_parts": [x.to_dict() for x in a.lost], "rows": a.info.get("rows"),
        "flagged": dict(zip(("count", "tokens"), run_flagged(a.steps), strict=True)),
        "steps": rows(a.steps),
        "alerts": [e.to_dict() for e in diagnosis.episodes],
        "diagnosis": diagnosis.to_dict(),
        "flags": rows(a.flags.slice(0, FLAG_ROWS)),
        "trainer_kl": a.trainer_kl.to_pylist() if a.trainer_kl is not None else None,
        "superseded": a.superseded.to_pylist() if a.superseded is not None else [],
        "cannot_compute": coverage.cannot_compute(a),
        "coverage": coverage_of(a, runner.reduced(a, topk.TopkReducer())),
        "placeholders": int(a.info.get("placeholders", 0)),
        "topk": clean_nested(topk.TopkReducer().result(runner.reduced(a, topk.TopkReducer()))),
        "turns": turns_of(a),
        "routing": routing_of(a),
        "staleness": staleness_summary(runner.reduced(a, StalenessReducer()), a.config.opsm_delta or OPSM_DELTA),
        "tasks": tasks_summary(runner.reduced(a, TaskReducer())),
        **contract_signal_whatif(a),
    }


def contract_signal_whatif(a: Analysis) -> dict[str, Any]:
    """The parity-contract counts ("contract"), the learning signal ("signal") and the what-if table at the default
    thresholds, each correction with its framework's loss denominator ("whatif"; docs/metrics.md)."""
    estimator = (a.manifest.config or {}).get("estimator") or "k3"
    c = runner.reduced(a, K.ContractReducer())
    with VM.held(a):  # the view (a store miss) and the replays read one token set
        view = VM.view_of(a)
        why = VM.whatif_missing(VM.whatif_frame(view, W.WhatIf()))
        whatif = None if why else [{k: clean(v) for k, v in r.items()} for r in VM.whatif_table(view)]
    return {"contract": {name: K.summary(c, i) for i, name in enumerate(K.CHECKS)},
            "signal": clean_nested(SG.summary(runner.reduced(a, SG.SignalReducer()), beta_of(a.manifest), estimator)),
            "whatif": whatif, **({"whatif_missing": why} if why else {})}
