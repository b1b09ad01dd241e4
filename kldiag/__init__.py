"""kldiag: per-token KL-penalty diagnostics for RL training of LLMs."""

from __future__ import annotations

__version__ = "0.1.0"

from kldiag.errors import KldiagError  # noqa: E402
from kldiag.format import Manifest, open_run  # noqa: E402

__all__ = ["KldiagError", "Manifest", "open_run", "__version__"]
