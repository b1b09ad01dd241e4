"""`kldiag crosswalk RUN --framework NAME [--set KEY=VALUE ...] [--json]`.

Per step, the KL / importance-sampling / mismatch metrics the framework logs, under the names it
logs them, recomputed from the recorded tokens with its semantics (docs/crosswalk.md). --set takes
the framework's own config keys, e.g. verl: rollout_is=token rollout_is_threshold=2.0
rollout_rs=seq_mean_k3 rollout_rs_threshold=0.01 kl_loss_type=low_var_kl loss_agg_mode=token-mean;
trl: vllm_importance_sampling_mode=token_truncate vllm_importance_sampling_clip_max=2.
--json prints a list of {"step": S, "<name>": value or null, ...} (docs/crosswalk.md), with
"null_reasons": {name: why} in a step that has nulls; the text form prints a table and, below it,
why a column is null.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kldiag.cli import args as checks
from kldiag.crosswalk import (FRAMEWORKS, crosswalk, null_reasons, parse_settings,
                              records, require_framework)
from kldiag.errors import EmptyRunError
from kldiag.fmt import num
from kldiag.format import open_run


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("crosswalk", help="a framework's own KL/IS/mismatch metrics, from the recorded tokens",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", metavar="RUN", type=checks.run_dir, help="a run directory or URI")
    p.add_argument("--framework", "-f", default=None, help=f"one of {', '.join(FRAMEWORKS)} "
                                                          "(default: the run's own trainer)")
    p.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                   help="a framework config key (repeatable)")
    p.add_argument("--json", action="store_true", help="print a JSON list, one object per step")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    r = open_run(args.run_dir)
    fw = require_framework(r.manifest, args.framework)
    settings = parse_settings(fw, args.settings)
    table = crosswalk(r, fw, **{k: getattr(settings, k) for k in _given(args.settings)})
    if table.num_rows == 0:  # as analyze and report: nothing read is an error, not a table of nulls
        raise EmptyRunError(f"run {r.path} has no readable token rows ({len(r.parts())} part file(s)): the "
                            "crosswalk has nothing to recompute; wait for the recorder's first part, or restore "
                            "the unreadable parts (kldiag analyze RUN names them)")
    if args.json:
        json.dump(records(table), sys.stdout, allow_nan=False, default=str)
        sys.stdout.write("\n")
        return 0
    names = table.column_names
    rows = records(table, reasons=False)
    widths = [max(len(n), *(len(num(r[n], 6)) for r in rows)) if rows else len(n) for n in names]
    print("  ".join(n.rjust(w) for n, w in zip(names, widths, strict=True)))
    for row in rows:
        print("  ".join(num(row[n], 6).rjust(w) for n, w in zip(names, widths, strict=True)))
    for name, why in null_reasons(table).items():
        print(f"{name}: null: {why}")
    return 0


def _given(pairs: list[str]) -> list[str]:
    return [p.split("=", 1)[0].strip().replace("-", "_") for p in pairs if "=" in p]
