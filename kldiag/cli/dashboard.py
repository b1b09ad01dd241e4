"""`kldiag dashboard RUN [RUN ...]`: start the Streamlit app on one or more runs.

The app ships inside the package (kldiag/_app, from app/ of the source tree; a checkout used in
place runs app/ itself: kldiag/cli/resources.py). It binds to
127.0.0.1 unless --host says otherwise, runs headless, and receives the run paths after
`--` on its command line. Runs are checked before launching, so a typo fails here with a
clear message instead of in the browser, and so is the port: a port another server holds is an
error naming --port and a free port to pass (the dashboard never moves to another port on its own,
so the URL it prints is always the one asked for). `--logs SRC` (once per run, in the runs' order) pairs a
run with what its trainer logged: the Mismatch page then overlays the logged and the recomputed
values of each audited metric (`kldiag audit`, docs/audit.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from kldiag.cli import args as checks
from kldiag.cli import engine_opts as engines
from kldiag.crosswalk.audit.logs import detect
from kldiag.cli import resources
from kldiag.errors import KldiagError
from kldiag.views.pages import check_run_dirs

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # a checkout's root (app/ beside kldiag/), or site-packages


def app_path() -> Path:
    """The app's main.py: inside the installed package (kldiag/_app), else app/ of this checkout;
    KldiagError naming the fix when neither is there."""
    return resources.app_main()


def streamlit_command(runs: list[Path], port: int, host: str) -> list[str]:
    """The `python -m streamlit run` command line that serves the app on `host:port`."""
    return [sys.executable, "-m", "streamlit", "run", str(app_path()),
            "--server.address", host, "--server.port", str(port),
            "--server.headless", "true", "--browser.gatherUsageStats", "false",
            "--client.toolbarMode", "viewer",  # no "Deploy" button; the theme follows the browser
            "--", *[str(r) for r in runs]]


def _env(args: argparse.Namespace | None = None) -> dict[str, str]:
    """The app imports kldiag: make this checkout importable even when it is not installed.
    The engine choice (--engine, --ray-address) reaches the app in the environment."""
    env = dict(os.environ)
    root = str(PACKAGE_ROOT)
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    env.pop("KLDIAG_RUNS", None)  # the runs on this command line win
    env.pop("KLDIAG_LOGS", None)
    return engines.to_env(args, env) if args is not None else env


def run(args: argparse.Namespace) -> int:
    runs = check_run_dirs(args.runs)
    logs = logs_by_run(runs, getattr(args, "logs", None) or [])
    checks.check_port(args.host, args.port)  # before the URL is announced
    cmd = streamlit_command(runs, args.port, args.host)
    print(f"kldiag: dashboard on http://{args.host}:{args.port} for {len(runs)} run(s); Ctrl-C stops it",
          file=sys.stderr, flush=True)
    sys.stdout.flush()
    if os.name == "posix":
        # Streamlit takes over this process: Ctrl-C, `kill` and process managers reach the
        # server itself. As a child, it outlived a parent killed by SIGTERM, holding the port.
        os.execve(cmd[0], cmd, _with_logs(_env(args), logs))
    return subprocess.call(cmd, env=_with_logs(_env(args), logs))


def logs_by_run(runs: list[Path], logs: list[str]) -> dict[str, str]:
    """{run path as the app gets it: the metric log given for it}; checks each log's format here."""
    if len(logs) > len(runs):
        raise KldiagError(f"{len(logs)} --logs for {len(runs)} run(s): give at most one --logs per RUN, "
                          "in the runs' order")
    for src in logs:
        detect(src)  # an unknown format fails here, not in the browser
    return {str(r): str(Path(src).resolve()) for r, src in zip(runs, logs, strict=False)}


def _with_logs(env: dict[str, str], logs: dict[str, str]) -> dict[str, str]:
    if logs:
        env["KLDIAG_LOGS"] = json.dumps(logs)  # kldiag.views.audit.LOGS_ENV
    return env


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("dashboard", help="open the Streamlit dashboard on one or more runs",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="RUN", type=checks.run_dir,
                   help="run directories (two or more to compare)")
    p.add_argument("--port", type=checks.port, default=8501,
                   help="port to serve on (default 8501); one in use is an error that names a free one")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1; 0.0.0.0 exposes the app to your network)")
    p.add_argument("--logs", action="append", default=[], metavar="SRC",
                   help="what the trainer logged for the run in the same place (TensorBoard dir, "
                        "trainer_state.json, W&B .csv, .jsonl): the Mismatch page audits it")
    engines.add_arguments(p)
    p.set_defaults(func=run)
