"""Diagnosis: from the analysis tables to episodes, causes, a verdict and fixes.

    from kldiag.diagnosis import diagnose
    diagnosis = diagnose(analysis)   # Diagnosis(verdict, causes, episodes)

Modules: types (the contract: Episode, Cause, Diagnosis, DiagnosisConfig), episodes (alert
rules -> episodes), causes (DETECTORS: one function per cause, `f(analysis) -> list[Cause]`),
fixes (advice in the trainer's own option names), evidence (worst tokens of an episode), scan
(entropy and token_mult_prob_error per step, cached per part), core (diagnose: the verdict),
text and view (the terminal's and the dashboard's rendering); parity (issue 15: engine
parity causes). Cause names: docs/metrics.md.
"""

from kldiag.diagnosis.types import CAUSE_NAMES, Cause, Diagnosis, DiagnosisConfig, Episode

__all__ = ["CAUSE_NAMES", "Cause", "Diagnosis", "DiagnosisConfig", "Episode", "diagnose"]


def __getattr__(name: str):
    if name == "diagnose":
        from kldiag.diagnosis.core import diagnose

        return diagnose
    raise AttributeError(name)
