"""Why a logged metric may differ from kldiag's recomputation: each hypothesis is an alternative
recomputation of the step's metrics from the same tokens, and names a reason only when its value
matches what the trainer logged.

Each transform is a pure function StepBatch -> StepBatch (padded float64 [B, T] arrays, see
kldiag.crosswalk.batch); the framework's own `step_metrics` then runs on the transformed batch,
so the same formula is evaluated under the alternative input:

- "nan_filtered": tokens with a NaN/inf log-prob dropped from the mask (a trainer's nanmean, or a
  logger that skips NaN); the crosswalk keeps them, so its value is NaN (null) there.
- "padding_included": the statistic over the whole padded [B, T] grid, the mask ignored: padding
  counts with the zeros frameworks pad log-probs with (a min/max/mean without the mask).
- "per_sample_vs_per_token": the other mean: the mean over sequences of each sequence's value, or
  the token-weighted mean of them, whichever the framework does not use (computed from one
  `step_metrics` call per sequence).
- "probabilities": probabilities fed where log-probs are expected (exp of every log-prob column).

One hypothesis needs no tokens: "logging_window", the mean of the recomputed per-step values over
the steps since the previous logged one (HF Trainer logs every `logging_steps`; TRL's GRPOTrainer
averages its `_metrics` lists over that window in `log()`, trl 1.16.0 `grpo_trainer.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from kldiag.crosswalk.batch import StepBatch

REASONS = {
    "logging_window": "the mean over the steps since the previous log (logging_steps > 1)",
    "nan_filtered": "the trainer dropped NaN/inf tokens (or the NaN step) that kldiag keeps",
    "padding_included": "the statistic includes padded / masked-out positions (their zeros)",
    "per_sample_vs_per_token": "a mean over sequences where kldiag averages over tokens, or the reverse",
    "probabilities": "computed on probabilities where log-probs are expected",
    "unexplained": "no tested hypothesis reproduces the logged value (another reduction or mode?)",
}
LOGP_COLUMNS = ("logp", "logp_old", "logp_ref", "logp_sampler")


def nan_filtered(b: StepBatch) -> StepBatch:
    """Mask out tokens where a recorded log-prob column (one with a finite masked value) is NaN/inf."""
    keep = b.mask.copy()
    for name in LOGP_COLUMNS:
        x = getattr(b, name)
        if np.isfinite(x[b.mask]).any():
            keep &= np.isfinite(x)
    return dataclasses.replace(b, mask=keep)


def padding_included(b: StepBatch) -> StepBatch:
    """Every [B, T] position in the mask; log-probs of positions outside the mask that are NaN become
    0.0, the value frameworks pad with (kldiag.crosswalk.batch.pad stores NaN for an absent logp_ref)."""
    off = ~b.mask
    cols = {n: np.where(off & ~np.isfinite(getattr(b, n)), 0.0, getattr(b, n)) for n in LOGP_COLUMNS}
    return dataclasses.replace(b, mask=np.ones_like(b.mask), **cols)


def in_probabilities(b: StepBatch) -> StepBatch:
    """exp() of each log-prob column: a formula for log-probs evaluated on probabilities."""
    with np.errstate(over="ignore"):
        return dataclasses.replace(b, **{n: np.exp(getattr(b, n)) for n in LOGP_COLUMNS})


def rows(b: StepBatch) -> list[StepBatch]:
    """The batch's sequences, one single-row StepBatch each."""
    def one(i: int) -> StepBatch:
        return StepBatch(b.step, b.seq[i:i + 1], b.mask[i:i + 1], b.logp[i:i + 1], b.logp_old[i:i + 1],
                         b.logp_ref[i:i + 1], b.logp_sampler[i:i + 1], b.advantage[i:i + 1], b.micro[i:i + 1],
                         b.iteration[i:i + 1])
    return [one(i) for i in range(len(b.seq)) if b.mask[i].any()]


Metrics = Callable[[StepBatch, list[StepBatch] | None], dict[str, float]]


def metrics_fn(mod, settings) -> Metrics:
    """(batch, the step's loss calls or None) -> {name: finite value} with the framework's step_metrics."""
    needs_calls = getattr(mod, "NEEDS_ALL_ITERATIONS", False)

    def run(b: StepBatch, calls: list[StepBatch] | None) -> dict[str, float]:
        try:
            with np.errstate(all="ignore"):
                values, _ = mod.step_metrics(b, settings, calls) if needs_calls else mod.step_metrics(b, settings)
        except (ValueError, ZeroDivisionError, IndexError):  # a transform the formula cannot take
            return {}
        return {k: float(v) for k, v in values.items() if v is not None and np.isfinite(v)}
    return run


def row_means(metrics: Metrics, b: StepBatch, calls: list[StepBatch] | None) -> list[dict[str, float]]:
    """[per-sample mean, token-weighted mean] of each metric over the step's sequences: one `metrics`
    call per sequence; with loss calls (TRL's `kl`), over the calls' sequences, every iteration (a
    reused sequence counts once per pass, as it does in the trainer's loss calls)."""
    per_row = [(metrics(r, [r] if calls is not None else None), float(r.mask.sum()))
               for src in (calls if calls else [b]) for r in rows(src)]
    sample, token = {}, {}
    for n in {k for vals, _ in per_row for k in vals}:
        v = np.array([vals[n] for vals, _ in per_row if n in vals])
        w = np.array([c for vals, c in per_row if n in vals])
        sample[n] = float(v.mean())
        token[n] = float((v * w).sum() / w.sum())
    return [sample, token]


def window_mean(values: dict[int, float | None], logged_steps: list[int], step: int) -> float | None:
    """Mean of the recomputed `values` over the steps after the previous logged step up to `step`
    (from the first recorded step when `step` is the first logged one); None for a one-step window
    (no alternative) or a window with a null."""
    prev = max((s for s in logged_steps if s < step), default=None)
    window = [v for s, v in values.items() if s <= step and (prev is None or s > prev)]
    if len(window) < 2 or any(v is None for v in window):
        return None
    return float(np.mean(window))


TRANSFORMS: dict[str, Callable[[StepBatch], StepBatch]] = {
    "nan_filtered": nan_filtered, "padding_included": padding_included, "probabilities": in_probabilities}


def alternatives(metrics: Metrics, b: StepBatch, calls: list[StepBatch] | None) -> list[tuple[str, dict[str, float]]]:
    """[(reason, {name: the metric recomputed under that hypothesis})], in the order reasons are named."""
    out = []
    for reason in ("nan_filtered", "padding_included"):
        t = TRANSFORMS[reason]
        out.append((reason, metrics(t(b), [t(c) for c in calls] if calls is not None else None)))
    out.extend(("per_sample_vs_per_token", vals) for vals in row_means(metrics, b, calls))
    t = TRANSFORMS["probabilities"]
    out.append(("probabilities", metrics(t(b), [t(c) for c in calls] if calls is not None else None)))
    return out
