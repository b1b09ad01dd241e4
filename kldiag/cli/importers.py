"""`kldiag import {slime,nemo-rl,prime-rl} SRC RUN`: a framework's per-token dumps into a kldiag run.

Running it again imports only the dump files not imported before. docs/import.md has the
field mapping of each framework.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Any

from kldiag.cli import warning_line
from kldiag.errors import KldiagError
from kldiag.importers import FRAMEWORKS, import_dumps


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("import", help="import slime / NeMo-RL / prime-rl dumps into a run",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("framework", choices=list(FRAMEWORKS), metavar="FRAMEWORK",
                   help=f"one of {', '.join(FRAMEWORKS)}")
    p.add_argument("src", metavar="SRC", help="the dump directory (or one dump file)")
    p.add_argument("run", metavar="RUN", help="the kldiag run directory or URI to write (created if new)")
    p.add_argument("--strict", action="store_true", help="fail on a corrupt or foreign file instead of skipping it")
    p.add_argument("--trust-pickle", action="store_true",
                   help="slime: load dumps that torch.load(weights_only=True) refuses (runs pickled code)")
    p.add_argument("--group-size", type=int, default=None,
                   help="samples per prompt (slime --n-samples-per-prompt, NeMo-RL num_generations_per_prompt): "
                        "group ids from sample positions when the dump has none")
    p.add_argument("--kl-loss-type", choices=("k1", "k2", "k3", "low_var_kl"), default=None,
                   help="slime: the run's --kl-loss-type, for the trainer-compatible KL")
    p.add_argument("--use-unbiased-kl", action="store_true", default=None,
                   help="slime: the run used --use-unbiased-kl")
    p.add_argument("--kl-loss-coef", type=float, default=None, help="slime: the run's --kl-loss-coef (beta)")
    p.add_argument("--config", metavar="FILE", default=None,
                   help="nemo-rl: the run's config (YAML or JSON): global batches per step for the crosswalk, "
                        "the KL type, group size and sampling settings")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if "://" not in args.run and Path(args.run).is_file():
        raise KldiagError(f"RUN {args.run} is a file: pass a directory for the run (new, or a run imported "
                          "before, to add the new dumps)")
    options = {"trust_pickle": args.trust_pickle, "group_size": args.group_size,
               "kl_loss_type": args.kl_loss_type, "use_unbiased_kl": args.use_unbiased_kl,
               "kl_loss_coef": args.kl_loss_coef}
    if args.config is not None:
        if args.framework != "nemo-rl":
            raise KldiagError(f"--config is read for nemo-rl imports only, not {args.framework}; drop it")
        from kldiag.importers.nemo_rl import read_run_config  # start-up: `kldiag --help` does not load it

        options = {**read_run_config(args.config), **{k: v for k, v in options.items() if v is not None}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = import_dumps(args.framework, args.src, args.run, strict=args.strict, **options)
    for w in caught:
        if "skipping" not in str(w.message):  # skipped files are listed in the summary below
            sys.stderr.write(warning_line(w.message))
    print("\n".join(result.lines()))
    return 0
