"""Diagnosis: from the analysis tables to episodes, causes, a verdict and fixes.

    from kldiag.diagnosis import diagnose
    diagnosis = diagnose(analysis)   # Diagnosis(verdict, causes, episodes)

Modules: types (the contract: Episode, Cause, Diagnosis, DiagnosisConfig), causes (DETECTORS: one
function per cause, `f(analysis) -> list[Cause]`), evidence (worst tokens of an episode), scan
(entropy and token_mult_prob_error per step, cached per part), core (diagnose: the verdict), text
(the terminal's rendering), parity (the engine-parity causes, from kldiag.mismatch.parity's fits), versions and
version_jumps (mixed_version_rollout), wrong_weights (engine_wrong_weights), low_precision (engine_low_precision).
Elsewhere: the alert rules that make episodes are kldiag.analysis.rules.episodes, the fixes in each
trainer's option names kldiag.frameworks, the dashboard's rendering kldiag.views.diagnosis.
Cause names: docs/metrics.md.
"""

from kldiag.diagnosis.types import CAUSE_NAMES, Cause, Diagnosis, DiagnosisConfig, Episode

__all__ = ["CAUSE_NAMES", "Cause", "Diagnosis", "DiagnosisConfig", "Episode", "diagnose"]


def __getattr__(name: str):
    if name == "diagnose":  # start-up: the trainer's Guard imports the contract (types), not the detectors
        from kldiag.diagnosis.core import diagnose

        return diagnose
    raise AttributeError(name)
