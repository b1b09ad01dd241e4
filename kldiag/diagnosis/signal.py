"""`kl_dominated_signal`: GRPO groups with zero advantage variance take over the batch, and their tokens move by
the KL term alone.

Read from the `signal` reducer (kldiag.analysis.reducers.signal; diagnosis.core.reducers() lists it). Per step:

    dead      the share of prompt groups (two or more completions) whose advantages are all equal is at least
              SignalConfig.dead_share (slime logs it as rollout/zero_std; prime-rl warns when at most 10% of the
              samples are trainable, prime-rl issue #2277)
    KL alone  the share of the step's loss tokens whose advantage is 0 (so the KL term is their only gradient)
              is at least SignalConfig.kl_alone_share: the KL term carries the update of most tokens
    KL term   the run's loss has a KL term on pi_ref (manifest beta > 0, log pi_ref recorded)

The onset is the first sustained step (DiagnosisConfig.persistence) where all three hold. The KL term's share of
the gradient weight mass, beta sum |w_K| / (beta sum |w_K| + sum |A rho|) (docs/metrics.md), is the evidence of how
much of the gradient it is: a live token's |A rho| is about 1 and a KL weight beta |w_K| at most a few beta, so that
share stays below one half until nearly every group is dead, while the tokens it alone moves are most of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kldiag.analysis.reducers import signal as SG
from kldiag.analysis.rules import episodes as EP
from kldiag.analysis.rules.episodes import Persistence
from kldiag.analysis.runtime.runner import reduced
from kldiag.diagnosis import causes as C
from kldiag.diagnosis.types import Cause
from kldiag.frameworks import fix_for


@dataclass(frozen=True)
class SignalConfig:
    """Thresholds of kl_dominated_signal (kldiag's own; every default on this screen)."""

    dead_share: float = 0.5  # share of a step's groups with zero advantage variance, at least
    kl_alone_share: float = 0.5  # share of a step's loss tokens moved by the KL term alone, at least
    window: int = 8  # steps pooled (trailing) before the shares are judged: a step has few groups
    persistence: Persistence = Persistence(steps=3, window=5, share=0.5, span=20)  # of the pooled shares: a level
    # held, not a rare event coming back
    examples: int = 8  # steps and group ids listed in the evidence


def signal_of(analysis) -> dict:
    """The signal reducer's merged partial (the one the analysis read along, else one more pass)."""
    return reduced(analysis, SG.SignalReducer())


def beta_of(manifest) -> float:
    try:
        return float(((getattr(manifest, "config", None) or {}).get("beta")) or 0.0)
    except (TypeError, ValueError):
        return 0.0


def _mean(v: np.ndarray) -> float | None:
    return float(np.nanmean(v)) if np.isfinite(v).any() else None


def _pooled(v: np.ndarray, w: int) -> np.ndarray:
    """Trailing sums over w steps (fewer at the start)."""
    c = np.cumsum(np.nan_to_num(v.astype(np.float64)))
    return c - np.r_[np.zeros(min(w, len(c))), c[:-w]] if len(c) > w else c


def _fire(ps: dict, config: SignalConfig) -> np.ndarray:
    """Per step, the three conditions on the shares pooled over the trailing `window` steps."""
    w = config.window
    with np.errstate(invalid="ignore", divide="ignore"):
        dead = _pooled(ps["dead_groups"], w) / _pooled(ps["groups"], w)
        alone = _pooled(ps["kl_alone_tokens"], w) / _pooled(ps["tokens"], w)
    return EP.gt(dead, config.dead_share) & EP.gt(alone, config.kl_alone_share) & np.isfinite(ps["kl_mass"])


def _onset(ps: dict, fire: np.ndarray, config: SignalConfig) -> int | None:
    """The first step, in the pooled window of the first sustained pooled step, whose own shares pass the
    thresholds (the pooling lags the change by up to `window` steps); None when nothing is sustained."""
    hit = np.flatnonzero(EP.sustained(fire, config.persistence))
    if not len(hit):
        return None
    t = int(hit[0])
    own = (EP.gt(ps["dead_group_share"], config.dead_share) & EP.gt(ps["kl_alone_share"], config.kl_alone_share))
    lo = max(0, t - config.window + 1)
    back = np.flatnonzero(own[lo:t + 1])
    return int(ps["step"][lo + back[0]] if len(back) else ps["step"][t])


def _evidence(m: dict, ps: dict, on: np.ndarray, onset: int, beta: float, ctx: C.Context,
              config: SignalConfig) -> dict:
    """The cause's evidence: the steps it holds on (`on`), the dead groups at the onset, the shares early and after."""
    at = int(np.flatnonzero(ps["step"] == onset)[0])
    k = max(1, min(len(on) // 10, 20))
    return {"steps_over": int(on.sum()), "steps_first": [int(s) for s in ps["step"][on][:config.examples]],
            "dead_group_share_at_onset": float(ps["dead_group_share"][at]),
            "dead_group_share_mean_after": _mean(ps["dead_group_share"][on]),
            "dead_group_share_early": _mean(ps["dead_group_share"][:k]), "early_steps": k,
            "dead_groups_at_onset": SG.dead_groups_at(m, onset, config.examples),
            "groups_at_onset": int(ps["groups"][at]),
            "kl_alone_share_mean_after": _mean(ps["kl_alone_share"][on]),
            "kl_mass_share_mean_after": _mean(ps["kl_mass_share"][on]),
            "kl_mass_share_early": _mean(ps["kl_mass_share"][:k]),
            "beta": beta, "estimator": ctx.estimator, "dead_share_threshold": config.dead_share,
            "kl_alone_share_threshold": config.kl_alone_share, "window": config.window,
            "persistence": config.persistence.describe()}


def kl_dominated_signal(analysis, ctx: C.Context, config: SignalConfig = SignalConfig()) -> list[Cause]:
    """The cause (module docstring); none without a KL term, groups or advantages."""
    beta = beta_of(ctx.manifest)
    if beta <= 0:
        return []
    m = signal_of(analysis)
    ps = SG.per_step(m, beta, ctx.estimator)
    if not len(ps["step"]) or not np.isfinite(ps["kl_mass"]).any():
        return []
    fire = _fire(ps, config)
    onset = _onset(ps, fire, config)
    if onset is None:
        return []
    ev = _evidence(m, ps, fire & (ps["step"] >= onset), onset, beta, ctx, config)
    summary = (f"from step {onset}, {ev['dead_group_share_mean_after']:.0%} of the prompt groups have all-equal "
               f"rewards (zero advantage; {ev['dead_group_share_early']:.0%} in the run's first {ev['early_steps']} "
               f"steps; at step {onset} groups {', '.join(map(str, ev['dead_groups_at_onset']))}), so "
               f"{ev['kl_alone_share_mean_after']:.0%} of the loss tokens move by the KL term alone (beta {beta:g}, "
               f"{ctx.estimator}), which pulls them back toward pi_ref; the KL term's share of the gradient weight "
               f"mass rises from {ev['kl_mass_share_early']:.1%} to {ev['kl_mass_share_mean_after']:.1%}: "
               "the run learns from few groups while the KL term undoes the rest")
    return [Cause("kl_dominated_signal", onset, "warning", ev, fix_for("kl_dominated_signal", ctx.manifest), summary)]
