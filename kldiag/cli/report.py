"""`kldiag report RUN_DIR`: a post-mortem of one run, as one offline HTML file and a text summary.

Built on `kldiag.analyze`. The verdict comes from small rules (pure functions of per-step
arrays), each with a name that `--fail-on` accepts, so a CI job or a cron can gate on them:

  blowup      the gradient weight of the KL loss the run uses exceeds --blowup-weight (default
              100: ten times the per-token flag limit) on some token: K3's 1 - pi_ref/pi_theta
              (DeepSeek-V3.2 section 3.1), or rho * log(pi_theta/pi_ref) for k3_is (eq. 9)
  nonfinite   a NaN/inf log-prob, or a log-prob above 0, was recorded
  blame       under a K3 loss, a step where flagged tokens carry over half of the |k3 weight|
  latent      K3's weight on this run's own tokens exceeds --blowup-weight, whatever loss the run
              uses (a K3 run would blow up on these tokens; K3 *values* logged here are huge)
  mismatch    sampler/trainer mismatch dominates: the mean KL(mu||pi_old) per token exceeds
              --mismatch-kl (default 0.01) and its typical |log ratio|, sqrt(2 KL), exceeds the
              policy drift mean |log pi_theta - log pi_old|

Verdict: "unstable" when blowup or nonfinite fires, "warning" when blame or mismatch fires,
"healthy" otherwise (latent is a note). `--fail-on blowup,nonfinite` (or `all`) exits 1 when
any named rule fires. The text summary and the HTML page are rendered by kldiag.report.render.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from kldiag.analysis import engines
from kldiag.analysis.engine import analyze as analyze_run
from kldiag.analysis.types import AnalysisConfig
from kldiag.report.build import RULE_NAMES, ReportConfig, build_report, exit_code, parse_rules


def _rules_arg(text: str) -> tuple[str, ...]:
    try:
        return parse_rules(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None



def run(args: argparse.Namespace, analyze: Callable[..., Any] | None = None) -> int:
    analysis = (analyze or analyze_run)(args.run_dir, AnalysisConfig(**engines.options(args)))
    cfg = ReportConfig(blowup_weight=args.blowup_weight, mismatch_kl=args.mismatch_kl)
    rep = build_report(analysis, cfg)
    from kldiag.report.render import format_text, write_html  # plotly: only when rendering

    path = write_html(rep, args.output)
    print(format_text(rep))
    print(f"report: {path}")
    code = exit_code(rep, args.fail_on)
    if code:
        print(f"kldiag report: failing on {', '.join(sorted(rep.fired() & set(args.fail_on)))}", file=sys.stderr)
    return code



def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("report", help="post-mortem of a run: HTML report, verdict, exit code for CI",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory written by kldiag.Recorder")
    p.add_argument("-o", "--output", default="report.html", help="HTML file to write (default ./report.html)")
    p.add_argument("--fail-on", type=_rules_arg, default=(), metavar="RULES",
                   help=f"comma list of rules ({', '.join(RULE_NAMES)}) or 'all': exit 1 when one fires")
    p.add_argument("--blowup-weight", type=float, default=ReportConfig.blowup_weight,
                   help="|gradient weight| of the loss beyond which a token is a blow-up (default 100)")
    p.add_argument("--mismatch-kl", type=float, default=ReportConfig.mismatch_kl,
                   help="mean KL(mu||pi_old) per token above which mismatch can dominate (default 0.01)")
    engines.add_arguments(p)
    p.set_defaults(func=run)

