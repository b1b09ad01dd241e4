"""Choosing the analysis engine from the faces: `--engine local|ray [--ray-address ADDR]`.

`kldiag analyze`, `report` and `dashboard` share these options. The dashboard runs the
analysis in its Streamlit process, so it hands the choice over in the environment
(ENGINE_ENV, RAY_ADDRESS_ENV) and the app reads it back with `from_env`.
"""

from __future__ import annotations

import argparse
import os

ENGINES = ("local", "ray")
ENGINE_ENV = "KLDIAG_ENGINE"
RAY_ADDRESS_ENV = "KLDIAG_RAY_ADDRESS"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", choices=ENGINES, default="local",
                   help="local: this machine (default); ray: one Ray task per part (pip install 'kldiag[ray]')")
    p.add_argument("--ray-address", metavar="ADDR", default=None,
                   help="--engine ray: the cluster to use (default: RAY_ADDRESS's, else a local Ray)")


def options(args: argparse.Namespace) -> dict[str, str | None]:
    """AnalysisConfig keywords from parsed arguments."""
    return {"engine": getattr(args, "engine", "local"), "ray_address": getattr(args, "ray_address", None)}


def to_env(args: argparse.Namespace, env: dict[str, str]) -> dict[str, str]:
    """`env` with the engine choice of `args` (the dashboard's Streamlit process reads it)."""
    opts = options(args)
    env[ENGINE_ENV] = str(opts["engine"])
    if opts["ray_address"]:
        env[RAY_ADDRESS_ENV] = str(opts["ray_address"])
    else:
        env.pop(RAY_ADDRESS_ENV, None)
    return env


def from_env(environ: dict[str, str] | None = None) -> dict[str, str | None]:
    """AnalysisConfig keywords from the environment (local when unset)."""
    environ = os.environ if environ is None else environ
    engine = environ.get(ENGINE_ENV) or "local"
    if engine not in ENGINES:
        raise ValueError(f"{ENGINE_ENV}={engine!r} must be one of {', '.join(ENGINES)}")
    return {"engine": engine, "ray_address": environ.get(RAY_ADDRESS_ENV) or None}
