"""`kldiag mcp [--root DIR ...] [--no-cache]`: an MCP server (stdio) for coding agents.

Read-only tools over kldiag's JSON contracts (docs/agents.md): list_runs, diagnose, steps,
worst_tokens, sequence, crosswalk, audit, compare, explain. Runs are named by path, absolute or
relative to a root; runs outside the roots are refused. The roots default to the current directory.
It writes nothing but the analysis cache RUN/.kldiag/ that `kldiag analyze` writes too
(--no-cache: nothing at all). Register it with an agent as the command `kldiag mcp --root RUNS_DIR`.
"""

from __future__ import annotations

import argparse
import os
from typing import Any


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("mcp", help="serve kldiag's read-only tools to coding agents (MCP over stdio)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", dest="roots", action="append", default=None, metavar="DIR",
                   help="a directory (or s3:// prefix) whose runs the agent may read (repeatable; default: .)")
    p.add_argument("--no-cache", action="store_true", help="do not read or write RUN/.kldiag/ analysis caches")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        import mcp  # noqa: F401
    except ImportError as e:
        raise ValueError(f"kldiag mcp needs the MCP SDK: pip install 'kldiag[mcp]' ({e})") from e
    for root in args.roots or ():
        if "://" not in root and not os.path.isdir(root):
            raise ValueError(f"--root {root} is not a directory: pass a directory holding runs (or an s3:// prefix)")
    from kldiag.agents.server import serve_stdio  # start-up: `kldiag --help` loads no agents module
    from kldiag.agents.workspace import Workspace

    serve_stdio(Workspace(args.roots, use_cache=not args.no_cache))
    return 0
