"""Early-warning rules: leading indicators of a K3 blow-up (and of an entropy collapse), per step.

Each rule compares a step's *recent* level of one indicator, the median of its last `recent`
recorded steps (the step itself included, so 3 of 5 high steps make it high), with the run's own
*trailing baseline*, the median of the `baseline` recorded steps before those (at least
`min_history` of them finite: no warning before). A rule fires on a step where the recent level has
risen past its baseline by a factor and past an absolute floor (fallen, for the entropy):

  early_weight_trend   recent weight_k3_abs_p99 or _p999 >= weight_rise x its baseline and
                       >= weight_floor x weight_limit: the upper tail of |k3 weight| climbs
  early_blame_trend    recent blame_share >= blame_rise x its baseline and >= blame_floor
  early_flagged_trend  recent flagged_frac >= flagged_rise x max(baseline, 1/tokens), with a
                       recent flagged-token count >= flagged_min
  early_entropy_drop   recent entropy_mean <= (1 - entropy_drop) x its baseline and at least
                       entropy_min_drop nats below it; its value is the fall 1 - recent/baseline
                       (the entropy is the side scan's, kldiag/analysis/reducers/scan.py: only the
                       diagnosis's episodes have it)

kldiag.analysis.rules.episodes makes them rules (RULES) of severity "warning" (info when the loss is not
K3, except the entropy rule), subject to its persistence rule like every rule, and drops a K3 early
warning that starts inside a blow-up episode (it would warn of what is there). A warning episode makes no
verdict (kldiag.diagnosis.core.verdict). Thresholds: EarlyWarning (RuleConfig.early, read through DiagnosisConfig), kldiag's
own, chosen on the known-truth runs and the demo (docs/metrics.md, "Early warning"). Imports
nothing from kldiag.analysis.rules.episodes (which imports this module). Pure numpy on float64 arrays.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

Cols = Mapping[str, np.ndarray]


@dataclass(frozen=True)
class EarlyWarning:
    """Thresholds of the early-warning rules (every default on this screen; kldiag's own)."""

    recent: int = 5  # steps in the recent median (the step and the 4 before it)
    baseline: int = 50  # steps of the trailing baseline, just before the recent ones ...
    min_history: int = 10  # ... of which at least this many finite: no warning before
    weight_rise: float = 2.0  # recent p99 or p999 of |k3 weight| at least this x its baseline ...
    weight_floor: float = 0.5  # ... and at least this x weight_limit (5 with the default W = 10)
    blame_rise: float = 2.0  # recent blame share at least this x its baseline ...
    blame_floor: float = 0.1  # ... and at least this (a fifth of the blame_share rule's 0.5)
    flagged_rise: float = 3.0  # recent flagged fraction at least this x max(baseline, 1/tokens) ...
    flagged_min: float = 10.0  # ... with at least this many flagged tokens a step (recent median)
    entropy_drop: float = 0.2  # recent mean entropy at most (1 - this) x its baseline ...
    entropy_min_drop: float = 0.1  # ... and at least this many nats below it (a collapsed run's noise is no drop)


def _col(cols: Cols, name: str) -> np.ndarray:
    n = len(cols["step"])
    v = cols.get(name)
    return np.full(n, np.nan) if v is None else np.asarray(v, dtype=np.float64)


def rolling_median(v: np.ndarray, width: int, lag: int, need: int) -> np.ndarray:
    """Per row i: the median of the finite values among v[i-lag-width+1 .. i-lag], NaN with fewer than `need`."""
    n = len(v)
    if not n or width < 1:
        return np.full(n, np.nan)
    padded = np.concatenate([np.full(width + lag, np.nan), v])
    win = np.lib.stride_tricks.sliding_window_view(padded, width)[1:n + 1]  # row i ends at v[i - lag]
    count = np.isfinite(win).sum(axis=1)
    full, part = count == width, (count < width) & (count >= max(need, 1))
    med = np.full(n, np.nan)
    med[full] = np.median(win[full], axis=1)  # the common case, without nanmedian's cost
    if part.any():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            med[part] = np.nanmedian(win[part], axis=1)
    return med


def levels(v: np.ndarray, ew: EarlyWarning) -> tuple[np.ndarray, np.ndarray]:
    """(recent level, trailing baseline) of one indicator per step (NaN where there is too little)."""
    v = np.asarray(v, dtype=np.float64)
    recent = rolling_median(v, ew.recent, 0, math.ceil(ew.recent / 2))
    base = rolling_median(v, ew.baseline, ew.recent, ew.min_history)
    return recent, base


def _ge(a: np.ndarray, b: np.ndarray | float) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        return np.nan_to_num(a >= b, nan=False).astype(bool)


def _risen(v: np.ndarray, ew: EarlyWarning, rise: float, floor: float | np.ndarray) -> np.ndarray:
    recent, base = levels(v, ew)
    return _ge(recent, rise * base) & _ge(recent, floor) & np.isfinite(base)


def weight_trend(c: Cols, ctx: Any) -> tuple[np.ndarray, np.ndarray]:
    ew = ctx.config.early
    floor = ew.weight_floor * ctx.weight_limit
    p99, p999 = _col(c, "weight_k3_abs_p99"), _col(c, "weight_k3_abs_p999")
    return _risen(p99, ew, ew.weight_rise, floor) | _risen(p999, ew, ew.weight_rise, floor), p999


def blame_trend(c: Cols, ctx: Any) -> tuple[np.ndarray, np.ndarray]:
    ew = ctx.config.early
    v = _col(c, "blame_share")
    return _risen(v, ew, ew.blame_rise, ew.blame_floor), v


def flagged_trend(c: Cols, ctx: Any) -> tuple[np.ndarray, np.ndarray]:
    ew = ctx.config.early
    v, tokens = _col(c, "flagged_frac"), np.maximum(_col(c, "tokens"), 1.0)
    recent, base = levels(v, ew)
    count, _ = levels(v * tokens, ew)
    fire = _ge(recent, ew.flagged_rise * np.fmax(base, 1.0 / tokens)) & _ge(count, ew.flagged_min)
    return fire & np.isfinite(base), v


def entropy_drop(c: Cols, ctx: Any) -> tuple[np.ndarray, np.ndarray]:
    """Fires where the recent mean entropy is entropy_drop below its baseline; the value is that fall, as a
    share of the baseline (so the episode's peak is its steepest step)."""
    ew = ctx.config.early
    recent, base = levels(_col(c, "entropy_mean"), ew)
    with np.errstate(invalid="ignore", divide="ignore"):
        drop = np.where(_ge(base, 1e-12), 1.0 - recent / base, np.nan)
    return _ge(drop, ew.entropy_drop) & _ge(base - recent, ew.entropy_min_drop), drop


# kind, metric, fire, message ("{value}": the peak value); episodes.py makes them Rules, severity warning
EARLY: tuple[tuple[str, str, Any, str], ...] = (
    ("early_weight_trend", "weight_k3_abs_p999", weight_trend,
     "the upper tail of |k3 weight| climbs over its trailing baseline (p999 up to {value}): a K3 blow-up may follow"),
    ("early_blame_trend", "blame_share", blame_trend,
     "flagged tokens' share of the |k3 weight| climbs over its trailing baseline (up to {value})"),
    ("early_flagged_trend", "flagged_frac", flagged_trend,
     "the flagged-token fraction climbs over its trailing baseline (up to {value})"),
    ("early_entropy_drop", "entropy_drop", entropy_drop,
     "the mean entropy falls up to {value} below its trailing baseline: an entropy collapse may follow"),
)
EARLY_KINDS = tuple(k for k, *_ in EARLY)
EARLY_K3 = EARLY_KINDS[:3]  # about K3's weights: info when the loss is not K3
