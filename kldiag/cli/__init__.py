"""The `kldiag` command: parses the arguments and runs the subcommand, one module per subcommand.

Each module of this package has `add_parser(subparsers)`, which sets `func(args) -> int` as the
parser default."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings

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
    "kldiag.cli.grafana",
    "kldiag.cli.importers",
    "kldiag.cli.export",
    "kldiag.cli.crosswalk",
    "kldiag.cli.audit",
    "kldiag.cli.mcp",
    "kldiag.cli.cache",
)


class Parser(argparse.ArgumentParser):
    """argparse's parser with one `kldiag: error:` line for a bad argument, in place of the usage
    block (its subcommands' parsers are of this class too)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"kldiag: error: {message} (`{self.prog} --help` lists what it takes)\n")


def warning_line(message, category=None, filename=None, lineno=None, line=None) -> str:
    """warnings.formatwarning for the command: `kldiag: warning: <text>` on one line, with no file,
    line number or source line, and no second `kldiag:` when the text already starts with one."""
    text = " ".join(str(message).split())
    return f"kldiag: warning: {text.removeprefix('kldiag: ')}\n"


def _shower(seen: set[str]):
    """warnings.showwarning for one command: each distinct warning once (a part skipped by two reads
    of the run is one line), as warning_line words it."""
    def show(message, category, filename, lineno, file=None, line=None) -> None:
        text = warning_line(message, category, filename, lineno, line)
        if text not in seen:
            seen.add(text)
            (file or sys.stderr).write(text)
    return show


def os_error_line(e: OSError) -> str:
    """One line for an OSError no check foresaw: what failed, on which path, and where to look."""
    where = f"{e.filename}: " if e.filename else ""
    what = (e.strerror or str(e)).lower()
    return f"{where}{what}; check the path and its permissions (KLDIAG_DEBUG=1 shows where it failed)"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="kldiag", description="Per-token KL-penalty diagnostics for RL training of LLMs.")
    parser.add_argument("--version", action="version", version=f"kldiag {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; returns its exit code (2: a user error, printed as one line)."""
    saved = warnings.formatwarning  # catch_warnings restores showwarning only
    with warnings.catch_warnings():  # the formatter is the command's, not the importing program's
        warnings.showwarning, warnings.formatwarning = _shower(set()), warning_line
        try:
            return _main(argv)
        finally:
            warnings.formatwarning = saved


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # SystemExit(2) after Parser.error's one line, as argparse's
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (KldiagError, ValueError) as e:
        if os.environ.get("KLDIAG_DEBUG"):
            raise
        print(f"kldiag: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `kldiag analyze RUN | head`: the reader left, which is not an error
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - Python flushes stdout at exit
        return 0
    except OSError as e:  # a path no check foresaw (permissions, a full disk): still one line
        if os.environ.get("KLDIAG_DEBUG"):
            raise
        print(f"kldiag: error: {os_error_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
