"""The report's content: the analysis, the diagnosis and the worst tokens of one run, as a `Report`.

The report judges nothing itself. Its verdict, its onset, what fired (the causes and alert
episodes), its recommendations (each cause's summary and fix, in the run's trainer's own option
names) and so `kldiag report --fail-on` all come from one `kldiag.diagnosis.Diagnosis`: the one
`kldiag analyze`, `kldiag watch` and the dashboard show. Its thresholds are DiagnosisConfig's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kldiag import estimators as E
from kldiag.analysis.cache import store
from kldiag.analysis.rules.episodes import DEFAULT_ESTIMATOR, LOSS_WEIGHT_COLUMN
from kldiag.analysis.runtime import context
from kldiag.diagnosis import diagnose
from kldiag.diagnosis.core import reducers as diagnosis_reducers
from kldiag.diagnosis.types import Diagnosis, DiagnosisConfig
from kldiag.fmt import metric
from kldiag.format import open_run


@dataclass(frozen=True)
class ReportConfig:
    """What the report shows. What judges the run is `diagnosis` (kldiag.diagnosis.DiagnosisConfig)."""

    top_tokens: int = 10  # offending tokens listed on the page
    context: int = 5  # tokens shown on each side of an offending token
    text_tokens: int = 5  # offending tokens printed in the text summary
    text_episodes: int = 12  # alert episodes printed in the text summary (the page lists every one)
    diagnosis: DiagnosisConfig = DiagnosisConfig()  # the thresholds, when build_report diagnoses the run


@dataclass
class Offender:
    """One offending token, in context."""

    step: int
    seq: int
    pos: int
    piece: str
    before: list[str]
    after: list[str]
    weight_k3: float
    weight_k3_is: float
    d: float  # log(pi_ref / pi_theta)


@dataclass
class Report:
    run_dir: Path | str  # a Path, or the URI of a remote run
    estimator: str
    estimator_assumed: bool  # the manifest did not say; DEFAULT_ESTIMATOR assumed
    verdict: str  # the diagnosis's: "healthy" | "warning" | "unstable"
    onset_step: int | None  # verdict_onset(diagnosis)
    first_moved: tuple[int, str, str] | None  # (step, metric, message) of the earliest episode
    offenders: list[Offender]
    comparison: list[dict[str, Any]]
    recommendations: list[str]  # fixes(diagnosis)
    facts: dict[str, Any] = field(default_factory=dict)
    analysis: Any = None
    diagnosis: Diagnosis | None = None  # the verdict, the causes (with fixes) and the episodes
    config: ReportConfig = ReportConfig()

    def fired(self) -> set[str]:
        """What fired: the diagnosis's cause names and episode kinds, whatever their severity."""
        return fired(self.diagnosis)


# ---- what the report takes from the Diagnosis ------------------------------------------------


def fired(dg: Diagnosis | None) -> set[str]:
    """The cause names and episode kinds present in a diagnosis (empty without one)."""
    if dg is None:
        return set()
    return {c.cause for c in dg.causes} | {e.kind for e in dg.episodes}


def verdict_onset(dg: Diagnosis) -> int | None:
    """The step the verdict starts at: the earliest onset among the causes of the verdict's
    severity (critical for unstable, warning for warning), else its earliest episode; None if healthy."""
    level = {"unstable": "critical", "warning": "warning"}.get(dg.verdict)
    starts = [c.onset for c in dg.causes if c.severity == level and c.onset is not None]
    starts = starts or [e.start for e in dg.episodes if e.severity == level]
    return min(starts, default=None)


def _unstop(text: str) -> str:
    """The text without its closing full stop; an ellipsis ("steps 0, 1, ...") is kept whole."""
    text = text.rstrip()
    return text if text.endswith("...") else text.rstrip(". ")


def _stop(text: str) -> str:
    """The text ending in one full stop (an ellipsis stands for it)."""
    text = _unstop(text)
    return text if text.endswith("...") else f"{text}."


def principal(dg: Diagnosis) -> str | None:
    """The headline: the verdict's principal cause (the diagnosis orders causes worst first, then by
    onset), 'k3_weight_blowup (critical, from step 36): <its summary up to the first ";">'; None when no
    cause is above info (a healthy run, or one whose warning comes from episodes alone)."""
    main = [c for c in dg.causes if c.severity != "info"]
    if not main:
        return None
    c = main[0]
    onset = f", from step {c.onset}" if c.onset is not None else ""
    head = _unstop(c.summary.split("; ", 1)[0]) if c.summary else ""
    return f"{c.cause} ({c.severity}{onset})" + (f": {head}" if head else "")


def first_moved(dg: Diagnosis) -> tuple[int, str, str] | None:
    """(step, metric, message) of the earliest episode: the metric that moved first."""
    if not dg.episodes:
        return None
    e = min(dg.episodes, key=lambda e: e.start)
    return int(e.start), e.metric or e.kind, e.message


def fixes(dg: Diagnosis) -> list[str]:
    """The recommendations: one per cause, worst first, its summary then its fix (phrased by the
    diagnosis in the run's trainer's own option names)."""
    out = []
    for c in dg.causes:
        onset = f", from step {c.onset}" if c.onset is not None else ""
        out.append(f"{c.cause} ({c.severity}{onset}): {_stop(c.summary)} Fix: {c.fix}")
    if out:
        return out
    seen = f" ({len(dg.episodes)} alert episode(s), none a cause)" if dg.episodes else ""
    return [f"Nothing to fix: the diagnosis names no cause{seen}."]


def fmt_weight_max(row: dict[str, Any]) -> str:
    return ("<= " if row.get("weight_bound") else "") + metric(row["weight_max"])


# ---- building the report from an Analysis --------------------------------------------------


def column(table, name: str, dtype=np.float64) -> np.ndarray:
    """A column as a numpy array with nulls as NaN (or zeros for counts); absent: all NaN."""
    if name not in table.column_names:
        return np.full(table.num_rows, np.nan)
    values = table.column(name).to_numpy(zero_copy_only=False)
    return np.asarray(values, dtype=dtype)


def has_reference(steps_table) -> bool:
    """Whether any token had a reference log-prob (the KL means are null without one)."""
    return bool(np.isfinite(column(steps_table, "k3_mean")).any())


def _weighted_mean(values: np.ndarray, tokens: np.ndarray) -> float:
    ok = np.isfinite(values) & (tokens > 0)
    return float(np.sum(values[ok] * tokens[ok]) / np.sum(tokens[ok])) if ok.any() else math.nan


def abs_bound(edges: np.ndarray, counts: np.ndarray) -> float:
    """An upper bound of |v| over a histogram (Histograms layout: bin 0 below edges[0], bin i
    in [edges[i-1], edges[i]), the last one at or above edges[-1]); 0 when it is empty."""
    lo = np.concatenate([[-np.inf], edges])
    hi = np.concatenate([edges, [np.inf]])
    used = np.flatnonzero(np.asarray(counts).reshape(-1, len(edges) + 1).sum(0))
    return float(np.max(np.maximum(np.abs(lo[used]), np.abs(hi[used])))) if len(used) else 0.0


def comparison(steps_table, histograms=None) -> list[dict[str, Any]]:
    """The estimators on the run's own tokens: mean value, its worst step, and max |weight|.

    k2's weight is s - r = -d: bounded here from the run's histogram of d (bin precision).
    """
    tokens = column(steps_table, "tokens")
    rows = []
    for name in ("k1", "k2", "k3", "k3_is"):
        mean = column(steps_table, f"{name}_mean")
        row = {"estimator": name, "mean": _weighted_mean(mean, tokens),
               "worst_step_mean": float(np.nanmax(mean)) if np.isfinite(mean).any() else math.nan,
               "weight_max": math.nan, "weight_p99": math.nan, "target": E.ESTIMATORS[name].target}
        if name == "k1":
            row["weight_max"] = row["weight_p99"] = 1.0
        if name == "k2" and histograms is not None and "d" in histograms.counts:
            row["weight_max"] = abs_bound(histograms.edges["d"], histograms.counts["d"])
            row["weight_bound"] = True
        if name in LOSS_WEIGHT_COLUMN:
            row["weight_max"] = float(np.nanmax(column(steps_table, f"weight_{name}_abs_max"), initial=0.0))
            row["weight_p99"] = float(np.nanmax(column(steps_table, f"weight_{name}_abs_p99"), initial=0.0))
        rows.append(row)
    return rows


def reducers(config: ReportConfig = ReportConfig()) -> list:
    """What the report reads besides the analysis tables, for `analyze(run, cfg, reducers(config))`:
    the diagnosis's side scan and token sample (its Mismatch sections and crosswalk share the sample).
    With them every part is read once, and never while cached; the offending tokens' context comes with the
    analysis's flagged rows (`offenders`)."""
    return list(diagnosis_reducers(config.diagnosis))


def offenders(analysis, limit: int, context_width: int) -> list[Offender]:
    """The tokens with the largest |k3 weight|, with `context_width` tokens on each side (as the analysis's
    pass kept them: analysis.runtime.context.of_flagged; kept in the run's result store)."""
    flags = analysis.flags
    if flags.num_rows == 0:
        return []
    w = np.abs(np.nan_to_num(column(flags, "weight_k3"), nan=0.0))
    order = np.argsort(-w, kind="stable")[:limit]
    rows = [flags.slice(int(i), 1).to_pylist()[0] for i in order]
    keys = [tuple(int(r[c]) for c in ("step", "rank", "seq", "iteration", "pos")) for r in rows]
    around = store.cached(analysis, "context", [keys, context_width],
                          lambda: context.of_flagged(analysis, keys, context_width))
    vocab = open_run(analysis.run_dir).vocab() or {}

    def piece(t: int | None) -> str:
        return "?" if t is None or t < 0 else vocab.get(t, f"<{t}>")

    out = []
    for r, key in zip(rows, keys, strict=True):
        before, after = around[key]
        text = r.get("piece") or piece(r.get("token_id"))
        out.append(Offender(int(r["step"]), int(r["seq"]), int(r["pos"]), text, [piece(x) for x in before],
                            [piece(x) for x in after], *(_float(r[k]) for k in ("weight_k3", "weight_k3_is", "d"))))
    return out


def _float(v) -> float:
    """A flags-table figure as a float: NaN where the run cannot give it (no logp_ref: no weight, no d)."""
    return math.nan if v is None else float(v)


def build_report(analysis, config: ReportConfig = ReportConfig(), diagnosis: Diagnosis | None = None) -> Report:
    """The post-mortem of one analysed run. `diagnosis`: the run's Diagnosis when the caller has
    one already (made with config.diagnosis), else diagnose(analysis, config.diagnosis)."""
    if diagnosis is None:
        diagnosis = diagnose(analysis, config.diagnosis)
    manifest_cfg = analysis.manifest.config or {}
    steps = analysis.steps
    facts = {"steps": steps.num_rows, "tokens": int(np.nansum(column(steps, "tokens"))),
             "beta": manifest_cfg.get("beta"), "blowup_weight": config.diagnosis.blowup_weight}
    worst = offenders(analysis, config.top_tokens, config.context)
    return Report(analysis.run_dir, manifest_cfg.get("estimator") or DEFAULT_ESTIMATOR,
                  not manifest_cfg.get("estimator"), diagnosis.verdict, verdict_onset(diagnosis),
                  first_moved(diagnosis), worst,
                  comparison(steps, analysis.histograms), fixes(diagnosis), facts, analysis, diagnosis, config)

