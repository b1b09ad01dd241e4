"""The hooks' one policy for a recording that fails: training goes on. The failure is counted on its
owner (`owner.failures`), warned about the first time only, and raised instead when KLDIAG_STRICT=1."""

from __future__ import annotations

import os
import warnings
from typing import Any


def recording_failed(owner: Any, e: BaseException, what: str, stacklevel: int = 3) -> None:
    """One failed recording of `what` ("an AReaL micro-batch"); raises `e` only with KLDIAG_STRICT=1."""
    owner.failures += 1
    if os.environ.get("KLDIAG_STRICT") == "1":
        raise e
    if owner.failures == 1:
        warnings.warn(f"kldiag: recording {what} failed ({type(e).__name__}: {e}); training goes on without it. "
                      "Set KLDIAG_STRICT=1 to raise instead", RuntimeWarning, stacklevel=stacklevel + 1)
