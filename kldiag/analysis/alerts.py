"""Alerts: the steps where something changes, each with a one-line explanation.

- `weight_blowup_onset`: max |k3 weight| jumps by alert_factor over the median of the
  previous alert_window steps and exceeds weight_limit (a jump from 0.01 to 0.1 is not a
  blow-up); one alert per onset (the step before did not fire).
- `flagged_onset`: the flagged fraction jumps by alert_factor over its trailing median,
  with at least 10 flagged tokens (the median is floored at 1/tokens so a run of zeros
  does not turn one token into an infinite jump).
- `nonfinite` / `invalid`: the first step with a NaN/inf, or a positive, log-prob.
- `blame_share`: every step where flagged tokens carry more than half of the |k3 weight|.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kldiag.analysis.types import ALERT_COLUMNS, AnalysisConfig

MIN_FLAGGED = 10


def trailing_median(v: np.ndarray, window: int) -> np.ndarray:
    """Median of the previous `window` values, ignoring NaN; NaN where there is no history."""
    out = np.full(len(v), np.nan)
    for i in range(1, len(v)):
        past = v[max(0, i - window):i]
        past = past[~np.isnan(past)]
        if len(past):
            out[i] = np.median(past)
    return out


def _onsets(fire: np.ndarray) -> np.ndarray:
    prev = np.concatenate([[False], fire[:-1]])
    return np.flatnonzero(fire & ~prev)


def _col(steps: pa.Table, name: str) -> np.ndarray:
    return steps.column(name).to_numpy(zero_copy_only=False).astype(np.float64)


def compute_alerts(steps: pa.Table, flags: pa.Table, cfg: AnalysisConfig) -> pa.Table:
    """ALERT_COLUMNS rows, sorted by step."""
    rows: list[tuple] = []
    if steps.num_rows:
        step = steps.column("step").to_numpy()
        rows += _jumps(step, _col(steps, "weight_k3_abs_max"), cfg, "weight_blowup_onset", "weight_k3_abs_max",
                       floor=None, gate=cfg.weight_limit)
        tokens = np.maximum(_col(steps, "tokens"), 1.0)
        frac = _col(steps, "flagged_frac")
        rows += _jumps(step, frac, cfg, "flagged_onset", "flagged_frac", floor=1.0 / tokens,
                       gate=None, min_count=MIN_FLAGGED / tokens)
        rows += _first_bad(step, steps, flags)
        share = _col(steps, "blame_share")
        for i in np.flatnonzero(np.nan_to_num(share) > 0.5):
            rows.append((int(step[i]), "blame_share", "blame_share", float(share[i]), 0.5,
                         f"step {step[i]}: flagged tokens carry {share[i]:.0%} of the total |k3 weight| "
                         "(a few tokens dominate the KL gradient)"))
    rows.sort(key=lambda r: (r[0], r[1]))
    cols = list(zip(*rows, strict=True)) if rows else [[] for _ in ALERT_COLUMNS]
    types = (pa.int64(), pa.string(), pa.string(), pa.float64(), pa.float64(), pa.string())
    return pa.table([pa.array(list(c), t) for c, t in zip(cols, types, strict=True)], names=list(ALERT_COLUMNS))


def _jumps(step, v, cfg: AnalysisConfig, kind: str, metric: str, floor, gate, min_count=None) -> list[tuple]:
    base = trailing_median(v, cfg.alert_window)
    if floor is not None:
        base = np.maximum(base, floor)
    with np.errstate(invalid="ignore"):
        fire = v > cfg.alert_factor * base
        if gate is not None:
            fire &= v > gate
        if min_count is not None:
            fire &= v >= min_count
    out = []
    for i in _onsets(np.nan_to_num(fire, nan=False).astype(bool)):
        jump = f"{v[i] / base[i]:.0f}x" if base[i] > 0 else "up from 0"
        out.append((int(step[i]), kind, metric, float(v[i]), float(base[i]),
                    f"step {step[i]}: {metric} = {v[i]:.3g}, {jump} its median over the previous "
                    f"{cfg.alert_window} steps ({base[i]:.3g})"))
    return out


def _first_bad(step, steps: pa.Table, flags: pa.Table) -> list[tuple]:
    out = []
    for kind, col, what, note in (("nonfinite", "nonfinite_count", "a NaN or infinite log-prob", "; means skip it"),
                                  ("invalid", "invalid_count", "a log-prob above 0 (probability > 1)", "")):
        count = steps.column(col).to_numpy()
        hits = np.flatnonzero(count > 0)
        if not len(hits):
            continue
        i = hits[0]
        where = _locate(flags, kind, int(step[i]))
        out.append((int(step[i]), kind, col, float(count[i]), 0.0,
                    f"step {step[i]}: first {what} ({count[i]} token(s) this step{where}){note}"))
    return out


def _locate(flags: pa.Table, kind: str, step: int) -> str:
    if not flags.num_rows:
        return ""
    fired = flags.filter(pc.and_(flags.column(kind), pc.equal(flags.column("step"), step)))
    if not fired.num_rows:
        return ""
    row = fired.slice(0, 1).to_pylist()[0]
    return f", first at seq {row['seq']} pos {row['pos']} rank {row['rank']}"
