"""`async_staleness`: with recorded weight versions, the drift or the clipped importance mass grows with
the samples' staleness beyond what the run's correction (the PPO clip) absorbs.

Read from the `staleness` reducer's merged partial (kldiag.analysis.reducers.staleness; diagnosis.core.reducers()
lists it, so the diagnosis reads no part twice). The rule, per staleness bucket with at least
MIN_TOKENS tokens:
    grows    the stalest bucket's drift |log pi_theta - log pi_old| is at least GROWTH x the freshest
             bucket's, and its share of tokens outside the clip range is larger too;
    beyond   some stale bucket (staleness >= 1) has its clip fraction above clip_frac_high or its drift
             above drift_abs_high (DiagnosisConfig: the absolute levels of offpolicy_drift);
    onset    the first step, sustained (DiagnosisConfig.persistence), where the tokens of the buckets
             beyond the level are beyond it again within that step.
The cause absorbs `offpolicy_drift` and `engine_async_lag`: the measured staleness explains both.
"""

from __future__ import annotations

import numpy as np

from kldiag.analysis.core import keyed
from kldiag.analysis.reducers import staleness as S
from kldiag.analysis.rules import episodes as EP
from kldiag.analysis.runtime.runner import reduced
from kldiag.diagnosis import causes as C
from kldiag.diagnosis.types import Cause
from kldiag.frameworks import fix_for
from kldiag.frameworks.staleness import bound_for

MIN_TOKENS = 200  # a bucket's figures need this many tokens
GROWTH = 1.5  # the stalest bucket's drift over the freshest one's


def staleness_of(analysis) -> dict:
    """The staleness reducer's merged partial (the one the analysis read along, else one more pass)."""
    return reduced(analysis, S.StalenessReducer())


def _beyond(bb: dict, cfg) -> np.ndarray:
    ok = bb["tokens"] >= MIN_TOKENS
    return ok & (bb["stale"] >= 1) & (EP.gt(bb["rho_clip_frac"], cfg.clip_frac_high)
                                      | EP.gt(bb["drift_abs_mean"], cfg.drift_abs_high))


def _grows(bb: dict) -> bool:
    ok = np.flatnonzero(bb["tokens"] >= MIN_TOKENS)
    if len(ok) < 2:
        return False
    lo, hi = ok[0], ok[-1]
    d, c = bb["drift_abs_mean"], bb["rho_clip_frac"]
    return bool(d[hi] >= GROWTH * d[lo] and c[hi] > c[lo])


def _step_fire(m: dict, first_bad: int, cfg) -> tuple[np.ndarray, np.ndarray]:
    """(steps, fire): per step, the tokens of buckets >= first_bad beyond the clip or drift level."""
    sel = m["c_stale"] >= first_bad
    cells = keyed.reduce_by_key({"step": m["c_step"][sel], **{k: m[f"c_{k}"][sel]
                                                            for k in ("n_tokens", "n_clip", "sum_drift")}})
    n = np.maximum(cells["n_tokens"], 1).astype(np.float64)
    fire = (cells["n_tokens"] > 0) & ((cells["n_clip"] / n > cfg.clip_frac_high)
                                      | (cells["sum_drift"] / n > cfg.drift_abs_high))
    return cells["step"], fire


def _rows(bb: dict) -> list[dict]:
    keys = ("drift_abs_mean", "rho_clip_frac", "clip_mass_mean", "rho_ess", "rho_max", "opsm_masked_frac")
    return [{"staleness": S.bucket_label(b), "tokens": int(bb["tokens"][i]), "sequences": int(bb["sequences"][i]),
             **{k: float(bb[k][i]) for k in keys}} for i, b in enumerate(bb["stale"])]


def async_staleness(analysis, ctx: C.Context) -> list[Cause]:
    """The cause (module docstring); none without recorded versions."""
    m, cfg = staleness_of(analysis), ctx.config
    delta = getattr(analysis.config, "opsm_delta", None) or S.OPSM_DELTA
    bb = S.by_bucket(m, delta)
    if not len(bb["stale"]) or not _grows(bb):
        return []
    bad = _beyond(bb, cfg)
    if not bad.any():
        return []
    first_bad = int(bb["stale"][np.flatnonzero(bad)[0]])
    steps, fire = _step_fire(m, first_bad, cfg)
    onset = EP.first_sustained(steps, fire, cfg)
    if onset is None:
        return []
    ps = S.per_step(m)
    key, default, fix = bound_for(ctx.manifest)
    fix = fix or fix_for("async_staleness", ctx.manifest)
    worst = int(np.flatnonzero(bb["tokens"] >= MIN_TOKENS)[-1])
    fresh = int(np.flatnonzero(bb["tokens"] >= MIN_TOKENS)[0])
    ev = {"by_staleness": _rows(bb), "first_bad_staleness": first_bad, "staleness_max": int(ps["staleness_max"].max()),
          "staleness_mean": float(np.nanmean(ps["staleness_mean"])), "steps_over": int(fire.sum()),
          "clip_frac_threshold": cfg.clip_frac_high, "drift_abs_threshold": cfg.drift_abs_high,
          "bound_key": key or None, "bound_default": default or None}
    summary = (f"samples {S.bucket_label(int(bb['stale'][worst]))} steps stale drift "
               f"{bb['drift_abs_mean'][worst]:.3g} nats a token with {bb['rho_clip_frac'][worst]:.0%} of tokens "
               f"outside the clip range, against {bb['drift_abs_mean'][fresh]:.3g} and "
               f"{bb['rho_clip_frac'][fresh]:.0%} at staleness {S.bucket_label(int(bb['stale'][fresh]))}: from "
               f"staleness {first_bad} the clip no longer absorbs the drift")
    if key:
        summary += f"; lower `{key}`"
    return [Cause("async_staleness", onset, "warning", ev, fix, summary)]


async_staleness.absorbs = ("offpolicy_drift", "engine_async_lag")
