"""`kldiag watch RUN`: a live terminal view of a run, for the SSH session next to training.

Every --interval seconds it re-lists the run's parts and, when new ones were published,
refreshes the analysis incrementally (the per-part partials of RUN/.kldiag, or the local
cache of a remote run: only the new parts are read) and the diagnosis (its extra scan keeps
per-part sums too). It prints one line of the latest step's key figures, and a line when an
alert episode starts or ends; the verdict line when it changes.

    kldiag watch runs/my_run                        # until Ctrl-C
    kldiag watch s3://bucket/runs/my_run --fail-on blowup,nonfinite   # exit 1 when one starts
    kldiag watch runs/my_run --once --fail-on all   # one look, for cron and CI

Exit codes: 0 (stopped, --once, or --max-idle seconds without a new part), 1 (a --fail-on
rule fired; the episode is printed to stderr), 2 (a user error), 130 (Ctrl-C).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kldiag.diagnosis import episodes as EP
from kldiag.diagnosis.scan import StepScan
from kldiag.diagnosis.types import Diagnosis, Episode
from kldiag.errors import EmptyRunError, NotARunError


@dataclass
class Update:
    """What one poll found: new parts, the diagnosis, episodes that started or ended."""

    parts_new: int = 0
    analysis: Any = None
    diagnosis: Diagnosis | None = None
    started: list[Episode] = field(default_factory=list)
    ended: list[Episode] = field(default_factory=list)
    waiting: str = ""  # why there is nothing to show yet (no run.json, no part)


class Watcher:
    """Follows a run incrementally; `poll()` returns an Update (no printing here)."""

    def __init__(self, run: str, config=None, analyze: Callable[..., Any] | None = None):
        import kldiag

        self.run = run
        self.config = config or kldiag.AnalysisConfig()
        self._analyze = analyze or kldiag.analyze
        self.scan = StepScan()
        self.keys: tuple[str, ...] = ()
        self.known: dict[tuple[str, int], Episode] = {}  # (kind, start) -> last seen episode

    def _part_keys(self) -> tuple[str, ...]:
        from kldiag.format import open_run

        return tuple(p.key for p in open_run(self.run).parts())

    def poll(self) -> Update:
        try:
            keys = self._part_keys()
        except NotARunError as e:
            return Update(waiting=f"no run yet ({e})")
        if not keys:
            return Update(waiting="no part published yet")
        if keys == self.keys:
            return Update()
        from kldiag.diagnosis import diagnose

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                a = self._analyze(self.run, self.config)
            except EmptyRunError as e:
                return Update(waiting=str(e))
            dg = diagnose(a, scan=self.scan)
        self.keys = keys
        up = Update(parts_new=a.files_new, analysis=a, diagnosis=dg)
        for e in dg.episodes:
            old = self.known.get((e.kind, e.start))
            if old is None:
                up.started.append(e)
            if e.end is not None and (old is None or old.end is None):
                up.ended.append(e)
            self.known[(e.kind, e.start)] = e
        return up


FIGURES = (("k3_mean", "k3"), ("k3_is_mean", "k3_is"), ("weight_k3_abs_max", "max|w_k3|"),
           ("weight_k3_is_abs_max", "max|w_k3_is|"), ("blame_share", "blame"), ("flagged_frac", "flagged"),
           ("rho_ess", "rho_ess"), ("mismatch_kl", "mismatch_kl"), ("nonfinite_count", "nonfinite"))


def _num(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if v == v else "nan"
    return str(v)


def step_line(analysis) -> str:
    """The latest step's key figures on one line."""
    row = analysis.steps.slice(analysis.steps.num_rows - 1, 1).to_pylist()[0]
    figs = "  ".join(f"{label} {_num(row.get(col))}" for col, label in FIGURES if col in row)
    return f"step {row['step']}  tokens {row['tokens']:,}  {figs}"


def episode_line(e: Episode, what: str) -> str:
    return f"{what} [{e.severity}] {e.kind}: {e.message}"


def render(up: Update, last_verdict: str | None) -> list[str]:
    """The lines one Update prints."""
    from kldiag.diagnosis.text import verdict_line

    if up.diagnosis is None:
        return []
    lines = [f"{time.strftime('%H:%M:%S')} {step_line(up.analysis)}  ({up.parts_new} new part(s))"]
    lines += [episode_line(e, ">> started") for e in up.started]
    lines += [episode_line(e, "<< ended") for e in up.ended]
    if up.diagnosis.verdict != last_verdict:
        lines.append(verdict_line(up.diagnosis))
    return lines


def run(args: argparse.Namespace) -> int:
    import kldiag
    from kldiag.analysis import engines

    fail_on = EP.parse_kinds(args.fail_on) if args.fail_on else ()
    w = Watcher(args.run_dir, kldiag.AnalysisConfig(**engines.options(args)))
    last_verdict, waiting, idle_since = None, "", time.monotonic()
    while True:
        up = w.poll()
        if up.waiting and up.waiting != waiting:
            print(f"kldiag watch: waiting: {up.waiting}", flush=True)
        waiting = up.waiting
        for line in render(up, last_verdict):
            print(line, flush=True)
        if up.diagnosis is not None:
            last_verdict, idle_since = up.diagnosis.verdict, time.monotonic()
            fired = [e for e in (w.known.values() if args.once else up.started) if e.kind in fail_on]
            if fired:
                e = fired[0]
                print(f"kldiag watch: failing on {e.kind} (step {e.start}): {e.message}", file=sys.stderr, flush=True)
                return 1
        if args.once or (args.max_idle and time.monotonic() - idle_since > args.max_idle):
            return 0
        time.sleep(args.interval)


def _kinds_arg(text: str) -> str:
    try:
        EP.parse_kinds(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("watch", help="follow a run live in the terminal: key figures, alert episodes",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", metavar="RUN", help="a run directory or URI (s3://bucket/prefix)")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between looks (default 5)")
    p.add_argument("--fail-on", type=_kinds_arg, default="", metavar="RULES",
                   help=f"comma list of episode kinds ({', '.join(EP.KINDS)}), blame, nonfinite, jump or all: "
                        "exit 1 when one starts")
    p.add_argument("--once", action="store_true", help="look once, print, and exit (with --fail-on: 1 if any fired)")
    p.add_argument("--max-idle", type=float, default=0.0, metavar="SECONDS",
                   help="exit 0 after this many seconds without a new part (default: never)")
    from kldiag.analysis import engines

    engines.add_arguments(p)
    p.set_defaults(func=run)
