"""Engine parity: does the inference engine's mu agree with the trainer's pi_old on the same tokens?

The fits behind two causes (kldiag.diagnosis.parity turns them into causes):

- `engine_temperature_mismatch`: log mu = (1/T) log pi_old + c(context) on the sampled tokens
  when the engine samples at temperature T while the trainer assumes 1 (or logs processed vs
  raw log-probs): mu = softmax(z/T) gives log mu(x) = z_x/T - log sum_y exp(z_y/T) and
  pi_old = softmax(z) gives log pi_old(x) = z_x - log sum_y exp(z_y), so within one context
  (same step, prompt group, position and prefix) log mu is affine in log pi_old with slope 1/T.
  `fit_temperature` regresses log mu on log pi_old within such contexts (fixed effects;
  completions of a GRPO group share the prompt, so their first tokens share a context) and
  reports implied_temperature = 1/slope. Without shared contexts it falls back to a pooled fit
  (biased: c varies with the context's entropy), and says so in `method`. i.i.d. noise in the
  engine's logits also pulls the slope below 1 (tokens are drawn from mu), so a temperature also
  needs the slope's effect |slope - 1| * x_std to be at least `explain_ratio` x the residual, and
  per-step slopes off the same way on sustained steps (kldiag.analysis.rules.episodes.sustained).
- `engine_mismatch`: a constant offset (log mu - log pi_old has a mean far from 0 at slope 1),
  a first step where pi_old and mu already disagree beyond float noise (before any update the
  two are the same weights), and mismatch that grows with the steps while the policy drift
  |log pi_theta - log pi_old| does not (the "vicious cycle" of "When Speed Kills Stability").
  The built-in engine_mismatch (KL(mu||pi_old) rule) is merged in: this detector replaces it. A
  temperature that leaves no residual beyond float noise explains that rule (`explains_mismatch`);
  a residual beyond it, sustained, is a mismatch of its own.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from kldiag.analysis import analyze
from kldiag.analysis.cache import store
from kldiag.analysis.rules.episodes import Persistence, sustained
from kldiag.analysis.types import AnalysisConfig
from kldiag.mismatch import kept as K
from kldiag.mismatch import sample as SS
from kldiag.mismatch import tokenset as TS

COLUMNS = ("step", "seq", "group", "pos", "token_id", "iteration", "logp", "logp_old", "logp_sampler")


@dataclass(frozen=True)
class ParityConfig:
    """Thresholds of the parity detectors (kldiag's own; docs/metrics.md)."""

    slope_tol: float = 0.02  # |1/T - 1| above this (T outside ~[0.98, 1.02]) ...
    slope_se_k: float = 5.0  # ... and above this many standard errors of the slope ...
    explain_ratio: float = 1.0  # ... and the slope's effect |slope - 1| * x_std above this x the residual
    # (a temperature moves log mu exactly; i.i.d. engine noise biases the slope a little, residual large) ...
    persistence: Persistence = Persistence()  # ... and per-step slopes off the same way, sustained
    float_noise: float = 0.05  # mean |log mu - log pi_old| bf16-vs-fp32 kernels stay below (NeMo-RL flags
    # token_mult_prob_error = mean exp|delta| > 1.05, about 0.05 nats)
    offset_min: float = 0.01  # |mean(log mu - log pi_old)| in nats worth a cause, at slope ~1
    offset_se_k: float = 5.0
    growth_ratio: float = 2.0  # last-quarter mismatch / first-quarter mismatch above this ...
    drift_growth_max: float = 1.5  # ... while the drift grew less than this
    min_steps_growth: int = 8
    max_tokens: int = 1_000_000  # fit on about this many tokens of the shared sample (every k-th of its steps) ...
    fit_tokens: int = 250_000  # ... and past this many, on the whole prompt groups of a share that leaves about
    # this many (every step kept, fewer groups each; 0: no bound): the diagnosis's sample-based detectors in ~0.1 s


@dataclass
class TemperatureFit:
    """log mu = slope * log pi_old + c(context), fitted on the sampled tokens."""

    slope: float
    implied_temperature: float  # 1 / slope
    slope_se: float
    residual_std: float  # of log mu after the fit (float noise when the model is exact)
    offset: float  # mean(log mu - log pi_old)
    offset_se: float
    tokens: int
    contexts: int  # contexts with two or more distinct tokens (0 for the pooled fit)
    method: str  # "shared-context" or "pooled"
    x_std: float = math.nan  # rms of log pi_old about its context means: the spread the slope acts on
    explained: float = math.nan  # |slope - 1| * x_std / residual_std: the slope's effect over what it leaves

    def to_dict(self) -> dict:
        return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(self).items()}


def prefix_hash(seq: np.ndarray, pos: np.ndarray, token_id: np.ndarray) -> np.ndarray:
    """uint64 hash of each token's prefix (the token ids before it in its sequence), [N].

    Arrays sorted by (seq, pos). Polynomial hash sum_j (id_j + 1) * P**pos_j (mod 2**64), exclusive
    of the token itself; positions not recorded simply do not contribute.
    """
    P = np.uint64(1_000_003)
    with np.errstate(over="ignore"):
        powers = np.ones(int(pos.max(initial=0)) + 1, np.uint64)
        for i in range(1, len(powers)):
            powers[i] = powers[i - 1] * P
        term = (token_id.astype(np.uint64) + np.uint64(1)) * powers[pos]
        csum = np.cumsum(term, dtype=np.uint64)
        start = np.r_[0, np.flatnonzero(np.diff(seq)) + 1]
        base = np.repeat(np.r_[np.uint64(0), csum[start[1:] - 1]] if len(start) else np.array([], np.uint64),
                         np.diff(np.r_[start, len(seq)]))
        return csum - base - term


def mix(h: np.ndarray, x: np.ndarray) -> np.ndarray:
    """One splitmix64-style round folding x into the hash h (uint64, wrapping)."""
    with np.errstate(over="ignore"):
        z = (h ^ x.astype(np.uint64)) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(31))) * np.uint64(0xBF58476D1CE4E5B9)
        return z ^ (z >> np.uint64(29))


def scrambled_prefix(ts: TS.TokenSet) -> np.ndarray:
    """mix(prefix_hash of the token ids (-1 read as 0), 0): the start of both the context ids and the
    signatures' cross-step keys, computed once per TokenSet (kept on it: its arrays are never written)."""
    h = getattr(ts, "_scrambled_prefix", None)
    if h is None:
        h = prefix_hash(ts.seq, ts.pos, np.where(ts.token_id < 0, 0, ts.token_id))
        # scrambled first: a short prefix's small hash XOR a small key collides ((id + 1) ^ step), which
        # merged the position-1 contexts of different steps sharing a group id
        h = mix(h, np.zeros(len(h), np.uint64))
        ts._scrambled_prefix = h
    return h


def context_ids(ts: TS.TokenSet) -> np.ndarray:
    """An int64 id per token: equal ids share (step, group, pos, prefix); -1 where group or ids are null.

    The four keys are folded into one 64-bit hash (a collision between two of a run's contexts has
    probability ~ n**2 / 2**64), then numbered with a 1-D np.unique (a compiled hash table numbers them in
    one pass, but its random reads over a table of 2N keys cost as much as the sort on a million tokens,
    and its first call loads the compiler).
    """
    h = scrambled_prefix(ts)
    for key in (ts.step, ts.group, ts.pos):
        h = mix(h, key)
    _, ids = np.unique(h, return_inverse=True)
    ids = ids.reshape(-1).astype(np.int64)
    bad = (ts.group < 0) | (ts.token_id < 0)
    return np.where(bad, -1, ids)


def _dense(ids: np.ndarray) -> np.ndarray:
    """ids as indices for np.bincount: themselves when small non-negative ints (context_ids' numbering),
    else their rank (np.unique's inverse). A group's sums are the same either way (same rows, same order)."""
    if len(ids) and ids.dtype.kind in "iu" and ids.min() >= 0 and ids.max() < 4 * len(ids) + 1024:
        return ids
    return np.unique(ids, return_inverse=True)[1].reshape(-1)


def _demean(ids: np.ndarray, *xs: np.ndarray) -> tuple[np.ndarray, ...]:
    inv = _dense(ids)
    cnt = np.maximum(np.bincount(inv), 1)  # an id _dense leaves unused counts 0: its 0/0 is never read
    return tuple(x - (np.bincount(inv, weights=x) / cnt)[inv] for x in xs)


def shared_rows(ctx: np.ndarray) -> np.ndarray:
    """Indices of the rows whose context id (>= 0; -1 = unknown) appears on two rows or more:
    the only rows a within-context fit can use."""
    known = ctx >= 0
    if not known.any():
        return np.zeros(0, np.int64)
    inv = _dense(ctx[known])
    return np.flatnonzero(known)[np.bincount(inv)[inv] >= 2]


def fit_temperature(logp_old: np.ndarray, logp_sampler: np.ndarray, ctx: np.ndarray | None = None) -> TemperatureFit:
    """Fit log mu on log pi_old ([N] float64 each; ctx [N] context ids, -1 = unknown).

    Within-context slope over contexts where log pi_old takes two or more distinct values;
    the pooled least-squares slope with an intercept when there are fewer than 2 such contexts.
    """
    o, m = np.asarray(logp_old, np.float64), np.asarray(logp_sampler, np.float64)
    ok = np.isfinite(o) & np.isfinite(m) & (o <= 0) & (m <= 0)
    o, m = o[ok], m[ok]
    d = m - o
    n = len(o)
    offset = float(d.mean()) if n else math.nan
    offset_se = float(d.std() / math.sqrt(n)) if n > 1 else math.nan
    method, contexts = "pooled", 0
    if ctx is not None and n:
        c = np.asarray(ctx)[ok]
        sel = shared_rows(c)
        if len(sel):
            do, dm = _demean(c[sel], o[sel], m[sel])
            varied = np.abs(do) > 1e-9
            contexts = int(np.count_nonzero(np.bincount(_dense(c[sel][varied])))) if varied.any() else 0
            if contexts >= 2:
                method = "shared-context"
                x, y = do, dm
    if method == "pooled":
        x, y = o - o.mean() if n else o, m - m.mean() if n else m
    sxx = float(np.dot(x, x))
    if n < 3 or sxx <= 0:
        return TemperatureFit(math.nan, math.nan, math.nan, math.nan, offset, offset_se, n, contexts, method)
    slope = float(np.dot(x, y) / sxx)
    resid = y - slope * x
    dof = max(len(x) - (2 if method == "pooled" else 1 + contexts), 1)
    res_std = float(math.sqrt(float(np.dot(resid, resid)) / dof))
    se = res_std / math.sqrt(sxx)
    temp = 1.0 / slope if slope > 0 else math.inf
    x_std = math.sqrt(sxx / len(x))
    explained = abs(slope - 1.0) * x_std / res_std if res_std > 0 else math.inf
    return TemperatureFit(slope, temp, se, res_std, offset, offset_se, n, contexts, method, x_std, explained)


@dataclass
class StepParity:
    """Per-step arrays [S]: the fit's slope, mean and mean |log mu - log pi_old|, mean |log pi_theta - log pi_old|."""

    step: np.ndarray
    slope: np.ndarray
    offset: np.ndarray
    mismatch_abs: np.ndarray
    drift_abs: np.ndarray
    tokens: np.ndarray
    resid_rms: np.ndarray | None = None  # rms of log mu about `slope_fit * log pi_old + c(context)`, NaN: no fit


def _resid_rms(sidx: np.ndarray, c: np.ndarray, do: np.ndarray, dm: np.ndarray, slope: float, k: int) -> np.ndarray:
    """Per step: rms residual of the demeaned log mu after `slope` x the demeaned log pi_old, one degree of
    freedom taken per context (NaN where a step has no shared context)."""
    ss = np.bincount(sidx, weights=(dm - slope * do) ** 2, minlength=k)
    n = np.bincount(sidx, minlength=k)
    _, first = np.unique(c, return_index=True)
    dof = n - np.bincount(sidx[first], minlength=k)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(dof > 0, np.sqrt(ss / np.maximum(dof, 1)), np.nan)


def step_parity(ts: TS.TokenSet, ctx: np.ndarray | None = None, slope_fit: float = math.nan) -> StepParity:
    """Per-step parity figures over the tokens with both log pi_old and log mu (mask ignored).

    The slope per step is the within-context one (contexts never span steps); NaN for a step
    without two tokens of one context that differ. With the run's slope `slope_fit`, also the
    per-step residual after it (`resid_rms`)."""
    ctx = context_ids(ts) if ctx is None else ctx
    o, m, s = ts.logp_old, ts.logp_sampler, ts.logp
    ok = np.isfinite(o) & np.isfinite(m)
    steps, sidx = TS.unique_inverse(ts.step[ok])  # sorted by step: no sort
    k = len(steps)
    o, m, s, c = o[ok], m[ok], s[ok], ctx[ok]
    n = np.bincount(sidx, minlength=k).astype(np.float64)

    def mean(x, idx=sidx, w=None):
        return np.bincount(idx, weights=x, minlength=k) / np.maximum(n if w is None else w, 1)

    sxx = np.zeros(k)
    sxy = np.zeros(k)
    resid = np.full(k, np.nan)
    sel = shared_rows(c)
    if len(sel):
        do, dm = _demean(c[sel], o[sel], m[sel])
        sxx = np.bincount(sidx[sel], weights=do * do, minlength=k)
        sxy = np.bincount(sidx[sel], weights=do * dm, minlength=k)
        if math.isfinite(slope_fit):
            resid = _resid_rms(sidx[sel], c[sel], do, dm, slope_fit, k)
    with np.errstate(invalid="ignore", divide="ignore"):
        slope = np.where(sxx > 1e-18, sxy / sxx, np.nan)
    return StepParity(steps, slope, mean(m - o), mean(np.abs(m - o)), mean(np.abs(s - o)), n.astype(np.int64),
                      resid)


@dataclass
class ParityReport:
    """Everything the parity detectors found; `causes()` turns it into Cause objects."""

    fit: TemperatureFit
    steps: StepParity
    temperature: bool  # the slope is off 1 beyond tolerance and noise
    offset: bool  # a constant shift at slope ~1
    first_step_disagrees: bool  # the first recorded step already disagrees beyond float noise
    growing: bool  # mismatch grows while the policy drift does not
    growth: dict
    config: ParityConfig
    temperature_steps: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))  # sustained, per step
    residual_steps: np.ndarray = field(default_factory=lambda: np.zeros(0, bool))  # sustained resid > float_noise
    explains_mismatch: bool = False  # a temperature, and nothing left over: it explains KL(mu||pi_old)


def _quarter_growth(v: np.ndarray) -> float:
    k = max(1, len(v) // 4)
    a, b = np.nanmean(v[:k]), np.nanmean(v[-k:])
    return float(b / a) if a > 0 else (math.inf if b > 0 else 1.0)


def _temperature(fit: TemperatureFit, steps: StepParity, config: ParityConfig) -> tuple[bool, np.ndarray]:
    """(a temperature mismatch, its sustained steps). The run's slope is off 1 beyond slope_tol and
    slope_se_k standard errors, its effect |slope - 1| * x_std is at least explain_ratio x the residual
    (i.i.d. engine noise also pulls the slope below 1, since tokens are drawn from mu, but leaves a
    residual many times the shift), and per-step slopes are off the same way on sustained steps. The
    pooled fit (no shared contexts) has neither a clean residual nor per-step slopes: slope test only."""
    k = len(steps.step)
    off = abs(fit.slope - 1.0) if math.isfinite(fit.slope) else 0.0
    if not (off > config.slope_tol and off > config.slope_se_k * (fit.slope_se or 0.0)):
        return False, np.zeros(k, bool)
    if fit.method == "pooled":
        return True, np.ones(k, bool)
    with np.errstate(invalid="ignore"):
        away = (np.abs(steps.slope - 1.0) > config.slope_tol) & (np.sign(steps.slope - 1.0) == np.sign(fit.slope - 1.0))
    held = sustained(away, config.persistence)
    return bool(fit.explained >= config.explain_ratio and held.any()), held


def _growth(steps: StepParity, config: ParityConfig) -> tuple[bool, dict]:
    if len(steps.step) < config.min_steps_growth:
        return False, {"mismatch_growth": None, "drift_growth": None}
    g_m, g_d = _quarter_growth(steps.mismatch_abs), _quarter_growth(steps.drift_abs)
    return g_m > config.growth_ratio and g_d < config.drift_growth_max, {"mismatch_growth": g_m, "drift_growth": g_d}


def check(ts: TS.TokenSet, config: ParityConfig = ParityConfig()) -> ParityReport | None:
    """Run every parity check on a TokenSet; None when the run has no sampler log-probs."""
    if not ts.has_sampler:
        return None
    ctx = context_ids(ts)
    fit = fit_temperature(ts.logp_old, ts.logp_sampler, ctx)
    steps = step_parity(ts, ctx, fit.slope)
    temperature, held = _temperature(fit, steps, config)
    offset = (not temperature and math.isfinite(fit.offset) and abs(fit.offset) > config.offset_min
              and abs(fit.offset) > config.offset_se_k * (fit.offset_se or 0.0))
    first = bool(len(steps.step)) and steps.mismatch_abs[0] > config.float_noise
    growing, growth = _growth(steps, config)
    with np.errstate(invalid="ignore"):
        left = sustained(np.nan_to_num(steps.resid_rms, nan=0.0) > config.float_noise, config.persistence)
    explains = temperature and fit.method != "pooled" and not left.any() and not growing
    return ParityReport(fit, steps, temperature, offset, first, growing, growth, config,
                        held if temperature else np.zeros(len(steps.step), bool), left, explains)


def report_for(analysis, config: ParityConfig = ParityConfig()) -> ParityReport | None:
    """check() on the analysed run's shared token sample (SS.sample_of), kept in `analysis.memo` (and for
    the next analysis of a grown run while its sample is the same: kept.py) and in the run's result store
    (kldiag.analysis.cache.store): both parity detectors, the report and the dashboard's Mismatch page share
    one fit, and a fresh process reads the one the diagnosis made (the Mismatch page's first visit after the
    Overview's: no thinned set, no fit)."""
    key = ("parity", config)
    if key not in analysis.memo:
        analysis.memo[key] = store.cached(analysis, "parity", asdict(config), lambda: _report(analysis, config))
    return analysis.memo[key]


def _report(analysis, config: ParityConfig) -> ParityReport | None:
    ts = tokens_for(analysis, config)
    return None if ts is None else K.kept(SS.sample_of(analysis), "parity", config, lambda: check(ts, config))


def tokens_for(analysis, config: ParityConfig = ParityConfig()) -> TS.TokenSet | None:
    """The tokens the parity fits read: the shared sample thinned to config.max_tokens, then to about
    config.fit_tokens by whole prompt groups (SS.Sample.thinned; kept in
    `analysis.memo`; kldiag.mismatch.signatures reads the same); None without sampler log-probs."""
    key = ("parity-tokens", config.max_tokens, config.fit_tokens)
    if key not in analysis.memo:
        sample = SS.sample_of(analysis)
        fit = sample.has_values("logp_sampler")
        analysis.memo[key] = None if not fit else K.kept(  # a refresh's sample, unchanged: the same tokens
            sample, "parity-tokens", key, lambda: sample.thinned(config.max_tokens, fit_tokens=config.fit_tokens))
    return analysis.memo[key]


def check_run(run, config: ParityConfig) -> ParityReport | None:
    """check() on a run path or URI, read here (no analysis at hand: tests, notebooks)."""
    return report_for(analyze(run, AnalysisConfig(), [SS.SampleReducer()]), config)
