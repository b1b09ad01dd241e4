"""The diagnosis contract: episodes, causes and the verdict (docs/metrics.md, "kldiag analyze RUN --json").

`kldiag analyze --json` prints `Diagnosis.to_dict()` under "diagnosis" and the episodes under
"alerts"; cause names are a public contract listed in docs/metrics.md (CAUSE_NAMES).
Every default is on this screen.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kldiag.analysis.rules.episodes import SEVERITIES, Episode, json_safe
from kldiag.diagnosis.config import DiagnosisConfig

__all__ = ["CAUSE_NAMES", "SEVERITIES", "VERDICTS", "Cause", "Diagnosis", "DiagnosisConfig", "Episode"]

VERDICTS = ("healthy", "warning", "unstable")

CAUSE_NAMES = (
    "k3_weight_blowup", "clamp_dead_zone", "offpolicy_drift", "engine_mismatch",
    "engine_temperature_mismatch", "numerical_fault", "entropy_collapse",
    # the mismatch's root causes (kldiag/mismatch/signatures.py), each named instead of engine_mismatch
    "engine_raw_logprobs", "engine_wrong_token", "engine_precision", "engine_stale_weights", "engine_async_lag",
    "engine_retokenization",  # multi-turn: the trainer scores re-tokenised turns (kldiag/diagnosis/retokenize.py)
    "engine_truncated_sampling",  # top-k/top-p log-probs against a full-vocabulary trainer (diagnosis/truncation.py)
    "data_missing",  # unreadable or empty parts, steps missing inside a rank (diagnosis/missing.py)
    "moe_routing_mismatch", "routing_replay_broken",  # MoE routing (kldiag/diagnosis/routing.py)
    "async_staleness",  # recorded weight versions: drift grows with staleness past the clip (diagnosis/staleness.py)
    # rollouts across a weight update, the engine's wrong weights, low-precision rollouts
    "mixed_version_rollout", "engine_wrong_weights", "engine_low_precision",
    # parity contracts (diagnosis/contract.py) and the learning signal (diagnosis/signal.py)
    "parity_broken", "batch_variance", "kl_dominated_signal",
)


@dataclass
class Cause:
    """One cause of trouble, with its onset step, the evidence and a fix for the run's trainer.

    cause:    a name in CAUSE_NAMES (detectors of other modules may add names; document them)
    onset:    the first step where it shows, None when it is not step-specific
    severity: one of SEVERITIES
    evidence: metrics, steps and tokens that support it (JSON-serialisable after json_safe)
    fix:      advice phrased with the trainer's own option names (kldiag.frameworks)
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
        return json_safe(d)


@dataclass
class Diagnosis:
    """verdict: "healthy" (no cause, no warning episode), "warning" or "unstable"."""

    verdict: str
    causes: list[Cause] = field(default_factory=list)
    episodes: list[Episode] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "causes": [c.to_dict() for c in self.causes]}
