"""`kldiag export tensorboard RUN LOGDIR`: scalars and histograms for TensorBoard (and W&B).

Point TensorBoard at LOGDIR (`tensorboard --logdir LOGDIR`), or W&B:
`wandb.init(sync_tensorboard=True)` in a process that writes there, or
`wandb.tensorboard.patch(root_logdir=LOGDIR)` before `wandb.init()`, or `wandb sync LOGDIR`.
Run it again to append the steps recorded since (one LOGDIR per run).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kldiag.analysis.types import AnalysisConfig
from kldiag.cli import args as checks
from kldiag.cli import engine_opts as engines


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("export", help="export a run's analysis to TensorBoard event files",
                              usage="kldiag export tensorboard RUN LOGDIR [--hold-last] [engine options] "
                                    "(kldiag export tensorboard --help: every option)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="exporter", metavar="FORMAT", required=True)
    tb = sub.add_parser("tensorboard", help="every steps-table metric as a scalar, the per-step histograms of "
                                            "d, |k3 weight|, |k3_is weight|, rho as histograms",
                        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    tb.add_argument("run_dir", metavar="RUN", type=checks.run_dir, help="a run directory or URI")
    tb.add_argument("logdir", metavar="LOGDIR", help="TensorBoard log directory (created; one per run)")
    tb.add_argument("--hold-last", action="store_true",
                    help="leave the newest step for the next export (a run still recording it)")
    engines.add_arguments(tb)
    tb.set_defaults(func=run_tensorboard)


def run_tensorboard(args: argparse.Namespace) -> int:
    from kldiag.export.tensorboard import export_tensorboard  # start-up: `kldiag --help` loads no exporter

    r = export_tensorboard(args.run_dir, args.logdir, AnalysisConfig(**engines.options(args)),
                           hold_last=args.hold_last)
    if r.steps_written:
        print(f"kldiag: wrote steps {r.first_step}..{r.last_step} ({r.steps_written} steps, {r.scalars} scalars, "
              f"{r.histograms} histograms) to {r.events_file or r.logdir}", file=sys.stderr)
    else:
        print(f"kldiag: {r.logdir} is up to date: no new step to export", file=sys.stderr)
    return 0
