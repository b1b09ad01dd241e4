"""`kldiag grafana [--out DIR]`: the Grafana dashboard and the Prometheus alert rules kldiag ships.

    kldiag grafana --out monitoring/    # writes monitoring/kldiag.json and monitoring/kldiag-rules.yml
    kldiag grafana                      # prints where they are, and what to do with each

kldiag.json is a Grafana dashboard over `kldiag serve-metrics` (import it: Dashboards > New > Import);
kldiag-rules.yml is a Prometheus rule file (list it under `rule_files:`). docs/monitoring.md explains
both. An existing file of the same name in DIR is replaced (it is kldiag's own); nothing else is touched.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from kldiag.cli import args as checks
from kldiag.cli.resources import GRAFANA_FILES, grafana_dir


def run(args: argparse.Namespace) -> int:
    src = grafana_dir()
    if args.out is None:
        for name in GRAFANA_FILES:
            print(src / name)
        print("kldiag grafana --out DIR copies them; docs/monitoring.md: import kldiag.json in Grafana, list "
              "kldiag-rules.yml under Prometheus' rule_files", file=sys.stderr)
        return 0
    out = checks.out_dir(args.out, "--out")
    out.mkdir(parents=True, exist_ok=True)
    for name in GRAFANA_FILES:
        shutil.copyfile(src / name, out / name)
        print(out / name)
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("grafana", help="write the Grafana dashboard and the Prometheus alert rules",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None, metavar="DIR",
                   help="directory to write kldiag.json and kldiag-rules.yml into (created if new)")
    p.set_defaults(func=run)
