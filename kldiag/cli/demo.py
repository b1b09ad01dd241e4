"""`kldiag demo`: watch K3 blow up, and the corrected estimator not, in seconds on a CPU.

Trains the tiny GRPO task of kldiag.tools.demo_train twice from the same seed, once with the K3
KL loss and once with k3_is (DeepSeek-V3.2 eq. 7), records both with `kldiag.Recorder`
into OUT/demo_k3 and OUT/demo_k3_is, analyses them (`kldiag.analyze`), prints a summary
of both, writes a post-mortem report of each (kldiag.report.build) and opens the dashboard on
the pair. Needs torch (CPU is enough).
"""

from __future__ import annotations

import argparse
import sys

from kldiag.analysis import analyze
from kldiag.analysis.types import AnalysisConfig
from kldiag.cli import args as checks
from kldiag.cli import dashboard
from kldiag.report.build import build_report, reducers
from kldiag.tools.demo import format_summary, run_pair, summarize


def run(args: argparse.Namespace) -> int:
    out = checks.out_dir(args.out, "--out")
    if not args.no_dashboard:
        checks.check_port("127.0.0.1", args.port)  # before training, not after it
    print(f"kldiag demo: training the K3 run and its k3_is twin into {out}/", file=sys.stderr)
    runs = run_pair(out, steps=args.steps, seed=args.seed, progress=not args.quiet)
    for r in runs:
        analysis = analyze(r.run_dir, AnalysisConfig(), reducers())  # what the summary and report read
        print(format_summary(summarize(r, analysis)))
        if not args.no_report:
            from kldiag.report.render import write_html  # plotly: only when writing the page

            path = out / f"{r.run_dir.name}.report.html"
            rep = build_report(analysis)
            write_html(rep, path)
            print(f"{'':12s} verdict: {rep.verdict.upper()}; report: {path}")
    if args.no_dashboard:
        return 0
    return dashboard.run(argparse.Namespace(runs=[str(r.run_dir) for r in runs], port=args.port, host="127.0.0.1"))



def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)



def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("demo", help="train a tiny GRPO run with K3 and with k3_is, then diagnose both",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="kldiag_runs", help="where the runs go: OUT/demo_k3, OUT/demo_k3_is "
                   "(default ./kldiag_runs; an existing demo run there is replaced)")
    p.add_argument("--no-dashboard", action="store_true", help="do not open the dashboard at the end")
    p.add_argument("--no-report", action="store_true", help="do not write OUT/demo_*.report.html")
    p.add_argument("--steps", type=_positive_int, default=None,
                   help="training steps (default 200; fewer for a quick look)")
    p.add_argument("--seed", type=int, default=None, help="random seed (default 0); both runs share it")
    p.add_argument("--port", type=checks.port, default=8501, help="dashboard port (default 8501)")
    p.add_argument("--quiet", action="store_true", help="no per-step progress lines")
    p.set_defaults(func=run)

