"""The diagnosis contract: episodes, causes and the verdict (DESIGN.md section 6).

`kldiag analyze --json` prints `Diagnosis.to_dict()` under "diagnosis" and the episodes under
"alerts"; cause names are a public contract listed in docs/metrics.md (CAUSE_NAMES).
Every default is on this screen.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

SEVERITIES = ("info", "warning", "critical")  # ordered: a verdict is driven by the worst
VERDICTS = ("healthy", "warning", "unstable")

CAUSE_NAMES = (
    "k3_weight_blowup", "clamp_dead_zone", "offpolicy_drift", "engine_mismatch",
    "engine_temperature_mismatch", "numerical_fault", "entropy_collapse",
)


@dataclass(frozen=True)
class DiagnosisConfig:
    """Thresholds of the episode rules and the cause detectors (docs/metrics.md cites each)."""

    blowup_weight: float = 100.0  # |loss weight| beyond this: a blow-up (10x the flag limit W)
    blame_share: float = 0.5  # flagged tokens' share of the |k3 weight| (DESIGN.md section 3)
    mismatch_kl: float = 0.01  # mean KL(mu || pi_old) per token (kldiag report's rule)
    quiet_steps: int = 10  # an episode ends after this many steps without firing (a recovery)
    ess_low: float = 0.3  # rho_ess below: verl docs/algo/rollout_corr.md, "Troubleshooting"
    rho_mean_range: tuple[float, float] = (0.5, 2.0)  # ibid., "Mean IS weight far from 1.0"
    token_mult_prob_error: float = 1.05  # NeMo-RL plots the worst sample above this
    clamp_frac: float = 1e-3  # share of tokens in the K3 clamp's dead zone worth a cause
    confident_p: float = 0.99  # "confident" token: p = exp(logp) above this
    collapse_share: float = 0.9  # entropy collapse: this share of tokens is confident ...
    collapse_entropy_ratio: float = 0.2  # ... and the mean entropy fell below this x its start
    evidence_tokens: int = 5  # worst tokens attached to an episode or a cause


def _clean(v: Any) -> Any:
    """JSON-safe: NaN/inf become None, numpy scalars become Python numbers."""
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
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

    kind: str  # a rule name in kldiag.diagnosis.episodes.RULES
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
        return _clean(asdict(self))


@dataclass
class Cause:
    """One cause of trouble, with its onset step, the evidence and a fix for the run's trainer.

    cause:    a name in CAUSE_NAMES (detectors of other modules may add names; document them)
    onset:    the first step where it shows, None when it is not step-specific
    severity: one of SEVERITIES
    evidence: metrics, steps and tokens that support it (JSON-serialisable after _clean)
    fix:      advice phrased with the trainer's own option names (kldiag.diagnosis.fixes)
    extra:    more top-level keys of the JSON object, e.g. {"implied_temperature": 0.7}
    """

    cause: str
    onset: int | None
    severity: str
    evidence: dict[str, Any]
    fix: str
    summary: str = ""  # one line for the terminal and the dashboard
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = {"cause": self.cause, "onset": self.onset, "severity": self.severity,
             "summary": self.summary, "evidence": self.evidence, "fix": self.fix, **self.extra}
        return _clean(d)


@dataclass
class Diagnosis:
    """verdict: "healthy" (no cause, no warning episode), "warning" or "unstable"."""

    verdict: str
    causes: list[Cause] = field(default_factory=list)
    episodes: list[Episode] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "causes": [c.to_dict() for c in self.causes]}
