"""`kldiag audit RUN --logs SRC [--framework NAME] [--set KEY=VALUE ...] [--json] [--fail-on RULES]`.

Compares what the trainer logged (SRC: a TensorBoard log dir, an HF/TRL trainer_state.json or a
checkpoint dir holding one, a W&B history .csv, a .jsonl/.json metric file) with kldiag's
recomputation of the same metrics from the recorded tokens (`kldiag crosswalk`), per step. A metric
agrees when every step is within --rtol (relative; values below --atol/--rtol compare absolutely at
--atol). A disagreement names its likely reason, each tested by recomputing the step: logging_window
(logging_steps > 1), nan_filtered, padding_included, per_sample_vs_per_token, probabilities, or
unexplained (docs/audit.md).

Steps: kldiag step = logged step + --step-offset (default 0: kldiag's TRL and verl hooks record
the step the trainer logs at).

--fail-on RULES (comma list) exits 1 when
  disagreement  a metric disagrees
  unexplained   a metric disagrees for no tested reason
  any           a metric disagrees, or a logged metric cannot be recomputed from the run
  data_missing  the run's tokens lack parts or steps (the diagnosis's data_missing cause: an
                unreadable or empty part, a step gap inside a rank), so some steps were not audited
Bad input (unknown SRC format, no step in common, unknown framework or setting) exits 2.
--json prints the object documented in docs/audit.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from typing import Any

from kldiag.analysis import analyze
from kldiag.cli import args as checks
from kldiag.crosswalk import FRAMEWORKS, CrosswalkError
from kldiag.crosswalk.audit import ATOL, RTOL, audit
from kldiag.diagnosis.missing import cause_of
from kldiag.fmt import num

FAIL_ON = ("disagreement", "unexplained", "any", "data_missing")


def _rules(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    bad = [n for n in names if n not in FAIL_ON]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown rule(s) {', '.join(bad) or '(none given)'}; "
                                         f"choose from {', '.join(FAIL_ON)}")
    return names


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("audit", help="check a trainer's logged KL/IS metrics against the recorded tokens",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", metavar="RUN", type=checks.run_dir, help="a run directory or URI")
    p.add_argument("--logs", required=True, metavar="SRC", help="what the trainer logged (see above)")
    p.add_argument("--framework", "-f", default=None,
                   help=f"one of {', '.join(FRAMEWORKS)} (default: the run's own trainer)")
    p.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                   help="a framework config key, as for `kldiag crosswalk` (repeatable)")
    p.add_argument("--step-offset", type=int, default=0, help="kldiag step = logged step + this (default 0)")
    p.add_argument("--rtol", type=float, default=RTOL, help=f"relative tolerance (default {RTOL:g})")
    p.add_argument("--atol", type=float, default=ATOL, help=f"absolute tolerance near 0 (default {ATOL:g})")
    p.add_argument("--fail-on", type=_rules, default=(), metavar="RULES",
                   help=f"comma list of {', '.join(FAIL_ON)}: exit 1 when one holds")
    p.add_argument("--json", action="store_true", help="print the audit as one JSON object")
    p.set_defaults(func=run)


def failing(result, rules: tuple[str, ...]) -> list[str]:
    """'kl disagrees (padding_included)' for each metric a rule fails on."""
    out = []
    for m in result.metrics:
        if m.verdict == "disagree" and ("disagreement" in rules or "any" in rules
                                        or ("unexplained" in rules and m.reason in ("unexplained", "mixed"))):
            out.append(f"{m.name} disagrees ({m.reason})")
        elif m.verdict == "not_recomputable" and "any" in rules:
            out.append(f"{m.name} cannot be recomputed")
    return out


def missing(run_dir: str) -> list[str]:
    """'data_missing (warning, from step 10): ...' when the run's tokens lack parts or steps, else []."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the audit's own read of the run warned about each skipped part
        c = cause_of(analyze(run_dir))
    return [] if c is None else [f"data_missing ({c.severity}, from step {c.onset}): {c.summary}"]


def run(args: argparse.Namespace) -> int:
    given = {}
    for item in args.settings:  # values stay text: crosswalk's parse_settings coerces them
        if "=" not in item:
            raise CrosswalkError(f"--set {item!r}: write KEY=VALUE, "
                                 "e.g. --set vllm_importance_sampling_mode=token_mask")
        key, value = item.split("=", 1)
        given[key.strip().replace("-", "_")] = value
    result = audit(args.run_dir, args.logs, args.framework, step_offset=args.step_offset, rtol=args.rtol,
                   atol=args.atol, **given)
    if args.json:
        json.dump(result.to_dict(), sys.stdout, allow_nan=False)
        sys.stdout.write("\n")
    else:
        print(format_text(result))
    hit = failing(result, args.fail_on) + (missing(args.run_dir) if "data_missing" in args.fail_on else [])
    if hit:
        print(f"kldiag audit: failing on {'; '.join(hit)}", file=sys.stderr)
    return 1 if hit else 0


def format_text(result) -> str:
    """The table: metric, steps compared, max rel diff, max abs diff, verdict, reason; then details."""
    head = ["metric", "steps", "max_rel_diff", "max_abs_diff", "verdict", "reason"]
    rows = [[m.name, str(m.steps), num(m.max_rel_diff, 3), num(m.max_abs_diff, 3), m.verdict, m.reason or ""]
            for m in result.metrics]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]
    lines = [f"{result.framework} metrics in {result.logs} ({result.logs_kind}) vs {result.run}; "
             f"rtol {result.rtol:g}, atol {result.atol:g}, step offset {result.step_offset}",
             "  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    for m in result.metrics:
        if m.verdict == "disagree":
            steps = ", ".join(f"{s}: {'+'.join(v)}" for s, v in list(m.step_reasons.items())[:12])
            lines.append(f"{m.name}: differs at {len(m.differing_steps)} step(s) ({steps}"
                         f"{', ...' if len(m.step_reasons) > 12 else ''})")
        elif m.verdict == "not_recomputable":
            lines.append(f"{m.name}: not recomputable: {m.note}")
    if result.unmatched:
        more = " ..." if len(result.unmatched) > 10 else ""
        lines.append(f"not audited ({len(result.unmatched)} logged names that are no {result.framework} "
                     f"crosswalk metric): {', '.join(result.unmatched[:10])}{more}")
    return "\n".join(lines)
