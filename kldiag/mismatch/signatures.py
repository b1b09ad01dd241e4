"""Root-cause signatures of a trainer/engine mismatch: which defect makes log mu differ from log pi_old.

The parity fits (kldiag.mismatch.parity) say *that* the engine disagrees (a temperature, an offset, a
first step, growth); these statistics, on the same thinned token sample, say *why*:

- a shifted gather: log mu at position t equals log pi_old at t + 1 (or t - 1) of the same sequence far
  better than at t (`shift_scan`);
- raw, pre-temperature log-probs: a temperature-like slope, but the sampled tokens follow pi_old, not the mu
  the engine reports. For tokens drawn from q, E[log mu - log pi_old] = KL(q||pi_old) - KL(q||mu): positive
  (KL(mu||pi_old)) when the engine reports what it sampled from, negative (-KL(pi_old||mu)) when it reports
  the pre-temperature softmax while the trainer scores the temperature's (`calibration`);
- stale weights: the engine runs the policy of some steps back. Where a prompt's contexts recur across
  steps (group ids that name the prompt), log mu at step t equals log pi_old of the same context and token
  at step t - k (`lag_scan`): a constant k is an asynchronous lag, a k that climbs and falls back to 0 is a
  weight sync every N steps. Without recurring contexts the per-step mismatch falls to nothing at each
  sync (`sync_drops`), and a constant lag is seen only as a mismatch along the policy's own drift: the
  engine's error log pi_old - log mu is the policy's recent move, so it correlates with the trainer's next
  move log pi_theta - log pi_old (`drift_alignment`);
- precision (a bf16 engine, other kernels): small, present from the first step, flat over the run, vanishing
  on confident tokens (a logit error e moves log p(x) by e_x - sum_y p_y e_y, which tends to 0 as p(x) -> 1),
  and with no direction along the drift.

`report_for(analysis)` (memoised in analysis.memo, as the parity report) gives a `Signatures`, whose
`root` names the one root cause found (or None); kldiag.diagnosis.parity turns it into a cause.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from kldiag.analysis.rules.episodes import sustained
from kldiag.mismatch import kept as K
from kldiag.mismatch import parity as P
from kldiag.mismatch import sample as SS
from kldiag.mismatch import tokenset as TS


@dataclass(frozen=True)
class SignatureConfig:
    """Thresholds of the root-cause signatures (kldiag's own; docs/metrics.md, "Mismatch root causes")."""

    shift_ratio: float = 0.25  # wrong token: shifted mean |log mu - log pi_old| below this x the aligned one
    calib_se_k: float = 5.0  # raw log-probs: mean(log mu - log pi_old) below -k (sequence-clustered) SEs
    max_lag: int = 16  # lags tried (in recorded steps of the sample)
    min_matches: int = 8  # tokens of a step matched at a lag before that lag counts
    lag_match: float = 0.25  # a step's lag: its lagged |log mu - log pi_old(t - k)| below this x the aligned
    lag_share: float = 0.8  # a constant lag: this share of the steps with a lag (>= 1) have the same one
    min_syncs: int = 3  # a periodic sync: at least this many falls back
    drop_ratio: float = 0.25  # a sync step's mismatch below this x the step before's ...
    rise_corr: float = 0.5  # ... and between syncs it rises: rank correlation with steps since the sync
    align_min: float = 0.3  # staleness: corr(log pi_old - log mu, log pi_theta - log pi_old) above this
    precision_max_abs: float = 0.15  # precision: run mean |log mu - log pi_old| at most this (nats) ...
    precision_growth: float = 2.0  # ... flat: last / first quarter within [1/x, x] ...
    precision_start: float = 0.5  # ... present at the first step: at least this x the run's median ...
    confident_ratio: float = 0.25  # ... and |gap| = a + b (1 - p_old) leaves a <= this x the mean gap at p = 1
    min_drift_tokens: int = 100  # tokens with log pi_theta != log pi_old before the alignment counts


@dataclass
class Signatures:
    """The statistics, and the root cause they name (`root`: a cause name or None)."""

    root: str | None
    shift: dict
    calibration: dict
    lag: dict
    sync: dict
    alignment: dict
    precision: dict
    onset_fire: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))  # per step of the parity report


def clustered_mean(x: np.ndarray, seq: np.ndarray, inv: np.ndarray | None = None) -> tuple[float, float]:
    """Mean of x over tokens and its standard error with the sequences as clusters (tokens of a sequence
    are not independent); `inv`: TS.dense_inverse(seq), when the caller has it."""
    if not len(x):
        return math.nan, math.nan
    inv = TS.dense_inverse(seq) if inv is None else inv  # np.unique's inverse, no sort
    mean = float(x.mean())
    resid = np.bincount(inv, weights=x - mean)
    return mean, float(math.sqrt(float(np.dot(resid, resid))) / len(x))


def calibration(ts: TS.TokenSet) -> dict:
    """Which distribution the sampled tokens follow: mean(log mu - log pi_old) (> 0: the engine's mu, < 0:
    pi_old), its clustered SE, and the two importance-ratio means (the one of the true sampler is 1)."""
    ok = np.isfinite(ts.logp_old) & np.isfinite(ts.logp_sampler)
    d = ts.logp_sampler[ok] - ts.logp_old[ok]
    mean, se = clustered_mean(d, ts.seq[ok])
    with np.errstate(over="ignore"):
        return {"mean_log_mu_over_old": mean, "se": se, "tokens": int(ok.sum()),
                "mean_old_over_mu": float(np.mean(np.exp(-d))) if len(d) else None,
                "mean_mu_over_old": float(np.mean(np.exp(d))) if len(d) else None}


def _pairs(ts: TS.TokenSet) -> np.ndarray:
    """Rows i whose row i + 1 is the next position of the same sequence (arrays sorted by step, seq, pos)."""
    if len(ts) < 2:
        return np.zeros(0, np.int64)
    nxt = (ts.seq[1:] == ts.seq[:-1]) & (ts.pos[1:] == ts.pos[:-1] + 1) & (ts.step[1:] == ts.step[:-1])
    return np.flatnonzero(nxt)


def shift_scan(ts: TS.TokenSet, steps: np.ndarray, cfg: SignatureConfig) -> dict:
    """mean |log mu - log pi_old| aligned and shifted by one position (+1: log mu at t against log pi_old at
    t + 1), run-wide and per step of `steps`; `fire` [S]: steps where the better shift beats cfg.shift_ratio."""
    o, m, i = ts.logp_old, ts.logp_sampler, _pairs(ts)
    out = {"pairs": int(len(i)), "shift": 0, "aligned_abs": None, "shifted_abs": None, "ratio": None,
           "fire": np.zeros(len(steps), bool)}
    best = None
    o0, o1, m0, m1 = o[i], o[i + 1], m[i], m[i + 1]  # each gathered once for both shifts
    for k, at, m_at, o_at, o_other in ((1, i, m0, o0, o1), (-1, i + 1, m1, o1, o0)):
        ok = np.isfinite(m_at) & np.isfinite(o_at) & np.isfinite(o_other)
        a0, a1 = np.abs(m_at - o_at)[ok], np.abs(m_at - o_other)[ok]
        if len(a0) and a0.mean() > 0 and (best is None or a1.mean() / a0.mean() < best[1]):
            best = (k, float(a1.mean() / a0.mean()), a0, a1, (at, ok))
    if best is None:
        return out
    k, ratio, a0, a1, (at, ok) = best
    st = ts.step[at][ok]
    sidx = np.searchsorted(steps, st)
    good = (sidx < len(steps)) & (steps[np.minimum(sidx, len(steps) - 1)] == st)
    s0 = np.bincount(sidx[good], weights=a0[good], minlength=len(steps))
    s1 = np.bincount(sidx[good], weights=a1[good], minlength=len(steps))
    n = np.maximum(np.bincount(sidx[good], minlength=len(steps)), 1)
    fire = (s1 < cfg.shift_ratio * s0) & (s0 / n > 0)
    out.update(shift=k, aligned_abs=float(a0.mean()), shifted_abs=float(a1.mean()), ratio=ratio,
               fire=sustained(fire))
    return out


def drift_alignment(ts: TS.TokenSet, cfg: SignatureConfig) -> dict:
    """corr(log pi_old - log mu, log pi_theta - log pi_old) over tokens the trainer has moved (a stale
    engine's error is the policy's recent move, which its next move continues), and corr with the advantage."""
    o, m, s = ts.logp_old, ts.logp_sampler, ts.logp
    ok = np.isfinite(o) & np.isfinite(m) & np.isfinite(s)
    err, move = (o - m)[ok], (s - o)[ok]
    moved = np.abs(move) > 1e-6
    out = {"drift_tokens": int(moved.sum()), "corr_with_drift": None, "corr_with_advantage": None}
    if moved.sum() >= cfg.min_drift_tokens and err[moved].std() > 0 and move[moved].std() > 0:
        out["corr_with_drift"] = float(np.corrcoef(err[moved], move[moved])[0, 1])
    adv = ts.advantage[ok]
    fin = np.isfinite(adv)
    if fin.sum() > 2 and err[fin].std() > 0 and adv[fin].std() > 0:
        out["corr_with_advantage"] = float(np.corrcoef(err[fin], adv[fin])[0, 1])
    return out


def _cross_keys(ts: TS.TokenSet) -> np.ndarray:
    """uint64 per token: (group, position, prefix, token id) without the step; 0 where group or ids are null."""
    tok = np.where(ts.token_id < 0, 0, ts.token_id)
    h = P.scrambled_prefix(ts)
    for key in (ts.group, ts.pos, tok):
        h = P.mix(h, key)
    return np.where((ts.group < 0) | (ts.token_id < 0), np.uint64(0), h)


def _lag_table(ts: TS.TokenSet, steps: np.ndarray, cfg: SignatureConfig) -> tuple[np.ndarray, np.ndarray, list]:
    """(mean |log mu(t) - log pi_old(t - j)| [J, S], matched tokens [J, S], the lags j in steps), matching each
    token with the same context and token id j steps back. Rows are keyed (context rank, step) and sorted, so
    every lag's lookup is one searchsorted of sorted queries; a run whose contexts never recur gives one lag."""
    key, ok = _cross_keys(ts), np.isfinite(ts.logp_old) & np.isfinite(ts.logp_sampler)
    ok &= key != 0
    if not ok.any():
        return np.full((1, len(steps)), np.nan), np.zeros((1, len(steps))), [0]
    order = np.flatnonzero(ok)[np.lexsort((ts.step[ok], key[ok]))]  # by context, then step: one sort
    key, step, o, m = key[order], ts.step[order], ts.logp_old[order], ts.logp_sampler[order]
    lo = int(step.min())
    width = int(step.max()) - lo + 1
    new_key = np.r_[True, key[1:] != key[:-1]]
    comb = (np.cumsum(new_key) - 1) * width + (step - lo)  # (context rank, step), sorted
    bounds = np.r_[True, comb[1:] != comb[:-1]]
    table, first = comb[bounds], np.flatnonzero(bounds)
    recurs = bool(new_key.sum() < bounds.sum())  # some context seen at two steps
    lags = [j * ts.step_stride for j in range(min(cfg.max_lag, len(steps) - 1) + 1)] if recurs else [0]
    sidx = np.searchsorted(steps, step)
    err, cnt = np.full((len(lags), len(steps)), np.nan), np.zeros((len(lags), len(steps)))
    for r, j in enumerate(lags):
        at = np.minimum(np.searchsorted(table, comb - j), len(table) - 1)
        hit = (table[at] == comb - j) & (step - j >= lo)  # the same context (rank) j steps back
        cnt[r] = np.bincount(sidx[hit], minlength=len(steps))
        with np.errstate(invalid="ignore", divide="ignore"):
            err[r] = np.bincount(sidx[hit], weights=np.abs(m[hit] - o[first[at[hit]]]), minlength=len(steps)) / cnt[r]
    err[cnt < cfg.min_matches] = np.nan
    return err, cnt, lags


def lag_scan(ts: TS.TokenSet, steps: np.ndarray, cfg: SignatureConfig) -> dict:
    """Per step, the lag k (in steps) whose log pi_old(t - k) matches log mu(t) best, when it beats the aligned
    comparison by cfg.lag_match (-1: unknown, no context recurs across steps)."""
    out = {"identified": False, "lag": None, "lag_share": None, "per_step": np.full(len(steps), -1),
           "matched_abs": None, "aligned_abs": None, "recurring_steps": 0}
    if not len(steps) or ts.group.max(initial=-1) < 0:
        return out
    err, _, lags = _lag_table(ts, steps, cfg)
    known = np.isfinite(err[0]) & (np.isfinite(err[1:]).any(0) if len(lags) > 1 else False)
    filled = np.where(np.isfinite(err), err, np.inf)
    best = np.argmin(filled, axis=0)
    lag = np.where(best > 0, np.asarray(lags)[best], 0)
    clear = np.take_along_axis(filled, best[None], 0)[0] <= cfg.lag_match * err[0]
    per_step = np.where(known, np.where((best == 0) | clear, lag, -1), -1)
    out.update(per_step=per_step, recurring_steps=int(known.sum()))
    out["identified"] = bool(known.sum() >= max(3, len(steps) // 2))
    stale = per_step[per_step > 0]
    if len(stale):
        k = int(np.bincount(stale).argmax())
        out.update(lag=k, lag_share=float((stale == k).mean()),
                   matched_abs=float(np.nanmean(err[lags.index(k)][per_step == k])),
                   aligned_abs=float(np.nanmean(err[0][per_step == k])))
    return out


def _period(resets: np.ndarray) -> tuple[int | None, float]:
    """The most common spacing of the reset steps and the share of spacings equal to it."""
    gaps = np.diff(resets)
    if not len(gaps):
        return None, 0.0
    n = int(np.bincount(gaps).argmax())
    return n, float((gaps == n).mean())


def _rank_corr(a: np.ndarray, b: np.ndarray) -> float:
    if len(a) < 3 or np.ptp(a) == 0 or np.ptp(b) == 0:
        return math.nan
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def sync_drops(steps: np.ndarray, mismatch: np.ndarray, lag: dict, cfg: SignatureConfig) -> dict:
    """A weight sync every N steps: the per-step lag climbs and falls back (from `lag_scan`), or, without
    recurring contexts, the per-step mismatch jumps down (below drop_ratio x the step before) at regular steps and rises
    between them. Gives the period N (in steps) and the sync steps."""
    out = {"periodic": False, "period": None, "sync_steps": [], "method": None, "rise_corr": None,
           "mismatch_at_sync": None, "mismatch_between": None}
    per = lag["per_step"]
    if lag["identified"] and (per > 0).any():
        known = np.flatnonzero(per >= 0)
        resets = steps[known[1:][per[known[1:]] < per[known[:-1]]]]  # the lag falls from one known step to the next
        method = "lag resets"
    else:  # the mismatch jumps down: below drop_ratio x the step before
        v = np.nan_to_num(mismatch, nan=np.inf)
        resets = steps[1:][v[1:] < cfg.drop_ratio * np.nan_to_num(mismatch[:-1], nan=0.0)]
        method = "mismatch drops"
    if len(resets) < cfg.min_syncs:
        return out
    period, share = _period(resets)
    since = steps - resets[np.maximum(np.searchsorted(resets, steps, "right") - 1, 0)]
    after = steps >= resets[0]
    rise = _rank_corr(since[after], mismatch[after])
    at_sync = np.isin(steps, resets)
    out.update(period=period, sync_steps=[int(s) for s in resets], method=method, rise_corr=rise,
               mismatch_at_sync=float(np.nanmean(mismatch[at_sync])),
               mismatch_between=float(np.nanmean(mismatch[~at_sync & after])))
    out["periodic"] = bool(period and period >= 2 and share >= 2 / 3 and rise >= cfg.rise_corr)
    return out


def _confidence_slope(gap: np.ndarray, p: np.ndarray) -> tuple[float, float]:
    """Least squares |gap| = a + b (1 - p): (a, the gap left on a token of probability 1; b)."""
    x = 1.0 - p
    if len(x) < 3 or np.ptp(x) == 0:
        return math.nan, math.nan
    # least squares in closed form on centred values: np.polyfit(x, gap, 1) to rounding, without its
    # Vandermonde matrix and SVD (a quarter of the signatures' time on a million tokens)
    mx, mg = x.mean(), gap.mean()
    xc = x - mx
    b = float(xc @ (gap - mg) / (xc @ xc))
    return float(mg - b * mx), b


def precision_profile(ts: TS.TokenSet, rep: P.ParityReport, cfg: SignatureConfig) -> dict:
    """Small, present from the first step, flat, vanishing on confident tokens: figures and the checks."""
    o, m = ts.logp_old, ts.logp_sampler
    ok = np.isfinite(o) & np.isfinite(m)
    gap = np.abs(m - o)[ok]
    a, b = _confidence_slope(gap, np.exp(o[ok]))
    v = rep.steps.mismatch_abs
    k = max(1, len(v) // 4)
    first, last = float(np.nanmean(v[:k])), float(np.nanmean(v[-k:]))
    med = float(np.nanmedian(v)) if len(v) else math.nan
    mean = float(gap.mean()) if len(gap) else math.nan
    out = {"mismatch_abs_mean": mean, "first_step_mismatch_abs": float(v[0]) if len(v) else None,
           "median_step_mismatch_abs": med, "quarter_ratio": last / first if first > 0 else None,
           "gap_at_p1": a, "gap_slope_in_1_minus_p": b, "confident_ratio": a / mean if mean > 0 else None}
    q = out["quarter_ratio"]
    out["checks"] = {"small": bool(mean <= cfg.precision_max_abs),
                     "flat": q is not None and 1 / cfg.precision_growth <= q <= cfg.precision_growth,
                     "from_first_step": bool(len(v)) and bool(v[0] >= cfg.precision_start * med),
                     "vanishes_on_confident_tokens": bool(b > 0 and (out["confident_ratio"] or 1.0)
                                                          <= cfg.confident_ratio)}
    return out


def _stale_root(rep: P.ParityReport, lag: dict, sync: dict, align: dict, cfg: SignatureConfig) -> str | None:
    """engine_stale_weights (a periodic sync) or engine_async_lag (a constant lag; or, without recurring
    contexts, a mismatch along the policy's drift that starts at nothing), else None."""
    if sync["periodic"]:
        return "engine_stale_weights"
    if lag["identified"] and lag["lag"] and (lag["lag_share"] or 0) >= cfg.lag_share:
        return "engine_async_lag"
    v = rep.steps.mismatch_abs
    along = (align["corr_with_drift"] or 0.0) >= cfg.align_min
    if along and not lag["identified"] and len(v) and v[0] <= rep.config.float_noise:
        return "engine_async_lag"
    return None


def _root(rep: P.ParityReport, s: dict, cfg: SignatureConfig) -> tuple[str | None, np.ndarray]:
    """The one root cause the statistics `s` name, in order (a wrong token garbles every other fit; a
    temperature is checked before staleness, which sharpening can mimic), and its per-step firing."""
    v, noise = rep.steps.mismatch_abs, rep.config.float_noise
    shift, calib = s["shift"], s["calibration"]
    if shift["ratio"] is not None and shift["ratio"] < cfg.shift_ratio and shift["aligned_abs"] > noise \
            and shift["fire"].any():
        return "engine_wrong_token", shift["fire"]
    if rep.temperature:
        raw = calib["mean_log_mu_over_old"] < -cfg.calib_se_k * (calib["se"] or 0.0)
        return ("engine_raw_logprobs", rep.temperature_steps) if raw else (None, np.zeros(len(v), bool))
    stale = _stale_root(rep, s["lag"], s["sync"], s["alignment"], cfg)
    if stale:
        return stale, sustained(np.nan_to_num(v) > noise)
    along = (s["alignment"]["corr_with_drift"] or 0.0) >= cfg.align_min
    lagged = (s["lag"]["per_step"] > 0).any()
    if all(s["precision"]["checks"].values()) and not along and not lagged:
        return "engine_precision", sustained(np.nan_to_num(v) >= cfg.precision_start * np.nanmedian(v))
    return None, np.zeros(len(v), bool)


def classify(ts: TS.TokenSet, rep: P.ParityReport, cfg: SignatureConfig = SignatureConfig()) -> Signatures:
    """Every signature on the parity report's tokens, and the root cause they name."""
    steps = rep.steps.step
    lag = lag_scan(ts, steps, cfg)
    s = {"shift": shift_scan(ts, steps, cfg), "calibration": calibration(ts), "lag": lag,
         "sync": sync_drops(steps, rep.steps.mismatch_abs, lag, cfg), "alignment": drift_alignment(ts, cfg),
         "precision": precision_profile(ts, rep, cfg)}
    root, fire = _root(rep, s, cfg)
    return Signatures(root, **s, onset_fire=fire)


def report_for(analysis, config: SignatureConfig = SignatureConfig(),
               parity: P.ParityConfig = P.ParityConfig()) -> Signatures | None:
    """classify() on the tokens of the analysis's parity report (kldiag.mismatch.parity.report_for), kept in
    `analysis.memo`; None when the run has no sampler log-probs."""
    key = ("signatures", config, parity)
    if key not in analysis.memo:
        rep = P.report_for(analysis, parity)
        analysis.memo[key] = None if rep is None else K.kept(SS.sample_of(analysis), "signatures", (config, parity),
                                                              lambda: classify(P.tokens_for(analysis, rep.config), rep,
                                                                               config))
    return analysis.memo[key]
