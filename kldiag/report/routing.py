"""The MoE routing section of `kldiag report` (text and HTML): the dashboard's routing views
(kldiag/views/routing.py). A run without recorded routes gets no section."""

from __future__ import annotations

import html
import warnings

from kldiag.fmt import num
from kldiag.report.tables import frame_table
from kldiag.views import routing as VR


def text_lines(analysis) -> list[str]:
    """The stdout lines: the headline and the layers whose routes differ most."""
    view = VR.view_of(analysis)
    if not view.routed:
        return []
    layers = sorted((r for r in view.summary["layers"] if r["differ_share"]), key=lambda r: -r["differ_share"])
    lines = [f"routing: {VR.headline(view)}"]
    if layers:
        lines.append("  layers routed differently most: " + ", ".join(
            f"{r['layer']} ({num(r['differ_share'])})" for r in layers[:6]))
    return lines


def section_html(analysis) -> str:
    """The HTML section (escaped): headline, the agree/disagree table and the two charts (Plotly's JavaScript
    is already on the page)."""
    import plotly.io as pio

    try:
        view = VR.view_of(analysis)
        if not view.routed:
            return ""
        df = VR.table(view)
        out = ["<h2>MoE routing: engine vs trainer experts</h2>", f"<p>{html.escape(VR.headline(view))}</p>",
               frame_table(df, lambda v: num(v, nan="-"))]
        out += [pio.to_html(f, full_html=False, include_plotlyjs=False)
                for f in (VR.agreement_by_layer(view), VR.mismatch_by_side(view))]
        return "".join(out)
    except Exception as e:  # the report never fails on its routing section
        warnings.warn(f"kldiag report: routing section skipped ({type(e).__name__}: {e})", stacklevel=2)
        return f"<h2>MoE routing</h2><p>Skipped: {html.escape(type(e).__name__)}: {html.escape(str(e))}</p>"
