"""The figures several pages show, computed once so that they agree: the run's flagged count
(the analysis's, docs/metrics.md), what the Tokens page's table holds against it, the order the
Sequence page offers sequences in (faults first), and each run's own loss weight for Compare."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pandas as pd

from kldiag.views.charts import name_of
from kldiag.views.pages import FLAG_NAMES, compare_steps


def flagged_total(steps: pd.DataFrame) -> tuple[int, int]:
    """(flagged tokens, tokens in the loss) of the run, from its steps table: the one "flagged"
    figure every page shows (docs/metrics.md: any flag, non-finite and invalid log-probs included)."""
    if steps.empty:
        return 0, 0
    tokens = steps["tokens"].to_numpy(dtype=np.float64)
    frac = steps["flagged_frac"].to_numpy(dtype=np.float64, na_value=np.nan)
    return int(np.rint(np.nansum(frac * tokens))), int(tokens.sum())


def flags_caption(flags: pd.DataFrame, shown: int, steps: pd.DataFrame) -> str:
    """What the Tokens page's table holds against the run's flagged count, in one sentence:
    "the 1,000 worst of the run's 6,229 flagged tokens", or the worst by |k3 weight| and the bad rows."""
    total, tokens = flagged_total(steps)
    bad = (flags["nonfinite"].fillna(False).astype(bool) | flags["invalid"].fillna(False).astype(bool)).to_numpy()
    flagged = flags[list(FLAG_NAMES)].fillna(False).astype(bool).any(axis=1).to_numpy()
    run = f"{total / tokens:.3%} of {tokens:,} tokens, as on the Overview" if tokens else "no tokens"
    if flagged.all() and not bad.any():
        held = f"the {len(flags):,} worst (largest |k3 weight|) of the run's {total:,} flagged tokens ({run})"
    else:
        held = f"the {int((~bad).sum()):,} tokens with the largest |k3 weight| ({int((flagged & ~bad).sum()):,} " \
               "of them flagged)"
        if bad.any():
            held += f" and every one with a non-finite or invalid log-prob ({int(bad.sum()):,}, listed first)"
        held += f"; the run has {total:,} flagged tokens ({run})"
    head = f"{shown:,} of {len(flags):,} tokens match the filters. " if shown != len(flags) else ""
    return f"{head}The table holds {held}."


def fault_first(sequences: pd.DataFrame) -> pd.DataFrame:
    """Sequences in the order the Sequence page offers them: those with a non-finite log-prob first
    (most first), then by max |k3 weight|, largest first; a NaN weight counts as the largest."""
    nf = sequences["nonfinite_count"].fillna(0) if "nonfinite_count" in sequences.columns else 0
    w = sequences["weight_k3_abs_max"].astype(np.float64).fillna(np.inf)
    return sequences.assign(_nf=nf, _w=w).sort_values(["_nf", "_w", "step", "seq"],
                                                      ascending=[False, False, True, True],
                                                      kind="stable").drop(columns=["_nf", "_w"])


# The steps table's |gradient weight| columns of each loss estimator (docs/metrics.md, steps)
LOSS_WEIGHT = {"k3": "weight_k3_abs", "k3_is": "weight_k3_is_abs"}


def loss_weight_column(config: Mapping | None, stat: str = "max") -> tuple[str, str]:
    """(steps column, estimator) of the |weight| the run's own loss gives each token: the manifest
    config's estimator (k3 when it names none); an estimator without such a column falls back to k3's."""
    est = str((config or {}).get("estimator") or "k3")
    return f"{LOSS_WEIGHT.get(est, 'weight_k3_abs')}_{stat}", est


def compare_own(steps: Mapping[str, pd.DataFrame], columns: Mapping[str, str]) -> pd.DataFrame:
    """Long frame (run, step, value, column): each run's own column (its loss weight), one chart."""
    frames = [compare_steps({name: df}, columns[name]).assign(column=columns[name]) for name, df in steps.items()]
    return pd.concat(frames, ignore_index=True) if frames else compare_steps({}, "")


UNITS = (("_count", "tokens"), ("_frac", "share (0 to 1)"), ("_share", "share (0 to 1)"), ("rho_ess", "share (0 to 1)"),
         ("rho", "ratio"), ("weight", "per token, no unit"), ("mean", "nats per token"), ("kl", "nats per token"),
         ("tokens", "tokens"), ("sequences", "sequences"))


def metric_label(column: str) -> str:
    """A steps column in words with the column after it: 'engine mismatch KL(mu||pi_old) (mismatch_kl)'."""
    words = name_of(column)
    return words if words == column else f"{words} ({column})"


def metric_axis(column: str) -> str:
    """The y-axis title of a steps column: its words and unit."""
    unit = next((u for key, u in UNITS if key in column), "")
    return f"{name_of(column)} ({unit})" if unit else name_of(column)


FIRST_WITHOUT_WEIGHTS = ("mismatch_kl", "drift_abs_mean", "rho_max", "rho_mean", "rho_clip_frac")


def measured_metrics(steps: Sequence[pd.DataFrame], metrics: Sequence[str]) -> list[str]:
    """The metrics that some run holds a value of (a column all null in every run is left out); the engine
    mismatch, drift and rho first (what a run without logp_ref opens on), then the rest in table order."""
    have = [m for m in metrics if any(m in df and df[m].notna().any() for df in steps)]
    return [m for m in FIRST_WITHOUT_WEIGHTS if m in have] + [m for m in have if m not in FIRST_WITHOUT_WEIGHTS]


def loss_caption(config: Mapping | None) -> str:
    """What a run's loss uses as its KL term: 'loss estimator: k3', or that beta = 0 leaves it out."""
    config = config or {}
    beta = config.get("beta")
    if beta is not None and float(beta) == 0.0:
        return "no KL term in the loss (beta = 0)"
    return f"loss estimator: {config.get('estimator') or 'k3 (assumed)'}"
