"""Alert rules, evaluated per step, and their grouping into episodes.

One place for the rules of `kldiag report` and the alerts of the analysis. A rule maps the
per-step columns (the analysis steps table, or the guard's running copy) to a boolean per
step and a value per step; consecutive firing steps make one Episode, which ends after
`quiet_steps` steps without firing (alert_window steps for the two onset rules), so a 200-step
blow-up is one episode, and a run that recovers and relapses gives two. Rules (kinds) and their severity:

  blowup               critical  the run's own KL loss weight, max |1 - pi_ref/pi_theta| (k3) or
                                 max |rho log(pi_theta/pi_ref)| (k3_is), exceeds blowup_weight
                                 (DeepSeek-V3.2 section 3.1; default 100 = 10x the flag limit W)
  nonfinite            critical  a NaN or infinite log-prob was recorded
  invalid              critical  a log-prob above 0 (probability > 1) was recorded
  blame_share          warning   flagged tokens carry over blame_share of the |k3 weight|
                                 (this and the two onset rules: info when the run's loss is not K3)
  mismatch             warning   KL(mu || pi_old) per token above mismatch_kl and its typical
                                 |log ratio| sqrt(2 KL) above the policy drift
  weight_blowup_onset  warning   max |k3 weight| jumps alert_factor x over its trailing median
                                 and exceeds the flag limit (weight_limit, docs/metrics.md)
  flagged_onset        warning   the flagged fraction jumps alert_factor x over its trailing median
  latent               info      K3's weight exceeds blowup_weight on a run whose loss is not K3
  early_weight_trend,  warning   early warnings (kldiag/analysis/rules/early.py): an indicator's recent
  early_blame_trend,             median climbs over its trailing baseline (the entropy's falls);
  early_flagged_trend,           the three K3 ones are info when the loss is not K3; the entropy
  early_entropy_drop             one needs the side scan's entropy_mean (the diagnosis adds it)

An onset-rule episode that starts inside a blow-up episode (after its first step) is dropped, and a
K3 early warning that starts inside one (its first step included).
Persistence (`Persistence`, `sustained`): an episode keeps its rule's severity only when its rule
fires on at least 3 of 5 consecutive recorded steps in it, or on 5% of 100 (at least 3); an isolated
outlier (one step, or a few far apart) is an info note with its evidence. nonfinite and invalid are
exempt: a single NaN is a fault. The cause detectors use the same rule.
Pure numpy on float64 arrays.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kldiag import fmt
from kldiag.analysis.rules.early import EARLY, EARLY_K3, EARLY_KINDS, EarlyWarning

SEVERITIES = ("info", "warning", "critical")  # ordered: a verdict is driven by the worst


@dataclass(frozen=True)
class Persistence:
    """When a per-step signal is sustained (`sustained`): on a step that fires and lies in a burst, at
    least `steps` of `window` consecutive recorded steps firing, or in a recurrence, at least `share` of
    `span` consecutive recorded steps (and `steps` of them) firing: a rare event that keeps coming back,
    as K3 blow-ups from rarely sampled tokens do. Windows are capped at the run's length. An isolated
    outlier (one step, or a few far apart) is a note, never a cause. kldiag's own numbers."""

    steps: int = 3
    window: int = 5
    share: float = 0.05
    span: int = 100

    def describe(self) -> str:
        return (f"{self.steps} of {self.window} consecutive steps, or {self.share:.0%} of {self.span} "
                f"(at least {self.steps})")


@dataclass(frozen=True)
class RuleConfig:
    """Thresholds of the episode rules (docs/metrics.md cites each). kldiag.diagnosis.DiagnosisConfig extends
    it with the cause detectors' thresholds; the rules read only these."""

    blowup_weight: float = 100.0  # |loss weight| beyond this: a blow-up (10x the flag limit W)
    blame_share: float = 0.5  # flagged tokens' share of the |k3 weight| (docs/metrics.md, blame_share)
    mismatch_kl: float = 0.01  # mean KL(mu || pi_old) per token (kldiag report's rule)
    quiet_steps: int = 10  # an episode ends after this many steps without firing (a recovery)
    persistence: Persistence = Persistence()  # a cause (and a non-info episode) needs a sustained signal
    early: EarlyWarning = EarlyWarning()  # the early-warning rules' thresholds (kldiag/analysis/rules/early.py)


def json_safe(v: Any) -> Any:
    """JSON-safe: NaN/inf become None, numpy scalars become Python numbers."""
    if isinstance(v, dict):
        return {str(k): json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_safe(x) for x in v]
    if hasattr(v, "item") and not isinstance(v, (str, bytes)):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


@dataclass
class Episode:
    """One alert: a run of consecutive firing steps of one kind (a 200-step blow-up is one).

    end is None while the episode is still firing at the run's last step. evidence holds
    {"tokens": [{step, seq, pos, rank, weight_k3}...], "sequences": [{step, seq, rank}...]}.
    """

    kind: str  # a rule name in kldiag.analysis.rules.episodes.RULES
    start: int
    end: int | None
    peak_step: int
    peak_value: float
    severity: str  # one of SEVERITIES
    message: str
    metric: str = ""
    steps: int = 1  # firing steps inside [start, end]
    evidence: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return json_safe(asdict(self))



Cols = Mapping[str, np.ndarray]
LOSS_WEIGHT_COLUMN = {"k3": "weight_k3_abs_max", "k3_is": "weight_k3_is_abs_max"}
DEFAULT_ESTIMATOR = "k3"  # verl's, OpenRLHF's, TRL's with use_bias_correction_kl=False
MIN_FLAGGED = 10  # flagged_onset needs at least this many flagged tokens in the step


@dataclass(frozen=True)
class RuleContext:
    """What the rules need besides the columns: the loss in use and the thresholds."""

    estimator: str = DEFAULT_ESTIMATOR
    weight_limit: float = 10.0  # AnalysisConfig.weight_limit (W)
    alert_window: int = 20  # AnalysisConfig.alert_window
    alert_factor: float = 10.0  # AnalysisConfig.alert_factor
    config: RuleConfig = RuleConfig()


@dataclass(frozen=True)
class Rule:
    kind: str
    metric: str  # the column whose value the episode reports (peak)
    severity: str
    fire: Callable[[Cols, RuleContext], tuple[np.ndarray, np.ndarray]]  # -> (fires, value)
    what: str  # message template: "{value}" is the peak value
    bridge_window: bool = False  # onset rules: gaps shorter than alert_window stay one episode


def col(cols: Cols, name: str) -> np.ndarray:
    """A column as float64, all NaN when absent."""
    n = len(cols["step"])
    v = cols.get(name)
    return np.full(n, np.nan) if v is None else np.asarray(v, dtype=np.float64)


def trailing_median(v: np.ndarray, window: int) -> np.ndarray:
    """Median of the previous `window` values, ignoring NaN; NaN where there is no history."""
    v = np.asarray(v, dtype=np.float64)
    if not len(v) or window < 1:
        return np.full(len(v), np.nan)
    padded = np.concatenate([np.full(window, np.nan), v])
    past = np.lib.stride_tricks.sliding_window_view(padded, window)[: len(v)]  # row i: v[i-window:i]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN rows: no history, NaN
        return np.nanmedian(past, axis=1)


def gt(v: np.ndarray, limit) -> np.ndarray:
    """v > limit elementwise, NaN as false."""
    with np.errstate(invalid="ignore"):
        return np.nan_to_num(v > limit, nan=False).astype(bool)


def _blowup(c: Cols, ctx: RuleContext):
    name = LOSS_WEIGHT_COLUMN.get(ctx.estimator)
    v = col(c, name) if name else np.full(len(c["step"]), np.nan)
    return gt(v, ctx.config.blowup_weight), v


def _latent(c: Cols, ctx: RuleContext):
    v = col(c, "weight_k3_abs_max")
    return gt(v, ctx.config.blowup_weight) & (ctx.estimator != "k3"), v


def _count(name: str):
    def fire(c: Cols, ctx: RuleContext):
        v = np.nan_to_num(col(c, name))
        return v > 0, v
    return fire


def _blame(c: Cols, ctx: RuleContext):
    v = col(c, "blame_share")
    return gt(v, ctx.config.blame_share), v


def mismatch_rule(c: Cols, ctx: RuleContext):
    """The mismatch rule: KL(mu || pi_old) per token above mismatch_kl and its typical |log ratio| above the drift."""
    kl, drift = col(c, "mismatch_kl"), np.nan_to_num(col(c, "drift_abs_mean"))
    with np.errstate(invalid="ignore"):
        typical = np.sqrt(2 * np.maximum(kl, 0))
    return gt(kl, ctx.config.mismatch_kl) & gt(typical - drift, 0), kl


def _jump(metric: str, flagged: bool):
    def fire(c: Cols, ctx: RuleContext):
        v = col(c, metric)
        base = trailing_median(v, ctx.alert_window)
        if flagged:
            tokens = np.maximum(col(c, "tokens"), 1.0)
            base = np.maximum(base, 1.0 / tokens)
            gate = gt(v * tokens, MIN_FLAGGED - 0.5)
        else:
            gate = gt(v, ctx.weight_limit)
        return gt(v - ctx.alert_factor * base, 0) & gate, v
    return fire


RULES: tuple[Rule, ...] = (
    Rule("blowup", "loss_weight_max", "critical", _blowup, "the KL loss's |gradient weight| reaches {value}"),
    Rule("nonfinite", "nonfinite_count", "critical", _count("nonfinite_count"),
         "NaN or infinite log-probs ({value} token(s) at the peak)"),
    Rule("invalid", "invalid_count", "critical", _count("invalid_count"),
         "log-probs above 0, i.e. probability > 1 ({value} token(s) at the peak)"),
    Rule("blame_share", "blame_share", "warning", _blame,
         "flagged tokens carry up to {value} of the total |k3 weight| (a few tokens dominate the KL gradient)"),
    Rule("mismatch", "mismatch_kl", "warning", mismatch_rule,
         "sampler/trainer mismatch KL(mu||pi_old) reaches {value} per token, above the policy drift"),
    Rule("weight_blowup_onset", "weight_k3_abs_max", "warning", _jump("weight_k3_abs_max", False),
         "max |k3 weight| leaves its recent range (up to {value})", True),
    Rule("flagged_onset", "flagged_frac", "warning", _jump("flagged_frac", True),
         "the flagged-token fraction leaves its recent range (up to {value})", True),
    Rule("latent", "weight_k3_abs_max", "info", _latent,
         "K3's weight on this run's tokens reaches {value} (not this run's loss: K3 values logged here look huge)"),
    *(Rule(kind, metric, "warning", fire, what) for kind, metric, fire, what in EARLY),
)
KINDS = tuple(r.kind for r in RULES)
# Names `--fail-on` and Guard(on=...) accept besides the kinds (the rules of `kldiag report`).
ALIASES: dict[str, tuple[str, ...]] = {
    "blame": ("blame_share",), "nonfinite": ("nonfinite", "invalid"), "jump": ("weight_blowup_onset", "flagged_onset"),
    "early": EARLY_KINDS, "all": KINDS,
}


def parse_kinds(text: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """'blowup,nonfinite' -> the episode kinds they name; raises ValueError naming the choices."""
    names = [n.strip() for n in (text.split(",") if isinstance(text, str) else text) if n.strip()]
    out: list[str] = []
    for n in names:
        if n in ALIASES:
            out += ALIASES[n]
        elif n in KINDS:
            out.append(n)
        else:
            raise ValueError(f"unknown rule {n!r}; choose from {', '.join(KINDS)}, "
                             f"{', '.join(a for a in ALIASES if a != 'all')} or all")
    if not out:
        raise ValueError(f"no rule given; choose from {', '.join(KINDS)} or all")
    return tuple(dict.fromkeys(out))


# Causes the live faces (kldiag.Guard, `kldiag watch --fail-on`) act on besides the episode kinds: steps whose
# rows the run lacks (the diagnosis's data_missing; the guard sees the recorder's dropped and lost rows).
LIVE_CAUSES = ("data_missing",)


def parse_rules(text: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """parse_kinds, plus the LIVE_CAUSES by name ("all" names them too); raises ValueError naming the choices."""
    names = [n.strip() for n in (text.split(",") if isinstance(text, str) else text) if n.strip()]
    causes = tuple(c for c in LIVE_CAUSES if c in names or "all" in names)
    rest = [n for n in names if n not in LIVE_CAUSES]
    try:
        return tuple(dict.fromkeys((*parse_kinds(rest), *causes))) if rest or not causes else causes
    except ValueError as e:
        raise ValueError(f"{e}, or {', '.join(LIVE_CAUSES)}") from None


def spans(fire: np.ndarray, quiet: int) -> list[tuple[int, int]]:
    """(first, last) row indices of the runs of `fire`, gaps shorter than `quiet` bridged."""
    hits = np.flatnonzero(fire)
    if not len(hits):
        return []
    breaks = np.flatnonzero(np.diff(hits) > quiet)
    firsts = np.concatenate([[hits[0]], hits[breaks + 1]])
    lasts = np.concatenate([hits[breaks], [hits[-1]]])
    return [(int(a), int(b)) for a, b in zip(firsts, lasts, strict=True)]


def _windows(fire: np.ndarray, n: int, m: int) -> np.ndarray:
    """Per row: inside a window of m consecutive rows (m capped at the rows) where at least n fire."""
    k = len(fire)
    m = max(1, min(m, k))
    ok = np.convolve(fire.astype(np.int64), np.ones(m, np.int64), "valid") >= min(n, m)  # windows at 0..k-m
    return np.convolve(ok.astype(np.int64), np.ones(m, np.int64), "full")[:k] > 0


def sustained(fire: np.ndarray, rule: Persistence = Persistence()) -> np.ndarray:
    """Per row: it fires and lies in a burst or a recurrence (`Persistence`). The persistence rule of
    the causes and of the episodes' severity: an isolated outlier step is a note, not a finding."""
    fire = np.asarray(fire, dtype=bool)
    if not len(fire):
        return fire
    span = min(rule.span, len(fire))
    recur = max(rule.steps, math.ceil(rule.share * span))
    return fire & (_windows(fire, rule.steps, rule.window) | _windows(fire, recur, span))


def first_sustained(step: np.ndarray, fire: np.ndarray, config: RuleConfig) -> int | None:
    """The step of the first row of `fire` that is sustained (config.persistence)."""
    hit = np.flatnonzero(sustained(fire, config.persistence))
    return int(step[hit[0]]) if len(hit) else None


PERCENT_METRICS = ("blame_share", "flagged_frac", "entropy_drop")
K3_ONLY = ("blame_share", "weight_blowup_onset", "flagged_onset", *EARLY_K3)  # info when the loss is not K3
ALWAYS = ("nonfinite", "invalid")  # one bad log-prob is a fault: no persistence asked


def _severity(rule: Rule, ctx: RuleContext, sustained_inside: bool) -> str:
    if rule.kind in K3_ONLY and ctx.estimator != "k3":
        return "info"
    return rule.severity if sustained_inside or rule.kind in ALWAYS else "info"


def rule_episodes(rule: Rule, cols: Cols, ctx: RuleContext) -> list[Episode]:
    """The episodes of one rule; end is None while firing in the last quiet_steps rows. An episode
    without a sustained step (config.persistence) is info: an isolated note."""
    fire, value = rule.fire(cols, ctx)
    step = np.asarray(cols["step"], dtype=np.int64)
    quiet = max(1, ctx.config.quiet_steps, ctx.alert_window if rule.bridge_window else 0)
    sus = sustained(fire, ctx.config.persistence)
    out = []
    for a, b in spans(fire, quiet):
        inside = np.flatnonzero(fire[a:b + 1]) + a
        vals = np.nan_to_num(value[inside], nan=-np.inf, posinf=np.inf)
        peak = int(inside[int(np.argmax(vals))])
        ongoing = b >= len(step) - quiet
        end = None if ongoing else int(step[b])
        metric = LOSS_WEIGHT_COLUMN.get(ctx.estimator, rule.metric) if rule.kind == "blowup" else rule.metric
        severity = _severity(rule, ctx, bool(sus[a:b + 1].any()))
        span = (f"from step {step[a]} (ongoing)" if ongoing else f"step {step[a]}" if a == b
                else f"steps {step[a]}-{end}")
        what = rule.what.format(value=fmt.metric(float(value[peak]), rule.metric in PERCENT_METRICS))
        msg = f"{span}: {what}, peak at step {step[peak]}"
        if not sus[a:b + 1].any() and rule.kind not in ALWAYS:
            msg += f" (isolated: {len(inside)} firing step(s); a finding needs {ctx.config.persistence.describe()})"
        out.append(Episode(rule.kind, int(step[a]), end, int(step[peak]), float(value[peak]), severity, msg,
                           metric=metric, steps=len(inside)))
    return out


def episodes(cols: Cols, ctx: RuleContext, kinds: tuple[str, ...] | None = None) -> list[Episode]:
    """Every rule's episodes (or those of `kinds`), sorted by start step then kind."""
    if not len(cols["step"]):
        return []
    out = [e for r in RULES if kinds is None or r.kind in kinds for e in rule_episodes(r, cols, ctx)]
    return sorted(subsume(out), key=lambda e: (e.start, KINDS.index(e.kind)))


ONSET_KINDS = ("weight_blowup_onset", "flagged_onset")


def subsume(eps: list[Episode]) -> list[Episode]:
    """Drop the onset rules' episodes that start inside a blow-up episode after its first step:
    while the loss weight is past the blow-up limit, a new jump says nothing new; and the K3 early
    warnings that start inside one, its first step included: they would warn of what is there."""
    blow = [(e.start, e.end) for e in eps if e.kind == "blowup"]

    def inside(s: int, first: bool) -> bool:
        return any((a <= s if first else a < s) and (b is None or s <= b) for a, b in blow)

    return [e for e in eps if not (e.kind in ONSET_KINDS and inside(e.start, False))
            and not (e.kind in EARLY_K3 and inside(e.start, True))]


def table_cols(table) -> dict[str, np.ndarray]:
    """A pyarrow steps table as {column: float64 array} (nulls as NaN), step as int64."""
    out = {}
    for name in table.column_names:
        v = table.column(name).to_numpy(zero_copy_only=False)
        out[name] = np.asarray(v, dtype=np.int64 if name == "step" else np.float64)
    return out
