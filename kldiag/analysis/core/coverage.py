"""What an analysis cannot compute because the run lacks a column, said in words (`cannot_compute`).

The column may be missing because the run is an imported dump, or because the trainer does not
expose it; the sentences stand next to the null columns.

A metric is reported missing only when it is null on every step that has tokens: the
columns are judged from the per-step table, and the reason names the null input column
and, for an imported run, the framework whose dumps do not have it.
"""

from __future__ import annotations

import numpy as np

from kldiag.analysis.types import Analysis

# (step column that is null without the input, input column, what cannot be computed)
NEEDS = (
    ("k3_mean", "logp_ref", "the KL estimators (k1, k2, k3, k3_is), their gradient weights, blame share and the "
                            "theta_ll_ref / weight_blowup / clamp_saturated flags"),
    ("mismatch_kl", "logp_sampler", "the engine mismatch (mismatch_kl) and the sampler side of the drift split"),
    ("opsm_masked_frac", "advantage", "the off-policy sequence mask (opsm_masked_frac)"),
)


def cannot_compute(a: Analysis) -> list[str]:
    """One sentence per group of metrics the run's columns do not allow."""
    steps = a.steps
    if steps.num_rows == 0:
        return []
    tokens = np.asarray(steps.column("tokens").to_numpy(zero_copy_only=False)) > 0
    imported = a.manifest.config.get("import") or {}
    where = f" (the {imported['framework']} dumps do not have it)" if imported.get("framework") else ""
    out = []
    for column, needs, what in NEEDS:
        values = steps.column(column)
        if tokens.any() and values.null_count == steps.num_rows:
            out.append(f"cannot compute {what}: no {needs} in this run{where}")
    missing = set(imported.get("missing") or ())
    if "logp_old" in missing:
        out.append(f"no logp_old in this run{where}: rows are read as on-policy (rho = 1), so rho, drift, the "
                   "PPO clip fraction and k3_is's correction show the on-policy values")
    if "entropy" in missing:
        out.append(f"no entropy in this run{where}: entropy-based diagnoses are not available")
    return out

