"""Cause detectors: each is `f(analysis) -> list[Cause]`, listed in DETECTORS.

Another module adds its detectors with `register(f)` at import time (e.g. the parity
detectors of kldiag/diagnosis/parity.py, which are imported by `detectors()`), or a caller
passes its own list to `diagnose(analysis, detectors=[...])`.
"""

from __future__ import annotations

from collections.abc import Callable

from kldiag.diagnosis.types import Cause

Detector = Callable[..., list[Cause]]
DETECTORS: list[Detector] = []


def register(detector: Detector) -> Detector:
    """Add a detector to DETECTORS (usable as a decorator); registering twice is a no-op."""
    if detector not in DETECTORS:
        DETECTORS.append(detector)
    return detector


def detectors() -> list[Detector]:
    """DETECTORS after importing the optional detector modules (parity), if present."""
    try:
        import kldiag.diagnosis.parity  # noqa: F401  (issue 15: registers engine_* causes)
    except ImportError:
        pass
    return list(DETECTORS)
