"""The `kldiag` command: parses the arguments and runs the subcommand, one module per subcommand.

Each module of this package has `add_parser(subparsers)`, which sets `func(args) -> int` as the
parser default."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from kldiag.errors import KldiagError
from kldiag.version import __version__

# Modules that contribute a subcommand, in the order `kldiag --help` lists them.
COMMAND_MODULES = (
    "kldiag.cli.lab",
    "kldiag.cli.analyze",
    "kldiag.cli.dashboard",
    "kldiag.cli.demo",
    "kldiag.cli.report",
    "kldiag.cli.watch",
    "kldiag.cli.serve_metrics",
    "kldiag.cli.importers",
    "kldiag.cli.export",
    "kldiag.cli.crosswalk",
    "kldiag.cli.audit",
    "kldiag.cli.mcp",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kldiag", description="Per-token KL-penalty diagnostics for RL training of LLMs.")
    parser.add_argument("--version", action="version", version=f"kldiag {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (KldiagError, ValueError) as e:
        if os.environ.get("KLDIAG_DEBUG"):
            raise
        print(f"kldiag: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `kldiag analyze RUN | head`: the reader left, which is not an error
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - Python flushes stdout at exit
        return 0


if __name__ == "__main__":
    sys.exit(main())
