"""kldiag: per-token KL-penalty diagnostics for RL training of LLMs.

    import kldiag
    with kldiag.Recorder("runs/my_run", beta=0.04, estimator="k3") as rec:
        rec.record(step=step, logp=logp, logp_old=logp_old, logp_ref=logp_ref, mask=mask)
    analysis = kldiag.analyze("runs/my_run")
"""

from __future__ import annotations

from typing import Any

from kldiag import _compat
from kldiag.errors import KldiagError
from kldiag.format import Manifest, open_run
from kldiag.version import __version__

# Imported on first use: `import kldiag` stays cheap, and torch is never imported by it.
_LAZY = {
    "Recorder": "kldiag.record.recorder",
    "RecorderConfig": "kldiag.record.recorder",
    "analyze": "kldiag.analysis",
    "Analysis": "kldiag.analysis",
    "AnalysisConfig": "kldiag.analysis",
    "Guard": "kldiag.live.guard",
    "crosswalk": "kldiag.crosswalk",
    "audit": "kldiag.crosswalk.audit",
}

__all__ = ["Analysis", "AnalysisConfig", "Guard", "KldiagError", "Manifest", "Recorder", "RecorderConfig",
           "__version__", "analyze", "audit", "crosswalk", "open_run"]

_compat.install()  # old module paths (kldiag.recorder, kldiag.guard, ...) keep working


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kldiag' has no attribute {name!r}")
