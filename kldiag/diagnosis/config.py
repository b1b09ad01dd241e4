"""The diagnosis's thresholds: the episode rules' (RuleConfig) and the cause detectors'. Every default on one screen."""

from __future__ import annotations

from dataclasses import dataclass

from kldiag.analysis.rules.episodes import RuleConfig


@dataclass(frozen=True)
class DiagnosisConfig(RuleConfig):
    """Thresholds of the episode rules (RuleConfig: blowup_weight 100, blame_share 0.5, mismatch_kl 0.01,
    quiet_steps 10, persistence, early) and of the cause detectors (docs/metrics.md cites each)."""

    ess_low: float = 0.3  # rho_ess below: verl docs/algo/rollout_corr.md, "Troubleshooting"
    rho_mean_range: tuple[float, float] = (0.5, 2.0)  # ibid., "Mean IS weight far from 1.0"
    clip_frac_high: float = 0.35  # the run's median rho_clip_frac above: chronically far off-policy (healthy: a few %)
    drift_abs_high: float = 0.3  # the run's median drift_abs_mean above (nats a token): ibid. (healthy: ~0.06)
    token_mult_prob_error: float = 1.05  # NeMo-RL plots the worst sample above this
    clamp_frac: float = 1e-3  # share of tokens in the K3 clamp's dead zone worth a cause
    confident_p: float = 0.99  # "confident" token: p = exp(logp) above this
    collapse_share: float = 0.9  # entropy collapse without entropies: this share of tokens is confident
    collapse_entropy_ratio: float = 0.2  # entropy collapse: the mean entropy below this x its early level ...
    entropy_band: float = 0.05  # ... its onset: where it last left its early level by more than this share
    # (or 3 robust standard deviations of the early steps, whichever is larger)
    evidence_tokens: int = 5  # worst tokens attached to an episode or a cause
    missing_critical_share: float = 0.5  # data_missing is critical when more than this share of the run's
    # steps lost rows on some rank (the verdict then speaks for less than half the run)
