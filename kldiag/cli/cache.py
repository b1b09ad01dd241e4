"""`kldiag cache RUN [--prune] [--json]`: what the run's analysis cache holds, and what of it is stale.

    kldiag cache runs/a              # size per folder of runs/a/.kldiag, live and stale
    kldiag cache runs/a --prune      # remove the stale files

Every read of a run caches what it computed under RUN/.kldiag (a URI's run: a local folder per URI,
KLDIAG_CACHE_DIR). Files that no read asks for again stay there: those of an older kldiag whose reducers
changed, of parts no longer listed, of a token sample whose stride doubled as the run grew, of an analysis
at other thresholds. Live is what `kldiag analyze`, `kldiag report`, the dashboard and the diagnosis read
at their default settings, as the run is listed now; --prune removes the rest (a later read at other
settings computes its files again). It reads no part of the run. docs/scale.md, "The cache on disk".
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from kldiag.analysis import thresholds
from kldiag.analysis.cache import files as cache_files
from kldiag.analysis.reducers import topk
from kldiag.analysis.runtime import runner
from kldiag.analysis.types import AnalysisConfig
from kldiag.cli import args as checks
from kldiag.format import open_run
from kldiag.views import dashboard


def live(run) -> dict[str, set[str]]:
    """The cache files the default reads of the run ask for (cache_files.live_files)."""
    parts = run.parts()
    th = thresholds(AnalysisConfig(), run.manifest)
    reducers = [runner.bound(r, parts, (th.clip_low, th.clip_high)) for r in (*dashboard.reducers(), topk.TopkReducer())]
    return cache_files.live_files(run.cache_dir(), parts, th, reducers)


def mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def table(rows: list[cache_files.FolderUsage]) -> list[str]:
    lines = [f"  {'folder':12s} {'files':>7s} {'size':>12s} {'stale':>12s}"]
    for u in rows:
        stale = mb(u.stale_bytes) if u.judged else "kept"
        lines.append(f"  {u.folder:12s} {u.files:7,d} {mb(u.bytes):>12s} {stale:>12s}")
    return lines


def as_json(rows: list[cache_files.FolderUsage], cache_dir, pruned: bool) -> dict[str, Any]:
    return {"cache_dir": str(cache_dir), "pruned": pruned,
            "bytes": sum(u.bytes for u in rows), "stale_bytes": sum(u.stale_bytes for u in rows),
            "folders": [{"folder": u.folder, "files": u.files, "bytes": u.bytes, "stale_files": u.stale_files,
                         "stale_bytes": u.stale_bytes, "judged": u.judged} for u in rows]}


def run(args: argparse.Namespace) -> int:
    r = open_run(args.run_dir)
    cache_dir, since = r.cache_dir(), time.time()
    want = live(r)
    rows = cache_files.prune(cache_dir, want, since) if args.prune else cache_files.usage(cache_dir, want, since)
    if args.json:
        print(json.dumps(as_json(rows, cache_dir, args.prune), indent=2))
        return 0
    total, stale = sum(u.bytes for u in rows), sum(u.stale_bytes for u in rows)
    n_stale = sum(u.stale_files for u in rows)
    if not rows:
        print(f"{cache_dir}: no cache yet (the first analysis of the run writes it)")
        return 0
    print(f"{cache_dir}: {mb(total)} in {sum(u.files for u in rows):,d} files; "
          f"{'removed' if args.prune else 'stale'}: {mb(stale)} in {n_stale:,d} files")
    print("\n".join(table(rows)))
    if stale and not args.prune:
        print(f"`kldiag cache {args.run_dir} --prune` removes the stale files (older kldiag versions, parts no "
              "longer listed, other settings); the rest is what the default reads use")
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("cache", help="a run's analysis cache: its size per folder, and --prune the stale files",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", metavar="RUN", type=checks.run_dir, help="a run directory or URI (s3://bucket/prefix)")
    p.add_argument("--prune", action="store_true", help="remove the stale files (live ones are kept)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.set_defaults(func=run)
