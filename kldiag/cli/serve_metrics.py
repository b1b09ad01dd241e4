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
import errno
import socket
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
        raise ValueError(bind_error(args.host, args.port, e)) from None
    print(f"kldiag serve-metrics: http://{args.host}:{server.server_port}/metrics ({len(args.run_dirs)} run(s), "
          f"a look every {args.interval:g}s)", file=sys.stderr, flush=True)
    try:
        while True:
            states = exp.poll()
            if args.once:
                for st in states:
                    print(state_line(st), flush=True)
                return 0 if all(st.state == "analysed" for st in states) else 1
            time.sleep(args.interval)
    finally:
        server.shutdown()


def state_line(st) -> str:
    """One run's state after a look, for --once: 'RUN: analysed, step 9, healthy, 2 part(s)' or why not."""
    if st.state == "analysed":
        skipped = f", {st.parts_skipped} skipped as unreadable" if st.parts_skipped else ""
        return f"{st.run}: analysed, step {st.step}, {st.verdict}, {st.parts} part(s){skipped}"
    return f"{st.run}: {st.state}: {st.reason}"


def bind_error(host: str, port: int, e: OSError) -> str:
    """The listen error, naming what to change: the host when it is not an address of this machine,
    the port when it is taken."""
    if isinstance(e, socket.gaierror):
        return (f"--host {host} cannot be resolved ({e.strerror or e}): pass an address of this machine, "
                "e.g. --host 127.0.0.1 (this machine only) or --host 0.0.0.0 (every interface)")
    if e.errno == errno.EADDRNOTAVAIL:
        return (f"--host {host} is not an address of this machine ({e.strerror}): pass one of its own, e.g. "
                "--host 127.0.0.1 (this machine only) or --host 0.0.0.0 (every interface)")
    if e.errno == errno.EADDRINUSE:
        return f"port {port} on {host} is in use ({e.strerror}): choose another --port (0: any free one)"
    return f"cannot listen on {host}:{port} ({e.strerror or e}): check --host and --port"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve-metrics", help="serve runs' figures, verdicts and causes to Prometheus",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dirs", nargs="+", type=checks.run_dir, metavar="RUN",
                   help="run directories or URIs (s3://bucket/prefix)")
    p.add_argument("--port", type=port_or_any, default=9477, help="port to listen on (default 9477; 0: any free port)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--interval", type=checks.positive(), default=15.0, help="seconds between looks at the runs (default 15)")
    p.add_argument("--once", action="store_true",
                   help="look once, print each run's state and exit: 0 when every run was analysed, 1 when one is "
                        "waiting, unreadable or failing (a check that the runs can be read)")
    engines.add_arguments(p)
    p.set_defaults(func=run)
