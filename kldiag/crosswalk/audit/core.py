"""Audit: does what a trainer logged mean what its name says? The logged values of each framework
metric against kldiag's recomputation of it from the recorded tokens (kldiag.crosswalk), per step.

    from kldiag.crosswalk.audit import audit
    result = audit("runs/r1", "out/checkpoint-4", framework="trl")   # -> AuditResult
    [m.name for m in result.disagreements]

A metric agrees when every compared step has |logged - recomputed| <= rtol * max(|recomputed|,
atol / rtol). A disagreeing step gets the reasons (kldiag.crosswalk.audit.reasons) whose alternative
recomputation matches the logged value by the same rule; none: "unexplained". Step alignment:
kldiag step = logged step + step_offset (0 for kldiag's TRL and verl hooks: both record the step the
trainer logs at). The JSON shape of AuditResult.to_dict() is documented in docs/audit.md.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from kldiag.crosswalk import (crosswalk, loss_calls, module, null_reasons, parse_settings,
                              require_framework)
from kldiag.crosswalk.audit import reasons as R
from kldiag.crosswalk.audit.logs import Logs, LogsError, match_names, read_logs
from kldiag.crosswalk.batch import StepBatch, pad
from kldiag.format import open_run
from kldiag.mismatch import tokenset as TS

RTOL = 1e-4  # float32 logging: ~6e-8 rounding of the value, ~1e-6 from float32 sums over a step's tokens
ATOL = 1e-7  # float32 eps at 1: the absolute error of exp(x) - x - 1 style terms when the value is near 0
VERDICTS = ("agree", "disagree", "not_recomputable")


class AuditError(LogsError):
    """An audit that cannot run: no logged metric the crosswalk knows, or no step in common."""


@dataclass(frozen=True)
class MetricAudit:
    """One metric: `name` (the crosswalk column) logged as `logged_name`. series: (kldiag step,
    logged or None, recomputed or None) for each step in the log or the crosswalk."""

    name: str
    logged_name: str
    verdict: str
    steps: int = 0  # steps compared
    max_rel_diff: float | None = None
    max_abs_diff: float | None = None
    reason: str | None = None  # one of audit_reasons.REASONS, "mixed", or None when it agrees
    differing_steps: tuple[int, ...] = ()
    step_reasons: dict[int, tuple[str, ...]] = field(default_factory=dict)
    note: str | None = None  # why kldiag cannot recompute it (not_recomputable)
    series: tuple[tuple[int, float | None, float | None], ...] = ()


@dataclass(frozen=True)
class AuditResult:
    run: str
    logs: str
    logs_kind: str
    framework: str
    step_offset: int
    rtol: float
    atol: float
    metrics: tuple[MetricAudit, ...]
    unmatched: tuple[str, ...] = ()  # logged names that are no crosswalk column (not audited)

    @property
    def disagreements(self) -> list[MetricAudit]:
        return [m for m in self.metrics if m.verdict == "disagree"]

    def to_dict(self, series: bool = True) -> dict[str, Any]:
        """The `kldiag audit --json` object (docs/audit.md); NaN/inf become None."""
        d = asdict(self)
        for m in d["metrics"]:
            m["step_reasons"] = {str(k): list(v) for k, v in m["step_reasons"].items()}
            m["differing_steps"] = list(m["differing_steps"])
            m["series"] = [{"step": s, "logged": _finite(a), "recomputed": _finite(b)} for s, a, b in m["series"]]
            if not series:
                del m["series"]
            for k in ("max_rel_diff", "max_abs_diff"):
                m[k] = _finite(m[k])
        d["unmatched"] = list(d["unmatched"])
        return d


def _finite(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else float(x)


def close(logged: float, value: float | None, rtol: float, atol: float) -> bool:
    """Agreement rule: both NaN (null), or |logged - value| <= rtol * max(|value|, atol / rtol)."""
    a = logged if math.isfinite(logged) else None
    if a is None or value is None:
        return a is None and value is None
    return abs(a - value) <= rtol * max(abs(value), atol / rtol)


def rel_diff(logged: float, value: float | None, rtol: float, atol: float) -> tuple[float, float]:
    """(relative, absolute) difference; inf where exactly one side is NaN/null."""
    if not math.isfinite(logged) or value is None:
        return (0.0, 0.0) if (not math.isfinite(logged) and value is None) else (math.inf, math.inf)
    d = abs(logged - value)
    return d / max(abs(value), atol / rtol), d


class _Tokens:
    """The run's tokens, read once on the first disagreement: each step's padded batch and loss calls."""

    def __init__(self, run, mod, max_tokens: int):
        self.alts: dict[int, list[tuple[str, dict[str, float]]]] = {}  # every metric's alternatives, per step
        self.ts = TS.load(run, max_tokens=max_tokens)
        self.first = dict(self.ts.step_slices())
        self.ts_all = TS.load(run, all_iterations=True, max_tokens=max_tokens) \
            if getattr(mod, "NEEDS_ALL_ITERATIONS", False) else None
        self.all = dict(self.ts_all.step_slices()) if self.ts_all is not None else {}

    def step(self, step: int) -> tuple[StepBatch, list[StepBatch] | None]:
        b = pad(self.ts, self.first.get(step, slice(0, 0)), step)
        if self.ts_all is None:
            return b, None
        return b, loss_calls(self.ts_all, step, self.all.get(step, slice(0, 0)))  # as kldiag.crosswalk groups them

    def alternatives(self, step: int, metrics_of) -> list[tuple[str, dict[str, float]]]:
        """audit_reasons.alternatives of the step, computed once for all its metrics."""
        if step not in self.alts:
            self.alts[step] = R.alternatives(metrics_of, *self.step(step))
        return self.alts[step]


def explain(alts: list[tuple[str, dict[str, float]]], name: str, logged: float, rtol: float,
            atol: float) -> tuple[str, ...]:
    """The reasons whose alternative value of `name` matches the logged value."""
    return tuple(dict.fromkeys(r for r, vals in alts if name in vals and close(logged, vals[name], rtol, atol)))


def _compare(name: str, logged_name: str, logged: dict[int, float], mine: dict[int, float | None], offset: int,
             rtol: float, atol: float, why_null: str | None) -> tuple[MetricAudit, list[int]]:
    """The metric's verdict before reasons, and the kldiag steps that differ (reasons come later)."""
    shifted = {s + offset: v for s, v in logged.items()}
    steps = sorted(set(shifted) & set(mine))
    series = tuple((s, shifted.get(s), mine.get(s)) for s in sorted(set(shifted) | set(mine)))
    if why_null is not None:
        return MetricAudit(name, logged_name, "not_recomputable", note=why_null, series=series), []
    diffs = [rel_diff(shifted[s], mine[s], rtol, atol) for s in steps]
    bad = [s for s in steps if not close(shifted[s], mine[s], rtol, atol)]
    rel = max((d[0] for d in diffs), default=None)
    absd = max((d[1] for d in diffs), default=None)
    return MetricAudit(name, logged_name, "disagree" if bad else "agree", len(steps), rel, absd,
                       series=series), bad


def _dropped_nan_steps(logged: dict[int, float], mine: dict[int, float | None], offset: int) -> list[int]:
    """kldiag steps where kldiag's value is NaN (null) and the log, which has both neighbouring steps,
    has none (a log written every `logging_steps` > 1 skips steps by design: not counted)."""
    shifted = {s + offset for s in logged}
    return [s for s, v in mine.items() if v is None and s not in shifted and {s - 1, s + 1} <= shifted]


def audit(run, logs: str | Logs, framework: str | None = None, step_offset: int = 0, rtol: float = RTOL,
          atol: float = ATOL, max_tokens: int = TS.MAX_TOKENS, **settings: Any) -> AuditResult:
    """Each crosswalk metric found in `logs` (a path read with read_logs, or a Logs) against the
    recomputation from `run`'s tokens; `settings`: the framework's config keys, as for crosswalk()."""
    if rtol <= 0 or atol < 0:
        raise AuditError(f"rtol={rtol}, atol={atol}: use rtol > 0 and atol >= 0")
    r = open_run(run) if not hasattr(run, "iter_batches") else run
    lg = logs if isinstance(logs, Logs) else read_logs(logs)  # missing logs are named before the framework
    fw = require_framework(r.manifest, framework)
    mod = module(fw)
    table = crosswalk(r, fw, max_tokens=max_tokens, **settings)
    columns = [c for c in table.column_names if c != "step"]
    names = match_names(set(lg.series), columns)
    if not names:
        raise AuditError(f"{lg.path}: none of its {len(lg.series)} metrics is a {mod.NAME} crosswalk metric "
                         f"({', '.join(columns)}); is --framework right? (logged: {', '.join(sorted(lg.series)[:8])})")
    steps = table.column("step").to_pylist()
    all_null = null_reasons(table)
    cols = {n: dict(zip(steps, table.column(n).to_pylist(), strict=True)) for n in names}
    _check_overlap(names, lg, cols, step_offset)
    s = parse_settings(fw, settings, r.manifest)
    metrics_of = R.metrics_fn(mod, s)
    tokens: _Tokens | None = None
    out = []
    for name in columns:
        if name not in names:
            continue
        logged, mine = lg.series[names[name]], cols[name]
        why = all_null.get(name) if all(v is None for v in mine.values()) else None
        m, bad = _compare(name, names[name], logged, mine, step_offset, rtol, atol, why)
        dropped = _dropped_nan_steps(logged, mine, step_offset) if why is None else []
        if bad or dropped:
            tokens = tokens or _Tokens(r, mod, max_tokens)
            m = _with_reasons(m, bad, dropped, logged, mine, step_offset, tokens, metrics_of, rtol, atol)
        out.append(m)
    unmatched = tuple(sorted(set(lg.series) - set(names.values())))
    return AuditResult(str(getattr(r, "path", run)), lg.path, lg.kind, mod.NAME, step_offset, rtol, atol,
                       tuple(out), unmatched)


def _with_reasons(m: MetricAudit, bad: list[int], dropped: list[int], logged: dict[int, float],
                  mine: dict[int, float | None], offset: int, tokens: _Tokens, metrics_of, rtol: float,
                  atol: float) -> MetricAudit:
    """m with each differing step's reasons; a step the log dropped counts when the NaN-filtered value
    exists there (the trainer hid a NaN step)."""
    step_reasons: dict[int, tuple[str, ...]] = {}
    logged_steps = sorted(s + offset for s in logged)
    for step in bad:
        window = R.window_mean(mine, logged_steps, step)
        alts = [("logging_window", {m.name: window} if window is not None else {}),
                *tokens.alternatives(step, metrics_of)]
        step_reasons[step] = explain(alts, m.name, logged[step - offset], rtol, atol) or ("unexplained",)
    for step in dropped:
        b, calls = tokens.step(step)
        filtered = metrics_of(R.nan_filtered(b), [R.nan_filtered(c) for c in calls] if calls is not None else None)
        if m.name in filtered:
            step_reasons[step] = ("nan_filtered",)
    if not step_reasons:
        return m
    firsts = {v[0] for v in step_reasons.values()}
    common = set.intersection(*(set(v) for v in step_reasons.values()))
    reason = next(iter(firsts)) if len(firsts) == 1 else (sorted(common)[0] if common else "mixed")
    return MetricAudit(m.name, m.logged_name, "disagree", m.steps, m.max_rel_diff, m.max_abs_diff, reason,
                       tuple(sorted(step_reasons)), dict(sorted(step_reasons.items())), m.note, m.series)


def _check_overlap(names: dict[str, str], lg: Logs, cols: dict[str, dict], offset: int) -> None:
    """AuditError naming --step-offset when no logged step is a kldiag step."""
    logged = sorted({s for ln in names.values() for s in lg.series[ln]})
    recorded = sorted({s for c in cols.values() for s in c})

    def overlap(k: int) -> int:
        return len({s + k for s in logged} & set(recorded))
    if not recorded:
        raise AuditError("the run has no recorded step: audit a run with published token rows")
    if overlap(offset):
        return
    best = max((k for k in range(-2, 3) if k != offset), key=overlap)
    hint = f"; --step-offset {best} aligns {overlap(best)} step(s)" if overlap(best) else ""
    raise AuditError(f"no logged step is a recorded step (logged steps {logged[0]}..{logged[-1]}, recorded "
                     f"{recorded[0]}..{recorded[-1]}, kldiag step = logged step + {offset}){hint}; pass "
                     "--step-offset, or the logs of this run")

