"""Crosswalk: each framework's own KL / importance-sampling / mismatch metrics, from the recorded tokens.

Per step, the metrics a framework logs, under its own names, recomputed from the recorded tokens
with that framework's semantics (docs/crosswalk.md).

    table = kldiag.crosswalk("runs/r1", "verl", rollout_is="token", rollout_is_threshold=2.0)

One module per framework (verl, trl, slime, nemo_rl, openrlhf, skyrl, areal), each with `Settings` (the framework's
own config keys), `step_metrics(batch, settings) -> (metrics, {name: why null})` and `metric_names`.
The table has a `step` column and one float64 column per metric (null where the run lacks the data);
its schema metadata `kldiag.null_reasons` (JSON {name: why}) says why a column is null, and
`kldiag.step_null_reasons` (JSON {step: {name: why}}) why a value is null at a step where the reason is
the step's own: non-finite log-probs there ("non-finite inputs at step S"), not the data's absence.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import pyarrow as pa

from kldiag.crosswalk import areal, nemo_rl, openrlhf, skyrl, slime, trl, verl
from kldiag.crosswalk.core import (
    ALIASES,
    FRAMEWORKS,
    LOGPS,
    STEP_NULL,
    CrosswalkError,
    crosswalk,
    framework_names,
    framework_of,
    loss_calls,
    module,
    nonfinite_inputs,
    null_reasons,
    parse_settings,
    records,
    require_framework,
)

__all__ = ["ALIASES", "FRAMEWORKS", "LOGPS", "STEP_NULL", "CrosswalkError", "areal", "crosswalk", "framework_names",
           "framework_of", "loss_calls", "module", "nemo_rl", "nonfinite_inputs", "null_reasons", "openrlhf",
           "parse_settings", "records", "require_framework", "skyrl", "slime", "trl", "verl"]


class _CallableModule(type(json)):
    """`kldiag.crosswalk(run, framework, ...)` works although importing this package makes
    `kldiag.crosswalk` the module: calling the module calls crosswalk()."""

    def __call__(self, run, framework: str, **settings: Any) -> pa.Table:
        return crosswalk(run, framework, **settings)


sys.modules[__name__].__class__ = _CallableModule
