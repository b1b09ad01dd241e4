"""Cause `engine_truncated_sampling`: the engine samples with top-k / top-p / min-p and returns the truncated,
renormalised log-probs, while the trainer scores the full vocabulary (no sampling-mask replay).

With S the kept set of a context and Z_S = sum_{y in S} pi_old(y) its mass under the trainer's
distribution, every sampled token x lies in S and the engine reports mu(x) = pi_old(x) / Z_S, so

    d = log mu(x) - log pi_old(x) = -log Z_S >= 0        (the same for every token of a context)
    pi_old(x) / mu(x) = Z_S < 1                            (the kept mass)

and Z_S falls, d grows, with the context's entropy (a near-deterministic context keeps all its mass).
Any full-support sampler mu (a temperature, bf16 kernels, stale weights) instead gives
E_{x~mu}[pi_old(x) / mu(x)] = sum_y pi_old(y) = 1: the mean of exp(-d) over the sampled tokens, the mean
kept mass, is the test. The cause needs, on the trained tokens (mask 1) with both log-probs: a mean kept
mass below 1 by `deficit_min` and `se_k` sequence-clustered standard errors, a mean d above `offset_min`,
and d growing with the trainer's entropy (corr >= `corr_min`; -log pi_old where no entropy is recorded);
onset: the first step where the kept mass and d fire, sustained. vLLM V1 returns such log-probs under
logprobs_mode="processed_logprobs" (vllm/v1/sample/sampler.py); the fix comes from
kldiag.frameworks.sampling in the trainer's own option names, and the manifest's config["engine_sampling"]
(top_k / top_p / min_p and whether the trainer replays them) is quoted in the evidence.

One root cause, one cause (kldiag.diagnosis.parity asks `explains`): this cause takes the place of
`engine_mismatch` and of a mismatch root cause unless the engine leaves a residual beyond float noise within
shared contexts (truncation moves all tokens of a context by the same -log Z_S), and of
`engine_temperature_mismatch` when that came from the pooled fit (entropy-dependent offsets bias a pooled
slope; a within-context slope is 1 under truncation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from kldiag.analysis.rules.episodes import Persistence, sustained
from kldiag.diagnosis.types import Cause
from kldiag.frameworks import family
from kldiag.frameworks import sampling as SF
from kldiag.mismatch import kept as K
from kldiag.mismatch import parity as P
from kldiag.mismatch import sample as SS
from kldiag.mismatch import tokenset as TS
from kldiag.mismatch.signatures import clustered_mean

CAUSE = "engine_truncated_sampling"


@dataclass(frozen=True)
class TruncationConfig:
    """Thresholds of engine_truncated_sampling (kldiag's own; docs/recorder.md, "Sampling settings")."""

    min_tokens: int = 200  # trained tokens with both log-probs before the run is judged
    deficit_min: float = 0.005  # 1 - mean(pi_old / mu) over the sampled tokens above this ...
    se_k: float = 5.0  # ... and above this many sequence-clustered SEs (a full-support sampler gives 0)
    offset_min: float = 0.01  # mean(log mu - log pi_old) in nats above this
    corr_min: float = 0.3  # corr(log mu - log pi_old, entropy) at least this: the gap grows with the entropy
    step_se_k: float = 3.0  # a step fires: its deficit above deficit_min and step_se_k SEs, its offset above offset_min
    bins: int = 5  # entropy bins (quantiles) of the evidence table
    persistence: Persistence = Persistence()


@dataclass
class TruncationReport:
    """The figures of the test; `fires` and the per-step `step_fire` say whether and where."""

    tokens: int
    offset: float  # mean log mu - log pi_old (nats)
    offset_se: float
    kept_mass: float  # mean pi_old / mu over the sampled tokens
    kept_mass_se: float
    share_positive: float  # share of tokens with log mu > log pi_old
    x_name: str  # "entropy" or "-logp_old"
    slope: float  # d = intercept + slope * x, least squares
    intercept: float
    corr: float
    bins: list[dict]
    steps: np.ndarray
    step_offset: np.ndarray
    step_kept_mass: np.ndarray
    step_fire: np.ndarray
    fires: bool
    config: TruncationConfig = field(default_factory=TruncationConfig)

    @property
    def onset(self) -> int | None:
        hit = np.flatnonzero(self.step_fire)
        return int(self.steps[hit[0]]) if len(hit) else None


def _line(x: np.ndarray, d: np.ndarray) -> tuple[float, float, float]:
    """(slope, intercept, corr) of d on x; NaN when x or d does not vary."""
    if len(x) < 3 or np.ptp(x) == 0 or np.ptp(d) == 0:
        return math.nan, math.nan, math.nan
    # least squares in closed form on centred values (what np.polyfit(x, d, 1) and np.corrcoef give, to
    # rounding, without their Vandermonde matrix and SVD: a tenth of the time on a million tokens)
    mx, md = x.mean(), d.mean()
    xc, dc = x - mx, d - md
    sxx, sxd, sdd = xc @ xc, xc @ dc, dc @ dc
    slope = sxd / sxx
    return float(slope), float(md - slope * mx), float(sxd / math.sqrt(sxx * sdd))


def _bins(x: np.ndarray, d: np.ndarray, k: int, r: np.ndarray | None = None) -> list[dict]:
    """Quantile bins of x: their x range, mean d, mean kept mass exp(-d) (r, when given) and token count."""
    edges = np.unique(np.quantile(x, np.linspace(0.0, 1.0, k + 1))) if len(x) else np.zeros(0)
    if len(edges) < 2:
        return []
    idx = np.clip(np.searchsorted(edges, x, "right") - 1, 0, len(edges) - 2)
    nb = len(edges) - 1
    count = np.bincount(idx, minlength=nb)
    with np.errstate(over="ignore"):  # mu << pi_old: an infinite kept mass, as the mean gives it
        off, kept = np.bincount(idx, d, nb), np.bincount(idx, np.exp(-d) if r is None else r, nb)
    return [{"x_low": float(edges[b]), "x_high": float(edges[b + 1]), "offset": float(off[b] / count[b]),
             "kept_mass": float(kept[b] / count[b]), "tokens": int(count[b])} for b in range(nb) if count[b]]


def _pairs(inv: np.ndarray, seq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first row, id per row) of each distinct (step index, seq), ids in sorted order: np.unique(axis=1)'s
    return_index and return_inverse. Rows sorted by (step, seq) (a TokenSet's order) give them as runs."""
    n = len(inv)
    up = n < 2 or bool(np.all((inv[1:] > inv[:-1]) | ((inv[1:] == inv[:-1]) & (seq[1:] >= seq[:-1]))))
    if not up:
        _, first, pair = np.unique(np.stack([inv, seq]), axis=1, return_index=True, return_inverse=True)
        return first, pair.reshape(-1)
    new = np.ones(n, bool)
    new[1:] = (inv[1:] != inv[:-1]) | (seq[1:] != seq[:-1])
    return np.flatnonzero(new), np.cumsum(new) - 1


def _per_step(step: np.ndarray, seq: np.ndarray, d: np.ndarray, cfg: TruncationConfig, r: np.ndarray | None = None):
    """(steps, mean d, mean kept mass, firing) per step; a step fires on its deficit and offset."""
    steps, inv = TS.unique_inverse(step)  # a TokenSet is step-sorted: no sort
    k = len(steps)
    n = np.maximum(np.bincount(inv, minlength=k), 1)
    if r is None:
        with np.errstate(over="ignore"):  # mu << pi_old: an infinite ratio, a step that cannot fire
            r = np.exp(-d)
    off, kept = np.bincount(inv, weights=d, minlength=k) / n, np.bincount(inv, weights=r, minlength=k) / n
    first, pair = _pairs(inv, seq)
    cl = np.bincount(pair.reshape(-1), weights=r - kept[inv])  # each sequence's sum: the clusters of the SE
    se = np.sqrt(np.bincount(inv[first], weights=cl ** 2, minlength=k)) / n
    fire = ((1.0 - kept) > cfg.deficit_min) & ((1.0 - kept) > cfg.step_se_k * se) & (off > cfg.offset_min)
    return steps, off, kept, sustained(fire, cfg.persistence)


def check(ts: TS.TokenSet, config: TruncationConfig = TruncationConfig()) -> TruncationReport | None:
    """The truncation test on a TokenSet's trained tokens; None without enough tokens with both log-probs."""
    ok = ts.mask & np.isfinite(ts.logp_old) & np.isfinite(ts.logp_sampler) & (ts.logp_old <= 0) & (ts.logp_sampler <= 0)
    if ok.sum() < config.min_tokens:
        return None
    d, seq, step = (ts.logp_sampler - ts.logp_old)[ok], ts.seq[ok], ts.step[ok]
    ent = ts.entropy[ok]
    has_entropy = np.isfinite(ent).mean() >= 0.5
    x_name, x = ("entropy", ent) if has_entropy else ("-logp_old", -ts.logp_old[ok])
    fin = np.isfinite(x)
    with np.errstate(over="ignore"):
        r = np.exp(-d)
    inv = TS.dense_inverse(seq)  # the sequences, as clusters of both means
    offset, offset_se = clustered_mean(d, seq, inv)
    kept, kept_se = clustered_mean(r, seq, inv)
    slope, intercept, corr = _line(x[fin], d[fin])
    steps, s_off, s_kept, s_fire = _per_step(step, seq, d, config, r)
    deficit = 1.0 - kept
    fires = bool(deficit > config.deficit_min and deficit > config.se_k * (kept_se or 0.0)
                 and offset > config.offset_min and math.isfinite(corr) and corr >= config.corr_min
                 and s_fire.any())
    return TruncationReport(int(ok.sum()), offset, offset_se, kept, kept_se, float((d > 0).mean()), x_name, slope,
                            intercept, corr, _bins(x[fin], d[fin], config.bins, r[fin]), steps, s_off, s_kept, s_fire, fires,
                            config)


def report_for(analysis, config: TruncationConfig = TruncationConfig()) -> TruncationReport | None:
    """check() on the parity fits' tokens (kldiag.mismatch.parity.tokens_for), kept in `analysis.memo`."""
    key = ("truncation", config)
    if key not in analysis.memo:
        ts = P.tokens_for(analysis)
        analysis.memo[key] = None if ts is None else K.kept(SS.sample_of(analysis), "truncation", config,
                                                             lambda: check(ts, config))
    return analysis.memo[key]


def explains(analysis, cause: str) -> bool:
    """Whether engine_truncated_sampling fires and accounts for `cause` (module doc): engine_temperature_mismatch
    from a pooled fit; engine_mismatch or a root cause when no residual is left within shared contexts."""
    rep = report_for(analysis)
    if rep is None or not rep.fires:
        return False
    par = P.report_for(analysis)
    if par is None:
        return True
    if cause == "engine_temperature_mismatch":
        return par.fit.method == "pooled"
    resid = par.steps.resid_rms
    left = resid is not None and np.isfinite(resid).any() and float(np.nanmedian(resid)) > par.config.float_noise
    return not left


def _manifest(manifest) -> dict:
    s = SF.of(manifest)
    if s is None:
        return {"recorded": False}
    return {"recorded": True, **{k: s.get(k) for k in ("temperature", "top_k", "top_p", "min_p", "logprobs_mode",
                                                        "mask_replay", "engine", "source")},
            "truncations": SF.truncations(s), "not_replayed": SF.unreplayed(s)}


def _summary(rep: TruncationReport, man: dict) -> str:
    lo, hi = (rep.bins[0], rep.bins[-1]) if rep.bins else ({}, {})
    text = (f"the engine returns truncated, renormalised log-probs (top-k / top-p) while the trainer scores the full "
            f"vocabulary: log mu - log pi_old averages {rep.offset:+.3g} nats on the trained tokens (positive on "
            f"{rep.share_positive:.0%}), and pi_old/mu averages {rep.kept_mass:.3g} (a full-support sampler gives 1): "
            f"the engine keeps about {rep.kept_mass:.0%} of pi_old's mass, so log mu - log pi_old ~ -log(kept mass). "
            f"The gap grows with the trainer's {rep.x_name} (slope {rep.slope:+.3g} nats per nat, corr {rep.corr:.2f}")
    if lo:
        text += (f"; {lo['offset']:.3g} nats at {rep.x_name} <= {lo['x_high']:.2g}, {hi['offset']:.3g} at >= "
                 f"{hi['x_low']:.2g}")
    text += ")"
    if man.get("recorded"):
        on = ", ".join(f"{t}={man[t]:g}" for t in man["truncations"]) or "none recorded"
        replay = man["not_replayed"]
        text += f"; the manifest's sampling: {on}" + ("" if replay is None else
                                                     f", not replayed by the trainer: {', '.join(replay) or 'none'}")
    return text


def engine_truncated_sampling(analysis, ctx) -> list[Cause]:
    """Cause engine_truncated_sampling (module doc), warning, with the framework's fix."""
    rep = report_for(analysis)
    if rep is None or not rep.fires:
        return []
    man = _manifest(analysis.manifest)
    cfg = rep.config
    ev = {"tokens": rep.tokens, "offset_mean": rep.offset, "offset_se": rep.offset_se, "kept_mass_mean": rep.kept_mass,
          "kept_mass_se": rep.kept_mass_se, "minus_log_kept_mass": -math.log(rep.kept_mass) if rep.kept_mass > 0
          else None, "share_positive": rep.share_positive, "x": rep.x_name, "slope": rep.slope,
          "intercept": rep.intercept, "corr": rep.corr, "by_x": rep.bins,
          "steps_firing": int(rep.step_fire.sum()), "steps": int(len(rep.steps)),
          "thresholds": {"deficit_min": cfg.deficit_min, "se_k": cfg.se_k, "offset_min": cfg.offset_min,
                         "corr_min": cfg.corr_min}, "persistence": cfg.persistence.describe(), "manifest_sampling": man}
    fix = SF.truncation_fix(family(analysis.manifest))
    return [Cause(CAUSE, rep.onset, "warning", ev, fix, _summary(rep, man),
                  extra={"kept_mass": rep.kept_mass})]


