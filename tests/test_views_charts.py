"""The step charts are built from plain dicts, unvalidated (charts.lines): the figure must equal the one
plotly's validated API builds, property for property (to_plotly_json)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest

from kldiag.views import charts as VC
from kldiag.views import dash as VD


def _equal(a, b, path=""):
    """Deep equality of two to_plotly_json() trees: same keys, same types, arrays of one dtype and values."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for k in a:
            _equal(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and np.array_equal(a, b, equal_nan=a.dtype.kind == "f"), path
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _equal(x, y, f"{path}[{i}]")
    else:
        assert type(a) is type(b) and a == b, (path, a, b)


def _steps(n: int = 200) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    df = pd.DataFrame({"step": np.arange(0, 2 * n, 2), **{c: rng.random(n) for s in VC.STEP_TRENDS
                                                          for c in s.columns}})
    df.loc[5:9, "k3_mean"] = 0.0  # zeros: not drawn on a log axis
    df.loc[3, "k3_is_mean"] = 1e-12  # a far lower tail: cut off, with a note
    return df.drop(index=range(50, 60)).reset_index(drop=True)  # a gap: the lines break


@pytest.mark.parametrize("kw", [{}, {"smoothing": 0.6}, {"x_range": (10, 120)}, {"smoothing": 0.3, "x_range": (0, 50)}])
@pytest.mark.parametrize("rows", [200, 30, 0])
def test_step_trends_equal_plotlys_validated_figure(kw, rows):
    onsets = [(120, "kl_blowup"), (122, "a long onset label"), (500, "out of range")]
    for fig in VC.step_trends(_steps(200).head(rows), onsets, **kw):
        _equal(fig.to_plotly_json(), go.Figure(fig.to_dict()).to_plotly_json())  # validation raises if invalid


def _validated_lines(df, columns, title, subtitle, y_title, onsets, smoothing):
    """`lines` as plotly's validated API builds it: traces, one finish, then decade_ticks (a log y axis)."""
    df = VD.with_breaks(df, "step")
    xs, fig = df["step"].to_numpy(), go.Figure()
    shown = []
    for i, c in enumerate(columns):
        y = df[c].to_numpy(dtype=np.float64, na_value=np.nan)
        y = np.where(y > 0, y, np.nan)
        name, color = VC.name_of(c), VC.COLORWAY[i]
        if smoothing:
            fig.add_trace(go.Scatter(x=xs, y=y, mode="lines", name=f"{name} (raw)", legendgroup=name,
                                     showlegend=False, opacity=0.25, line={"color": color}, hoverinfo="skip"))
            y = VD.ema(y, xs.astype(np.float64), smoothing)
        fig.add_trace(go.Scatter(x=xs, y=y, mode="lines", name=name, legendgroup=name, line={"color": color},
                                 hovertemplate=f"%{{y:.4g}} <i>({c})</i>"))
        shown.append(y)
    steps = xs[pd.notna(xs)].astype(np.float64)
    extra = {"hovermode": "x unified", **VC.onset_layout(onsets, (steps.min(), steps.max()))}
    VC.finish(fig, title, subtitle, "training step", y_title, 320, 2, extra)
    VC.decade_ticks(fig, np.concatenate(shown))
    return fig


@pytest.mark.parametrize("smoothing", [0.0, 0.5])
def test_lines_equal_the_validated_update_path(smoothing):
    spec = VC.STEP_TRENDS[0]  # log y, two series
    df, onsets = _steps(), [(120, "kl_blowup")]
    fig = VC.lines(df, spec.columns, spec.title, True, onsets, smoothing=smoothing, y_title=spec.y_title,
                   subtitle=spec.subtitle)
    ref = _validated_lines(df, spec.columns, spec.title, spec.subtitle, spec.y_title, onsets, smoothing)
    if not smoothing:  # the far lower tail's note reached the subtitle (smoothed, there is no such tail)
        assert fig.layout.title.subtitle.text.endswith("1 point below 1e-5 not drawn")
    _equal(fig.to_plotly_json(), ref.to_plotly_json())
