"""`kldiag lab`: the estimator lab, a known-truth check of every estimator's gradient (kldiag.tools.lab).

In the spirit of Schulman (2020): pi_theta = N(mu, sigma), pi_ref = N(mu_ref, sigma_ref),
samples x from pi_old = N(mu_old, sigma_old) (pi_theta itself by default, the on-policy
case). For each estimator the sampled gradient w.r.t. theta = (mu, sigma) is

    g = mean_x( weight(x) * score(x) ),  score = grad_theta log pi_theta(x),

with `weight` taken from kldiag.estimators (the lab checks the library, not a copy), and
compared over many trials with the analytic gradients of KL(pi_theta||pi_ref) and of the
reverse KL(pi_ref||pi_theta). A loss built from the values differentiates to exactly this
g, since the weight is d(value)/d(log pi_theta) and x does not depend on theta.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from kldiag.tools.lab import LabConfig, format_table, run_lab


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("lab", help="known-truth check of every estimator's gradient on Gaussians",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = LabConfig()
    p.add_argument("--samples", type=int, default=d.samples, help="samples per trial (default %(default)s)")
    p.add_argument("--trials", type=int, default=d.trials, help="trials (default %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed,
                   help="seed of the samples (default %(default)s): the same seed gives the same table")
    p.add_argument("--mu-old", type=float, default=None, help="behaviour policy mean (off-policy case)")
    p.add_argument("--sigma-old", type=float, default=None, help="behaviour policy stdev (off-policy case)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.set_defaults(func=_main)



def _main(args: argparse.Namespace) -> int:
    cfg = LabConfig(samples=args.samples, trials=args.trials, seed=args.seed,
                    mu_old=args.mu_old, sigma_old=args.sigma_old)
    rows = run_lab(cfg)
    if args.json:
        print(json.dumps({"config": asdict(cfg), "rows": [asdict(r) for r in rows]}, indent=2))
    else:
        print(format_table(cfg, rows))
    return 0

