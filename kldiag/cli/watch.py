"""`kldiag watch RUN`: a live terminal view of a run, for the SSH session next to training.

Every --interval seconds it re-lists the run's parts and, when new ones were published,
refreshes the analysis incrementally (the per-part partials of RUN/.kldiag, or the local
cache of a remote run: only the new parts are read) and the diagnosis (its extra scan keeps
per-part sums too). It prints one line of the latest step's key figures, and a line when an
alert episode starts or ends; the verdict line when it changes.

    kldiag watch runs/my_run                        # until Ctrl-C
    kldiag watch runs/my_run --notify env:SLACK_WEBHOOK   # a Slack message per new cause / critical episode
    kldiag watch s3://bucket/runs/my_run --fail-on blowup,nonfinite   # exit 1 when one starts
    kldiag watch runs/my_run --fail-on routing_replay_broken,k3_weight_blowup   # causes by name
    kldiag watch runs/my_run --once --fail-on all   # one look, for cron and CI
    kldiag watch runs/my_run --fail-on data_missing # exit 1 when a part is unreadable or steps are missing

Exit codes: 0 (stopped, --once, or --max-idle seconds without a new part), 1 (a --fail-on
rule fired; the episode or cause is printed to stderr), 2 (a user error, one line: a bad flag, a file as
RUN, or with --once a RUN that does not exist; without --once it waits for RUN to appear), 130 (Ctrl-C).
"""

from __future__ import annotations

import argparse
import sys
import time

from kldiag.analysis.rules import episodes as EP
from kldiag.analysis.types import AnalysisConfig
from kldiag.cli import args as checks
from kldiag.cli import engine_opts as engines
from kldiag.cli.report import ALIASES, parse_fail_on
from kldiag.diagnosis import CAUSE_NAMES
from kldiag.format import open_run
from kldiag.live.notify import Notifier
from kldiag.live.watch import Watcher, render

NOTIFY_CLOSE_S = 15.0  # at exit, how long queued webhook messages may still take


def run(args: argparse.Namespace) -> int:
    notifier = Notifier(args.notify, run=args.run_dir, remember=True) if args.notify else None
    try:
        return _watch(args, notifier)
    finally:
        if notifier is not None:
            notifier.close(timeout=NOTIFY_CLOSE_S)  # the messages of the last look go out before exit


def _watch(args: argparse.Namespace, notifier: Notifier | None) -> int:
    fail_on = parse_fail_on(args.fail_on) if args.fail_on else ()
    if args.once:
        open_run(args.run_dir)  # one look at a run that does not exist is an error; without --once, wait for it
    w = Watcher(args.run_dir, AnalysisConfig(**engines.options(args)))
    last_verdict, waiting, idle_since, seen = None, "", time.monotonic(), set()
    while True:
        up = w.poll()
        if up.waiting and up.waiting != waiting:
            print(f"kldiag watch: waiting: {up.waiting}", flush=True)
        waiting = up.waiting
        for line in render(up, last_verdict):
            print(line, flush=True)
        if notifier is not None:
            notifier.diagnosis(up.diagnosis)  # also retries what an earlier look could not deliver
        if up.diagnosis is not None:
            last_verdict, idle_since = up.diagnosis.verdict, time.monotonic()
            hit = failing(up, w, fail_on, args.once, seen)
            if hit:
                print(f"kldiag watch: failing on {hit}", file=sys.stderr, flush=True)
                return 1
        if args.once or (args.max_idle and time.monotonic() - idle_since > args.max_idle):
            return 0
        time.sleep(args.interval)


def failing(up, w: Watcher, fail_on: tuple[str, ...], once: bool, seen: set[str]) -> str:
    """What --fail-on fires on in this look, the most severe first (a critical cause before a warning
    episode), as one line; "" when nothing. Causes fire once each; episodes when they start (with
    --once: any the run holds)."""
    causes = [c for c in up.diagnosis.causes if c.cause in fail_on and (once or c.cause not in seen)]
    seen |= {c.cause for c in causes}
    episodes = [e for e in (w.known.values() if once else up.started) if e.kind in fail_on]
    hits = [(c.severity, f"{c.cause} ({c.severity}): {c.summary}") for c in causes]
    hits += [(e.severity, f"{e.kind} (step {e.start}): {e.message}") for e in episodes]
    rank = {s: i for i, s in enumerate(reversed(EP.SEVERITIES))}  # critical first; sorted() keeps causes first
    return min(hits, key=lambda h: rank.get(h[0], len(rank)))[1] if hits else ""


def _rules_arg(text: str) -> tuple[str, ...]:
    try:
        parse_fail_on(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("watch", help="follow a run live in the terminal: key figures, alert episodes",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", metavar="RUN", type=checks.run_dir, help="a run directory or URI (s3://bucket/prefix)")
    p.add_argument("--interval", type=checks.positive(float), default=5.0, help="seconds between looks (default 5)")
    p.add_argument("--fail-on", type=_rules_arg, default=None, metavar="RULES",
                   help=f"comma list of {', '.join(ALIASES)} (as `kldiag report --help` explains them), episode "
                        f"kinds ({', '.join(EP.KINDS)}) or causes ({', '.join(CAUSE_NAMES)}; data_missing: parts "
                        "unreadable or empty, steps missing): exit 1 when one starts, the most severe named")
    p.add_argument("--once", action="store_true", help="look once, print, and exit (with --fail-on: 1 if any fired)")
    p.add_argument("--max-idle", type=checks.non_negative, default=0.0, metavar="SECONDS",
                   help="exit 0 after this many seconds without a new part (default: never)")
    p.add_argument("--notify", default=None, metavar="URL",
                   help="POST a Slack-compatible JSON message to this webhook when a cause or a critical episode "
                        "starts (once each; env:NAME reads the URL from that variable; docs/monitoring.md)")
    engines.add_arguments(p)
    p.set_defaults(func=run)

