"""Diagnosis: from the analysis tables to episodes, causes, a verdict and fixes.

    from kldiag.diagnosis import diagnose
    diagnosis = diagnose(analysis)   # Diagnosis(verdict, causes, episodes)

Modules: types (the contract: Episode, Cause, Diagnosis), episodes (alert rules -> episodes),
causes (DETECTORS: one function per cause, `f(analysis) -> list[Cause]`), fixes (advice in the
trainer's own option names), core (diagnose: verdict). Cause names: docs/metrics.md.
"""

from kldiag.diagnosis.types import CAUSE_NAMES, Cause, Diagnosis, DiagnosisConfig, Episode

__all__ = ["CAUSE_NAMES", "Cause", "Diagnosis", "DiagnosisConfig", "Episode", "diagnose"]


def __getattr__(name: str):
    if name == "diagnose":
        from kldiag.diagnosis.core import diagnose

        return diagnose
    raise AttributeError(name)
