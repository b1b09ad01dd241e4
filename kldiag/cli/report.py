"""`kldiag report RUN`: a post-mortem of one run, as one offline HTML file and a text summary.

Built on `kldiag.analyze` and `kldiag.diagnosis.diagnose`: the verdict, what fired (the causes and
the alert episodes), the recommendations (each cause's fix, in the run's trainer's own option
names) and the exit code all come from the one diagnosis that `kldiag analyze`, `kldiag watch`
and the dashboard show. --blowup-weight and --mismatch-kl set its DiagnosisConfig.

--fail-on RULES (a comma list) exits 1 when the diagnosis holds an episode of a named kind or a
cause of a named name, whatever its severity, and names it on stderr; 0 otherwise. Names: every
episode kind, every cause name (docs/metrics.md), and these, each standing for

  blowup     a `blowup` episode (the weight of the run's own KL loss past --blowup-weight,
             default 100: K3's 1 - pi_ref/pi_theta, or k3_is's rho log(pi_theta/pi_ref)),
             or the `k3_weight_blowup` cause
  nonfinite  a `nonfinite` or `invalid` episode (a NaN/inf log-prob, a log-prob above 0), or the
             `numerical_fault` cause
  blame      a `blame_share` episode (flagged tokens carry over half of the |k3 weight|)
  latent     a `latent` episode (K3's weight past --blowup-weight on a run whose loss is not K3)
  mismatch   a `mismatch` episode (mean KL(mu||pi_old) per token past --mismatch-kl, default
             0.01, and its typical |log ratio| above the policy drift), or any `engine_*` cause
             (engine_mismatch, engine_temperature_mismatch and the mismatch root causes)
  jump       a `weight_blowup_onset` or `flagged_onset` episode
  early      an early-warning episode (early_weight_trend, early_blame_trend, early_flagged_trend,
             early_entropy_drop: a leading indicator climbs before a blow-up or a collapse)
  all        every episode kind and every cause

Verdict (the diagnosis's): "unstable" when a cause or an episode is critical, "warning" when a
cause is a warning, "healthy" otherwise. Rendered by kldiag.report.render.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from kldiag.analysis import analyze as analyze_run
from kldiag.analysis.rules import episodes as EP
from kldiag.analysis.types import AnalysisConfig
from kldiag.cli import args as checks
from kldiag.cli import engine_opts as engines
from kldiag.diagnosis import CAUSE_NAMES, DiagnosisConfig
from kldiag.diagnosis.routing import apply_settings, check_settings
from kldiag.report.build import Report, ReportConfig, build_report, reducers

# --fail-on names that stand for several episode kinds and causes (the report's older rules first).
ALIASES: dict[str, tuple[str, ...]] = {
    "blowup": ("blowup", "k3_weight_blowup"),
    "nonfinite": ("nonfinite", "invalid", "numerical_fault"),
    "blame": ("blame_share",),
    "latent": ("latent",),
    "mismatch": ("mismatch", *(c for c in CAUSE_NAMES if c.startswith("engine_"))),
    "jump": EP.ALIASES["jump"],
    "early": EP.ALIASES["early"],
    "all": (*EP.KINDS, *CAUSE_NAMES),
}
NAMES = tuple(dict.fromkeys((*ALIASES, *EP.KINDS, *CAUSE_NAMES)))  # what --fail-on accepts


def parse_fail_on(text: str) -> tuple[str, ...]:
    """'blowup,numerical_fault' -> the episode kinds and cause names they stand for (ALIASES)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in NAMES]
    if unknown or not names:
        raise ValueError(f"unknown rule(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(NAMES)}")
    return tuple(dict.fromkeys(x for n in names for x in ALIASES.get(n, (n,))))


def failing(rep: Report, fail_on: tuple[str, ...]) -> list[str]:
    """'cause k3_weight_blowup (critical, from step 36)' for each named cause or episode kind present."""
    out = [f"cause {c.cause} ({c.severity}" + (f", from step {c.onset})" if c.onset is not None else ")")
           for c in rep.diagnosis.causes if c.cause in fail_on]
    first: dict[str, int] = {}
    for e in rep.diagnosis.episodes:
        if e.kind in fail_on:
            first.setdefault(e.kind, e.start)
    return out + [f"episode {kind} (from step {step})" for kind, step in first.items()]


def _rules_arg(text: str) -> tuple[str, ...]:
    try:
        return parse_fail_on(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None



def run(args: argparse.Namespace, analyze: Callable[..., Any] | None = None) -> int:
    check_settings(getattr(args, "settings", []))  # a bad --set, like a bad -o, before the analysis writes its cache
    checks.out_file(args.output, "-o", args.run_dir)  # before the analysis writes its cache
    cfg = ReportConfig(diagnosis=DiagnosisConfig(blowup_weight=args.blowup_weight, mismatch_kl=args.mismatch_kl))
    # one read of each part for everything the report shows (none while the run's cache is warm)
    analysis = (analyze or analyze_run)(args.run_dir, AnalysisConfig(**engines.options(args)), reducers(cfg))
    apply_settings(analysis.manifest, getattr(args, "settings", []))
    rep = build_report(analysis, cfg)
    from kldiag.report.render import format_text, write_html  # plotly: only when rendering

    path = write_html(rep, args.output)
    print(format_text(rep))
    print(f"report: {path}")
    hit = failing(rep, args.fail_on)
    if hit:
        print(f"kldiag report: failing on {'; '.join(hit)}", file=sys.stderr)
    return 1 if hit else 0



def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("report", help="post-mortem of a run: HTML report, verdict, exit code for CI",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", metavar="RUN", type=checks.run_dir,
                   help="a run directory written by kldiag.Recorder, or its URI (s3://bucket/prefix)")
    p.add_argument("-o", "--output", default="report.html",
                   help="HTML file to write (default ./report.html), outside the run; an earlier kldiag "
                        "report there is replaced, any other file is refused")
    p.add_argument("--fail-on", type=_rules_arg, default=(), metavar="RULES",
                   help=f"comma list of {', '.join(ALIASES)} (see above), episode kinds ({', '.join(EP.KINDS)}) "
                        f"or causes ({', '.join(CAUSE_NAMES)}): exit 1 when one is in the diagnosis")
    p.add_argument("--blowup-weight", type=checks.positive(float), default=DiagnosisConfig.blowup_weight,
                   help="DiagnosisConfig.blowup_weight: |gradient weight| of the loss beyond which a token is a "
                        "blow-up (default 100)")
    p.add_argument("--mismatch-kl", type=checks.positive(float), default=DiagnosisConfig.mismatch_kl,
                   help="DiagnosisConfig.mismatch_kl: mean KL(mu||pi_old) per token above which mismatch can "
                        "dominate (default 0.01)")
    p.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                   help="a run setting the manifest lacks, for the diagnosis (repeatable): routing_replay=R3|true, "
                        "rollout_dtype=fp8, true_on_policy=true")
    engines.add_arguments(p)
    p.set_defaults(func=run)

