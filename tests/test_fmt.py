"""kldiag.fmt: the one number formatter of the faces, equal to each copy it replaced."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kldiag import fmt

VALUES = [0.0, 1.0, -2.5, 0.000123456, 1234.5678, 9999.4, 12345.678, -98765.4321, 1e300, 3e-12,
          math.inf, -math.inf, math.nan, np.float64(0.1234567), np.float32(0.5), 7, None, "x", True, np.bool_(False)]


@pytest.mark.parametrize("v", VALUES, ids=repr)
def test_num_equals_the_cli_and_watch_copies(v):
    def analyze_cell(v):  # kldiag/cli/analyze.py before
        return "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)

    def crosswalk_cell(v):  # kldiag/cli/crosswalk.py before
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.6g}" if math.isfinite(v) else str(v)
        return str(v)

    def watch_cell(v):  # kldiag/live/watch.py before
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3g}" if v == v else "nan"
        return str(v)

    if isinstance(v, (bool, np.bool_)):  # the CLI tables never show booleans: fmt says yes/no
        assert fmt.num(v) == ("yes" if v else "no")
        return
    if isinstance(v, np.float32):  # not a float subclass: the copies printed str(), fmt formats it
        assert fmt.num(v) == "0.5"
        return
    assert fmt.num(v) == analyze_cell(v)
    assert fmt.num(v, 6) == crosswalk_cell(v)
    assert fmt.num(v, 3) == watch_cell(v)


@pytest.mark.parametrize("v", VALUES, ids=repr)
def test_num_equals_the_dashboard_hover_copy(v):
    def hover(v):  # kldiag/views/pages.py before
        if v is None or (isinstance(v, float) and np.isnan(v)):
            return "n/a"
        if isinstance(v, (bool, np.bool_)):
            return "yes" if v else "no"
        if isinstance(v, (float, np.floating)):
            return f"{float(v):.4g}"
        return str(v)

    assert fmt.num(v, missing="n/a", nan="n/a") == hover(v)


@pytest.mark.parametrize("x", [v for v in VALUES if isinstance(v, (float, int)) and not isinstance(v, bool)], ids=repr)
@pytest.mark.parametrize("percent", [False, True])
def test_metric_equals_the_alert_and_report_copies(x, percent):
    def report_num(x):  # kldiag/report/build.py fmt_num
        x = float(x)
        if math.isnan(x):
            return "n/a"
        if not math.isfinite(x):
            return str(x)
        return f"{x:.3g}" if abs(x) < 1e4 else f"{x:.3e}"

    def alert_num(v, percent):  # kldiag/analysis/rules/episodes.py _fmt (NaN read "nan" there)
        v = float(v)
        if not math.isfinite(v):
            return str(v)
        return f"{v:.0%}" if percent else f"{v:.3g}" if abs(v) < 1e4 else f"{v:.3e}"

    if math.isnan(float(x)):
        assert fmt.metric(x, percent) == "n/a"
        return
    assert fmt.metric(x, percent) == alert_num(x, percent)
    if not percent:
        assert fmt.metric(x) == report_num(x)


def test_examples():
    assert fmt.num(12345.678) == "1.235e+04" and fmt.num(None) == "-" and fmt.num(math.inf) == "inf"
    assert fmt.metric(12345.678) == "1.235e+04" and fmt.metric(0.4567, percent=True) == "46%"
    assert fmt.metric(math.nan) == "n/a" and fmt.metric(-math.inf) == "-inf"
