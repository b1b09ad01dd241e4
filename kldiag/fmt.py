"""How numbers read on every face: one formatter for table cells, one for values in sentences.

`num` formats a cell of a table or a figure on a status line (the CLI's tables, `kldiag watch`, the
dashboard's hover text, the report's tables); `metric` formats a value inside a sentence (alert
messages, cause summaries, the report's rule lines). Both are pure functions of their arguments.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def num(v: Any, digits: int = 4, *, missing: str = "-", nan: str | None = None) -> str:
    """A table cell: `digits` significant digits for a float, "yes"/"no" for a bool, str() otherwise.

    None (a null) reads `missing`; NaN reads `nan` when given, else "nan"; infinities read "inf"
    and "-inf" (an overflow is a value, the worst there is).
    """
    if v is None:
        return missing
    if isinstance(v, (bool, np.bool_)):
        return "yes" if v else "no"
    if isinstance(v, (float, np.floating)):
        x = float(v)
        if math.isnan(x):
            return "nan" if nan is None else nan
        return f"{x:.{digits}g}" if math.isfinite(x) else str(x)
    return str(v)


def metric(x: float, percent: bool = False) -> str:
    """A value in a sentence: 3 significant digits, e-notation with 3 decimals from 1e4 up.

    `percent` writes a share as a whole percentage ("42%"). NaN (a metric the run cannot give)
    reads "n/a", infinities "inf" and "-inf".
    """
    x = float(x)
    if math.isnan(x):
        return "n/a"
    if not math.isfinite(x):
        return str(x)
    if percent:
        return f"{x:.0%}"
    return f"{x:.3g}" if abs(x) < 1e4 else f"{x:.3e}"
