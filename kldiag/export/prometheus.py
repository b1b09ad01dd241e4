"""Prometheus exporter behind `kldiag serve-metrics`: each run's latest figures, verdict and causes.

    exp = Exporter(["runs/a", "s3://bucket/runs/b"])
    server, _ = exp.serve(port=9477, host="127.0.0.1")   # GET /metrics
    while True: exp.poll(); time.sleep(15)

One `RunFollower` per run wraps the watcher of `kldiag watch` (kldiag.live.watch.Watcher): a poll
re-lists the parts and, only when the listing changed, refreshes the analysis through the
engine's per-part cache and merged-prefix cache (only new parts are read; a remote run caches
locally) and the diagnosis. What is kept between polls is a few numbers per run (the latest
step's figures, the causes, episode counts), never the analysis: memory is flat in run length.
A scrape (`collect()`) reads those numbers under a lock and never touches storage.

A run that does not exist yet, or has no part, is `kldiag_up{run} 0` (waiting); an unreadable
part is skipped by the analysis (`kldiag_parts_skipped`, and whatever cause the diagnosis names
for it: causes are exported by name, whatever their name); a run whose every part is unreadable is
`kldiag_up 0` with `kldiag_parts_skipped` > 0 and `kldiag_state{state="unreadable"}`, told apart from
one not started (`state="waiting"`); an error of a poll is counted (`kldiag_poll_errors_total`,
`state="failing"`), its reason goes to stderr once per cause, and the last figures stay: the exporter
itself never stops on a run. The `run` label is the argument as given, bytes that are not UTF-8
written as backslash escapes.
Metric names and labels: docs/metrics.md, "Prometheus metrics".
"""

from __future__ import annotations

import logging
import math
import threading
import time
import warnings
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kldiag.analysis.types import AnalysisConfig
from kldiag.format import open_run
from kldiag.live.watch import Watcher
from kldiag.mismatch import parity as P

PREFIX = "kldiag_"
# (metric name without the prefix, steps-table column, help): the latest analysed step's figures
STEP_GAUGES = (
    ("k3_mean", "k3_mean", "mean per-token k3 = exp(d) - d - 1 of the latest step"),
    ("k3_is_mean", "k3_is_mean", "mean per-token k3_is = rho * k3 of the latest step"),
    ("weight_k3_abs_max", "weight_k3_abs_max", "max |1 - exp(d)|, K3's gradient weight, of the latest step"),
    ("weight_k3_abs_p99", "weight_k3_abs_p99", "p99 of |1 - exp(d)| of the latest step (histogram, within 1.41x)"),
    ("flagged_frac", "flagged_frac", "share of the latest step's tokens with any flag"),
    ("blame_share", "blame_share", "share of the latest step's |k3 weight| carried by flagged tokens"),
    ("rho_max", "rho_max", "max rho = pi_theta / pi_old of the latest step"),
    ("mismatch_kl", "mismatch_kl", "k3 estimate of KL(mu || pi_old), engine vs trainer, of the latest step"),
    ("nonfinite_count", "nonfinite_count", "tokens with a NaN/inf log-prob in the latest step"),
)
VERDICT_CODE = {"healthy": 0, "warning": 1, "unstable": 2}
# analysed: figures shown; waiting: no run.json or no part yet (not started); unreadable: parts published,
# none readable (kldiag_parts_skipped says how many); failing: the last look raised (the reason on stderr)
STATES = ("analysed", "waiting", "unreadable", "failing")
log = logging.getLogger("kldiag.export.prometheus")


def label(run: str) -> str:
    """The `run` label: the argument as given, with bytes that are not UTF-8 (a directory name Python
    keeps as surrogates) written as backslash escapes, so a scrape never fails to encode it."""
    return run.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


@dataclass
class RunState:
    """What the exporter shows for one run (a few numbers: no table is kept)."""

    run: str
    up: bool = False
    waiting: str = ""
    state: str = "waiting"  # one of STATES
    reason: str = ""  # why it is waiting, unreadable or failing (one line)
    step: int | None = None
    figures: dict[str, float] = field(default_factory=dict)
    implied_temperature: float = math.nan
    verdict: str | None = None
    causes: list[tuple[str, str]] = field(default_factory=list)  # (cause, severity) active now
    episodes: Counter = field(default_factory=Counter)  # kind -> episodes started since the exporter started
    parts: int = 0
    parts_skipped: int = 0
    last_part_unix: float | None = None  # newest part's modification time (or first sight, without one)
    poll_errors: int = 0


def _number(v) -> float:
    try:
        return float(v) if v is not None else math.nan
    except (TypeError, ValueError):
        return math.nan


class _PartsWatcher(Watcher):
    """The watcher, also noting the parts' count and newest modification time from its one listing."""

    def __init__(self, run: str, config: AnalysisConfig):
        super().__init__(run, config)
        self.n_parts, self.newest_ns, self.first_seen = 0, 0, {}

    def _part_keys(self) -> tuple[str, ...]:
        parts = open_run(self.run).parts()
        now = time.time()
        for p in parts:  # a store without modification times: when this exporter first listed the part
            self.first_seen.setdefault(p.key, now)
        self.first_seen = {p.key: self.first_seen[p.key] for p in parts}  # bounded by the listing
        self.n_parts = len(parts)
        self.newest_ns = max((p.mtime_ns or int(self.first_seen[p.key] * 1e9) for p in parts), default=0)
        return tuple(p.key for p in parts)


class RunFollower:
    """Follows one run incrementally; `poll()` updates `state` and never raises."""

    def __init__(self, run: str, config: AnalysisConfig | None = None):
        self.state = RunState(label(run))
        self._watcher = _PartsWatcher(run, config or AnalysisConfig())
        self._told: set[str] = set()  # the failure reasons already on stderr

    def poll(self) -> RunState:
        s = self.state
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                up = self._watcher.poll()
                self._take(up)
        except Exception as e:  # a failure of one look (storage, a bug): counted, the last figures stay
            s.poll_errors += 1
            s.state, s.reason = "failing", label(" ".join(f"{type(e).__name__}: {e}".split()))
            if s.reason not in self._told:  # once per cause, not once per look
                self._told.add(s.reason)
                log.warning("kldiag serve-metrics: cannot read %s: %s", s.run, s.reason)
        return s

    def _take(self, up) -> None:
        s, w = self.state, self._watcher
        if up.waiting:  # no run.json, no part (yet, or any more), or no readable row: whatever was shown before
            s.up, s.waiting, s.reason = False, label(up.waiting), label(up.waiting)
            s.state = "unreadable" if up.unreadable else "waiting"
            s.parts, s.parts_skipped = (w.n_parts, len(up.unreadable)) if up.unreadable else (s.parts, 0)
            return
        s.parts, s.waiting, s.state, s.reason = w.n_parts, "", "analysed", ""
        s.last_part_unix = w.newest_ns / 1e9 if w.newest_ns else s.last_part_unix
        for e in up.started:
            s.episodes[e.kind] += 1
        if up.diagnosis is None:  # nothing new since the last look
            s.up = s.up or s.step is not None
            return
        a, dg = up.analysis, up.diagnosis
        row = a.steps.slice(a.steps.num_rows - 1, 1).to_pylist()[0] if a.steps.num_rows else {}
        s.step = int(row["step"]) if row else None
        s.figures = {name: _number(row.get(col)) for name, col, _ in STEP_GAUGES}
        rep = P.report_for(a)  # the diagnosis's own parity fit (memoised on the analysis): no second fit
        s.implied_temperature = _number(rep.fit.implied_temperature) if rep is not None else math.nan
        s.verdict = dg.verdict
        s.causes = [(c.cause, c.severity) for c in dg.causes]
        s.parts_skipped = len(a.skipped)
        s.up = True


class Exporter:
    """The runs' states as Prometheus metric families (a prometheus_client custom collector)."""

    def __init__(self, runs: Sequence[str], config: AnalysisConfig | None = None):
        self.followers = [RunFollower(r, config) for r in runs]
        self._lock = threading.Lock()
        self._states: list[RunState] = [RunState(r) for r in runs]

    def poll(self) -> list[RunState]:
        """One look at every run; the scrape sees the new states at once."""
        for i, f in enumerate(self.followers):
            st = f.poll()
            snap = RunState(**{k: getattr(st, k) for k in st.__dataclass_fields__})
            snap.figures, snap.causes, snap.episodes = dict(st.figures), list(st.causes), Counter(st.episodes)
            with self._lock:
                self._states[i] = snap
        return self.states()

    def states(self) -> list[RunState]:
        with self._lock:
            return list(self._states)

    def describe(self) -> list:
        return []  # the families vary with the runs' causes: prometheus_client then skips a collect at register

    def collect(self) -> Iterable:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        now = time.time()
        states = self.states()

        def gauge(name, doc, labels=("run",)):
            return GaugeMetricFamily(PREFIX + name, doc, labels=list(labels))

        up = gauge("up", "1 when the run has been analysed, 0 while waiting for it (no run.json or no part yet)")
        step = gauge("last_step", "the latest analysed step")
        figs = {name: gauge(name, doc) for name, _, doc in STEP_GAUGES}
        state = gauge("state", "1 for the run's state: analysed, waiting (not started), unreadable (parts "
                               "published, none readable) or failing (its last look failed)", ("run", "state"))
        temp = gauge("implied_temperature", "engine temperature implied by the slope of log mu on log pi_old "
                                            "(1/slope; runs with sampler log-probs)")
        verdict = gauge("verdict", "0 healthy, 1 warning, 2 unstable")
        cause = gauge("cause", "1 for each cause the diagnosis names now", ("run", "cause", "severity"))
        episodes = CounterMetricFamily(PREFIX + "episodes", "alert episodes started since the exporter started",
                                       labels=["run", "kind"])
        parts = gauge("parts", "parts published")
        skipped = gauge("parts_skipped", "parts the analysis skipped as unreadable")
        last_ts = gauge("last_part_timestamp_seconds", "unix time of the newest part")
        since = gauge("seconds_since_last_part", "seconds since the run last published a part (a stuck trainer)")
        errors = CounterMetricFamily(PREFIX + "poll_errors", "looks at the run that failed", labels=["run"])
        for s in states:
            r = [s.run]
            up.add_metric(r, 1.0 if s.up else 0.0)
            state.add_metric([s.run, s.state], 1.0)
            errors.add_metric(r, s.poll_errors)
            if s.state == "unreadable":  # the unreadable-parts alert fires on a run whose every part is bad
                parts.add_metric(r, s.parts)
                skipped.add_metric(r, s.parts_skipped)
            for kind, n in sorted(s.episodes.items()):
                episodes.add_metric([s.run, kind], n)
            if s.last_part_unix is not None:
                last_ts.add_metric(r, s.last_part_unix)
                since.add_metric(r, max(0.0, now - s.last_part_unix))
            if not s.up:
                continue
            parts.add_metric(r, s.parts)
            skipped.add_metric(r, s.parts_skipped)
            if s.step is not None:
                step.add_metric(r, s.step)
            for name, fam in figs.items():
                if math.isfinite(s.figures.get(name, math.nan)):
                    fam.add_metric(r, s.figures[name])
            if math.isfinite(s.implied_temperature):
                temp.add_metric(r, s.implied_temperature)
            if s.verdict in VERDICT_CODE:
                verdict.add_metric(r, VERDICT_CODE[s.verdict])
            for c, sev in s.causes:
                cause.add_metric([s.run, c, sev], 1.0)
        yield from (up, state, step, *figs.values(), temp, verdict, cause, episodes, parts, skipped, last_ts, since,
                    errors)

    def registry(self):
        from prometheus_client import CollectorRegistry

        reg = CollectorRegistry(auto_describe=False)
        reg.register(self)
        return reg

    def serve(self, port: int = 9477, host: str = "127.0.0.1"):
        """Start the HTTP endpoint (GET /metrics) in a daemon thread: (server, thread)."""
        from prometheus_client import start_http_server

        return start_http_server(port, addr=host, registry=self.registry())
