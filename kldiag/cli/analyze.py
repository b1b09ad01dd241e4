"""`kldiag analyze RUN`: per-step summary and alerts; --out writes the tables, --json a summary."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import pyarrow.csv as pcsv
import pyarrow.parquet as pq

from kldiag.analysis.core import coverage
from kldiag.analysis.reducers.coverage_table import coverage_of
from kldiag.analysis.types import Analysis, AnalysisConfig
from kldiag.cli import args as checks
from kldiag.cli import engine_opts as engines
from kldiag.cli import warning_line
from kldiag.diagnosis import diagnose
from kldiag.diagnosis.routing import apply_settings, check_settings
from kldiag.diagnosis.text import format_diagnosis, verdict_line
from kldiag.fmt import num
from kldiag.report.coverage import REF_COLUMNS, coverage_lines, flagged_line, staleness_lines, staleness_of, step_rows
from kldiag.report.summary import analyze_run, summary
from kldiag.report.summary import json_default as _json_default

# Options that are not thresholds, handled by hand.
_SKIP = {"threads", "workers", "strict", "use_cache", "engine", "ray_address"}
SUMMARY_COLUMNS = REF_COLUMNS  # a run with logp_ref; report.coverage.step_rows chooses per run
MAX_ROWS = 40
# What each AnalysisConfig threshold means on the command line (its default is added).
OPTION_HELP = {
    "tau": "flag a token as theta_ll_ref when pi_ref / pi_theta exceeds this ratio, d > log(tau)",
    "weight_limit": "flag weight_blowup when K3's |gradient weight| |1 - pi_ref/pi_theta| exceeds this",
    "clamp": "flag clamp_saturated when the K3 value exceeds this (the clamp of verl, OpenRLHF, ROLL, AReaL)",
    "clip_low": "PPO clip epsilon below 1 for rho = pi_theta/pi_old (unset: the manifest's clip_range, else 0.2)",
    "clip_high": "PPO clip epsilon above 1 for rho (unset: the manifest's clip_range, else 0.2)",
    "opsm_delta": "off-policy sequence mask: a sequence with a negative advantage is dropped when its mean "
                  "log mu - log pi_theta exceeds this",
    "top_k": "worst tokens by |k3 weight| kept in the flags table (every non-finite one too)",
    "top_k_sequences": "sequences kept in the sequence table, worst first (default: every one)",
    "per_rank": "also one steps row per (step, rank): steps_by_rank in --out",
    "trainer_compatible": "add the KL the trainer logs (TRL: micro-batch means): trainer_kl in --out",
    "alert_window": "trailing steps whose median an alert compares against",
    "alert_factor": "an alert's jump: a figure this many times its trailing median leaves its recent range",
    "batch_size": "rows per record batch read from a part (bounds memory)",
}


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("analyze", help="analyse a run directory: per-step metrics, flags, alerts",
                              description=__doc__)
    p.add_argument("run_dir", metavar="RUN", type=checks.run_dir,
                   help="a run directory or URI (s3://bucket/prefix)")
    p.add_argument("--out", type=Path, help="write steps/sequences/flags/alerts as Parquet and CSV into this directory "
                   "(outside the run; created if new)")
    p.add_argument("--json", action="store_true", help="print a machine-readable summary")
    p.add_argument("--threads", type=checks.positive(int), default=None, metavar="N",
                   help="threads reading and reducing parts (default: one per core this process may use)")
    p.add_argument("--workers", type=_workers_gone, help=argparse.SUPPRESS)
    p.add_argument("--strict", action="store_true", help="fail on a corrupt part instead of skipping it")
    p.add_argument("--no-cache", action="store_true", help="ignore and do not write RUN/.kldiag/ partials")
    p.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                   help="a run setting the manifest lacks, for the diagnosis (repeatable): routing_replay=R3|true, "
                        "rollout_dtype=fp8, true_on_policy=true")
    engines.add_arguments(p)
    defaults = AnalysisConfig()
    for f in dataclasses.fields(AnalysisConfig):
        if f.name in _SKIP:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        text = OPTION_HELP[f.name]
        if isinstance(default, bool):
            p.add_argument(flag, action="store_true", help=text)
        else:
            kind = int if isinstance(default, int) or f.name == "top_k_sequences" else float
            if f.name == "opsm_delta":
                default = "the manifest's off_policy_mask_threshold, else 1e-4"
            shown = "" if default is None else f" (default {default})"
            p.add_argument(flag, type=kind, default=getattr(defaults, f.name), help=text + shown)
    p.set_defaults(func=run)


def _workers_gone(text: str) -> None:
    """argparse type of the removed --workers: one error line naming what to do instead."""
    raise argparse.ArgumentTypeError("--workers is gone: its process pool was 2-3x slower than the default, which "
                                     "reads and reduces the parts in a thread per core; drop it (--threads N caps "
                                     "the threads, --engine ray spreads the parts over machines)")


def config_from_args(args: argparse.Namespace) -> AnalysisConfig:
    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(AnalysisConfig) if f.name not in _SKIP}
    return AnalysisConfig(**kw, threads=args.threads, strict=args.strict, use_cache=not args.no_cache,
                          **engines.options(args))


def run(args: argparse.Namespace) -> int:
    check_settings(args.settings)  # a bad --set is refused before the analysis reads or writes anything
    if args.out:
        checks.out_dir(args.out, "--out", args.run_dir)  # before the analysis writes its cache
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = analyze_run(args.run_dir, config_from_args(args))
    apply_settings(a.manifest, args.settings)
    for w in caught:
        sys.stderr.write(warning_line(w.message))
    if args.out:
        write_tables(a, args.out)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dg = diagnose(a)
    for w in caught:
        sys.stderr.write(warning_line(w.message))
    if args.json:
        print(json.dumps(summary(a, dg), indent=2, default=_json_default))
    else:
        print(render(a, dg))
    return 0


def write_tables(a: Analysis, out: Path) -> list[Path]:
    """steps, sequences, flags, alerts (and trainer_kl, steps_by_rank) as .parquet and .csv."""
    out.mkdir(parents=True, exist_ok=True)
    named = {"steps": a.steps, "sequences": a.sequences, "flags": a.flags, "alerts": a.alerts,
             "trainer_kl": a.trainer_kl, "steps_by_rank": a.steps_by_rank}
    written = []
    for name, table in named.items():
        if table is None:
            continue
        pq.write_table(table, out / f"{name}.parquet")
        pcsv.write_csv(table, out / f"{name}.csv")
        written += [out / f"{name}.parquet", out / f"{name}.csv"]
    return written


def superseded_line(rows: list[dict[str, int]]) -> str:
    """One line on the rows a restart superseded: how many, from which attempts of which ranks."""
    total = sum(r["rows"] for r in rows)
    where = ", ".join(f"rank {r['rank']} attempt {r['attempt']}: {r['rows']:,}" for r in rows)
    return (f"superseded: {total:,} rows of steps a later attempt recorded again were left out ({where}); "
            "they stay on disk (kldiag.open_run(RUN).read(include_superseded=True))")


def render(a: Analysis, diagnosis=None) -> str:
    """The verdict and causes, a readable per-step table (first and last rows when long), the alerts."""
    columns, rows = step_rows(a)  # what the run measured: no column of dashes for a run without logp_ref
    shown = rows if len(rows) <= MAX_ROWS else rows[: MAX_ROWS // 2] + [None] + rows[-MAX_ROWS // 2:]
    cells = [[num(r[c]) for c in columns] if r else ["..."] * len(columns) for r in shown]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = [f"run {a.run_dir}: {a.info.get('rows', 0):,} rows in {a.files} part file(s) "
             f"({a.files_new} analysed now), {a.steps.num_rows} steps"]
    if diagnosis is not None:
        lines.append(verdict_line(diagnosis))
    lines.append(flagged_line(a.steps))
    if a.superseded is not None and a.superseded.num_rows:
        lines.append(superseded_line(a.superseded.to_pylist()))
    if a.info.get("placeholders"):
        lines.append(f"placeholders: {a.info['placeholders']:,} tokens outside the loss hold 0.0 or NaN as "
                     "logp_sampler/logp_old (tool output, prompt echo); no figure reads them")
    lines.append("  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)))
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    if len(rows) > MAX_ROWS:
        lines.append(f"({len(rows) - MAX_ROWS} steps not shown; --out DIR or --json gives all)")
    lines.append("")
    lines.append(f"alerts ({a.alerts.num_rows} episodes):" if a.alerts.num_rows else "alerts: none")
    lines += [f"  [{r['severity']}] {r['kind']}: {r['message']}" for r in a.alerts.to_pylist()]
    if diagnosis is not None:
        lines += ["", format_diagnosis(diagnosis)]
    if a.skipped:
        lines.append(f"skipped {len(a.skipped)} unreadable part(s): " + ", ".join(a.skipped))
    lines += coverage.cannot_compute(a)
    lines += coverage_lines(coverage_of(a))
    if (stale := staleness_of(a))["versions"]:
        lines += staleness_lines(stale)
    return "\n".join(lines)
