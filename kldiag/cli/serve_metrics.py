"""`kldiag serve-metrics RUN [RUN ...]`: a Prometheus endpoint with each run's figures, verdict and causes.

    kldiag serve-metrics runs/a s3://bucket/runs/b            # http://127.0.0.1:9477/metrics
    kldiag serve-metrics runs/a --host 0.0.0.0 --port 9477    # for a Prometheus on another machine

Start it before training if you like: a run that does not exist yet is `kldiag_up{run="..."} 0`
until its first part. Every --interval seconds it looks at each run and, when new parts were
published, refreshes the analysis and the diagnosis incrementally (only new parts are read, as
`kldiag watch` does). A scrape never reads storage. Per run (label `run`, the argument as given):
the latest step's figures, `kldiag_verdict` (0 healthy, 1 warning, 2 unstable), one
`kldiag_cause{cause,severity}` per cause, `kldiag_episodes_total{kind}`, `kldiag_last_step`,
`kldiag_seconds_since_last_part` (docs/metrics.md, "Prometheus metrics"). A Grafana dashboard and
alerting rules: docs/grafana/kldiag.json, docs/grafana/kldiag-rules.yml (docs/monitoring.md).
"""

from __future__ import annotations

import argparse
import sys
import time

from kldiag.analysis.types import AnalysisConfig
from kldiag.cli import args as checks
from kldiag.cli import engine_opts as engines


def port_or_any(text: str) -> int:
    """argparse type of serve-metrics' --port: 1..65535, or 0 for any free port."""
    return 0 if text.strip() == "0" else checks.port(text)


def run(args: argparse.Namespace) -> int:
    try:
        import prometheus_client  # noqa: F401 - checked here, used by the exporter

        from kldiag.export.prometheus import Exporter  # start-up: `kldiag --help` loads no exporter
    except ImportError:
        raise ValueError("serve-metrics needs prometheus-client: pip install 'kldiag[prometheus]'") from None
    exp = Exporter(args.run_dirs, AnalysisConfig(**engines.options(args)))
    try:
        server, _ = exp.serve(port=args.port, host=args.host)
    except OSError as e:
        raise ValueError(f"cannot listen on {args.host}:{args.port} ({e.strerror or e}); "
                         "choose another --port") from None
    print(f"kldiag serve-metrics: http://{args.host}:{server.server_port}/metrics ({len(args.run_dirs)} run(s), "
          f"a look every {args.interval:g}s)", file=sys.stderr, flush=True)
    try:
        while True:
            exp.poll()
            if args.once:
                return 0
            time.sleep(args.interval)
    finally:
        server.shutdown()


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve-metrics", help="serve runs' figures, verdicts and causes to Prometheus",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dirs", nargs="+", type=checks.run_dir, metavar="RUN",
                   help="run directories or URIs (s3://bucket/prefix)")
    p.add_argument("--port", type=port_or_any, default=9477, help="port to listen on (default 9477; 0: any free port)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--interval", type=checks.positive(), default=15.0, help="seconds between looks at the runs (default 15)")
    p.add_argument("--once", action="store_true", help="look once and exit (a check that the runs can be read)")
    engines.add_arguments(p)
    p.set_defaults(func=run)
