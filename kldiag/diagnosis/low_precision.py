"""`engine_low_precision`: a low-precision rollout (FP8, INT8, FP4 weights in the engine) whose mismatch steps
with each weight version: every sync quantises new weights, and the engine/trainer mismatch jumps to a new
level at each version change instead of staying flat.

verl #7519: FP8 tensorwise rollouts grew `rollout_corr/kl` 3.1x over a run while MXFP8 stayed flat; xtuner
#2044: the k3 of the second step after a weight sync 25x the first's before a fix. A bf16 engine against an
fp32 trainer gives a small mismatch that is flat over the run: that is `engine_precision`
(kldiag.mismatch.signatures), not this cause.

On the parity fit set (kldiag.mismatch.parity.tokens_for), the steps are cut into weight-version windows: runs
of steps whose newest recorded version (policy_version, format v1.3: step - the sequences' smallest staleness)
is the same; without recorded versions each step is a window (one sync a step, synchronous RL). Per window the
mean |log mu - log pi_old| and its sequence-clustered standard error; at each version change the jump
z = (L[w+1] - L[w]) / sqrt(se[w]^2 + se[w+1]^2). The cause fires when at least `jump_share` of the version
changes (over at least `min_windows` windows) have |z| > `z_min` and the mismatch is worth a cause (the
built-in KL / token_mult_prob_error rule, or a parity check); not when the mismatch's root cause is staleness,
a shifted gather or raw log-probs (their per-step mismatch moves at syncs too). The rollout dtype comes from the
manifest's `config["rollout_dtype"]` (`kldiag analyze RUN --set rollout_dtype=fp8` when it lacks it): a
declared bf16/fp16/fp32 engine is never named; an undeclared one needs `undeclared_share` of the changes.
Onset: the first sustained window (DiagnosisConfig.persistence) with such a jump. It absorbs
`engine_mismatch` and `engine_precision`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kldiag.analysis.reducers import staleness as S
from kldiag.analysis.rules import episodes as EP
from kldiag.analysis.runtime.runner import reduced
from kldiag.diagnosis import causes as C
from kldiag.diagnosis.types import Cause
from kldiag.frameworks import fix_for
from kldiag.mismatch import parity as P
from kldiag.mismatch import signatures as SG
from kldiag.mismatch import tokenset as TS

LOW = ("fp8", "float8", "e4m3", "e5m2", "mxfp8", "fp4", "nvfp4", "mxfp4", "int8", "int4", "w8a8", "w4a16", "w4a8",
       "awq", "gptq")
HIGH = ("bf16", "bfloat16", "fp16", "float16", "half", "fp32", "float32", "float")
OTHER_ROOTS = ("engine_stale_weights", "engine_async_lag", "engine_wrong_token", "engine_raw_logprobs")


@dataclass(frozen=True)
class LowPrecisionConfig:
    """kldiag's own thresholds (docs/metrics.md, `engine_low_precision`)."""

    z_min: float = 3.0  # a version change's jump: |z| above this
    jump_share: float = 0.3  # share of version changes with such a jump (a low-precision dtype declared)
    undeclared_share: float = 0.5  # ... with no rollout dtype recorded
    min_windows: int = 8  # version windows needed


def rollout_dtype(manifest) -> tuple[str | None, str]:
    """(the run's rollout dtype as recorded, "low" | "high" | "unknown")."""
    value = (getattr(manifest, "config", None) or {}).get("rollout_dtype")
    if value is None or value is False or str(value).strip() == "":
        return None, "unknown"
    low = str(value).strip().lower().replace("-", "_")
    if any(k in low for k in LOW):
        return str(value), "low"
    return str(value), "high" if low in HIGH or low.startswith("torch.") else "unknown"


def _windows(steps: np.ndarray, analysis) -> tuple[np.ndarray, str]:
    """Window index per step [S] and how the windows were cut."""
    m = reduced(analysis, S.StalenessReducer())
    has = m["s_stale"] >= 0
    if not has.any():
        return np.arange(len(steps)), "one window a step (no versions recorded)"
    version = m["s_step"][has] - m["s_stale"][has]
    at = np.searchsorted(steps, m["s_step"][has])
    ok = (at < len(steps)) & (steps[np.minimum(at, len(steps) - 1)] == m["s_step"][has])
    newest = np.full(len(steps), np.iinfo(np.int64).min)
    np.maximum.at(newest, at[ok], version[ok])
    new = np.r_[True, newest[1:] != newest[:-1]]
    return np.cumsum(new) - 1, "runs of steps with the same newest policy_version"


def levels(ts, steps: np.ndarray, window: np.ndarray) -> dict[str, np.ndarray]:
    """Per window [W]: first step, tokens, mean |log mu - log pi_old| and its sequence-clustered SE."""
    ok = ts.mask & np.isfinite(ts.logp_sampler) & np.isfinite(ts.logp_old)
    x = np.abs(ts.logp_sampler[ok] - ts.logp_old[ok])
    w = window[np.searchsorted(steps, ts.step[ok])]
    k = int(window.max()) + 1 if len(window) else 0
    n = np.bincount(w, minlength=k).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = np.bincount(w, weights=x, minlength=k) / n
        cell = TS.dense_inverse(w.astype(np.int64) * (1 << 40) + ts.seq[ok])  # (window, sequence)
        r = np.bincount(cell, weights=x - mean[w])
        cw = np.zeros(int(cell.max()) + 1 if len(cell) else 0, np.int64)
        cw[cell] = w
        se = np.sqrt(np.bincount(cw, weights=r * r, minlength=k)) / n
    first = steps[np.r_[0, np.flatnonzero(np.diff(window)) + 1]] if len(steps) else np.zeros(0, np.int64)
    return {"first_step": first, "tokens": n.astype(np.int64), "level": mean, "se": se}


def jumps(lv: dict[str, np.ndarray]) -> np.ndarray:
    """z [W - 1] at each version change (NaN where a side is unknown)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.diff(lv["level"]) / np.sqrt(lv["se"][1:] ** 2 + lv["se"][:-1] ** 2)


def _gated(analysis, ctx: C.Context) -> bool:
    """The mismatch is worth a cause and no other root cause explains its moves."""
    rep, sig = P.report_for(analysis), SG.report_for(analysis)
    if rep is None or (sig is not None and sig.root in OTHER_ROOTS):
        return False
    builtin = C.engine_mismatch(analysis, ctx)
    return bool(builtin) or rep.growing or rep.offset or rep.first_step_disagrees


def engine_low_precision(analysis, ctx: C.Context, cfg: LowPrecisionConfig = LowPrecisionConfig()) -> list[Cause]:
    """The cause (module docstring)."""
    dtype, kind = rollout_dtype(ctx.manifest)
    ts = P.tokens_for(analysis)
    if kind == "high" or ts is None or not _gated(analysis, ctx):
        return []
    steps = np.unique(ts.step[ts.mask & np.isfinite(ts.logp_sampler)])
    window, how = _windows(steps, analysis)
    lv = levels(ts, steps, window)
    if len(lv["level"]) < cfg.min_windows:
        return []
    z = jumps(lv)
    big = np.nan_to_num(np.abs(z) > cfg.z_min, nan=False).astype(bool)
    need = cfg.jump_share if kind == "low" else cfg.undeclared_share
    if big.mean() < need:
        return []
    onset = EP.first_sustained(lv["first_step"][:-1], big, ctx.config)
    if onset is None:
        return []
    return [_cause(lv, z, big, onset, dtype, how, cfg, ctx)]


def _cause(lv: dict, z: np.ndarray, big: np.ndarray, onset: int, dtype: str | None, how: str,
           cfg: LowPrecisionConfig, ctx: C.Context) -> Cause:
    q = max(1, len(lv["level"]) // 4)
    first, last = float(np.nanmean(lv["level"][:q])), float(np.nanmean(lv["level"][-q:]))
    ev = {"rollout_dtype": dtype, "windows": int(len(lv["level"])), "windows_cut": how,
          "version_changes": int(len(z)), "changes_with_jump": int(big.sum()), "jump_share": float(big.mean()),
          "z_min": cfg.z_min, "jump_share_threshold": cfg.jump_share if dtype else cfg.undeclared_share,
          "abs_z_median": float(np.nanmedian(np.abs(z))), "level_first_quarter": first, "level_last_quarter": last,
          "growth": last / first if first > 0 else None, "level_min": float(np.nanmin(lv["level"])),
          "level_max": float(np.nanmax(lv["level"])),
          "levels": [{"step": int(s), "mismatch_abs": float(v)} for s, v in
                     zip(lv["first_step"][:12], lv["level"][:12], strict=True)]}
    said = f"the rollout dtype is {dtype}" if dtype else "no rollout dtype is recorded (--set rollout_dtype=fp8)"
    summary = (f"the mismatch |log mu - log pi_old| jumps at {ev['changes_with_jump']} of {ev['version_changes']} "
               f"weight version changes (|z| > {cfg.z_min:g}; median |z| {ev['abs_z_median']:.2g}), each version "
               f"at its "
               f"own level between {ev['level_min']:.3g} and {ev['level_max']:.3g} nats, first quarter {first:.3g} "
               f"and last {last:.3g}; {said}: each sync quantises new weights, unlike a flat bf16 mismatch")
    return Cause("engine_low_precision", onset, "warning", ev, fix_for("engine_low_precision", ctx.manifest), summary)


engine_low_precision.absorbs = ("engine_mismatch", "engine_precision")
