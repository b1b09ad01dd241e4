"""The per-turn section of `kldiag report` (text and HTML) for multi-turn runs: the dashboard's
"Engine mismatch by turn" views (kldiag/views/turns.py). A single-turn run gets no section."""

from __future__ import annotations

import html
import warnings

from kldiag.fmt import num
from kldiag.report.tables import frame_table
from kldiag.views import turns as VT


def _cell(v) -> str:
    return "-" if v is None else num(v)


def text_lines(analysis) -> list[str]:
    """The stdout lines: per turn, tokens and mismatch at the first token against the rest."""
    view = VT.view_of(analysis)
    if not view.multi_turn:
        return []
    s = view.summary
    lines = [f"turns: {s['turns']} turn(s); {s['sequences']['multi_turn']} multi-turn and "
             f"{s['sequences']['single_turn']} single-turn sequences; |log mu - log pi_old| by turn:"]
    for r in s["by_turn"]:
        lines.append(f"  turn {r['turn']}: {r['tokens']} tokens, mean {_cell(r['mismatch_abs_mean'])} "
                     f"(first token {_cell(r['start_mismatch_abs_mean'])}, rest {_cell(r['body_mismatch_abs_mean'])}), "
                     f"drift {_cell(r['drift_abs_mean'])}, |k3 weight| {_cell(r['weight_k3_abs_mean'])}, "
                     f"flagged {_cell(r['flagged_frac'])}")
    return lines


def section_html(analysis) -> str:
    """The HTML section (escaped): the per-turn table and, with sampler log-probs, the two charts (Plotly's
    JavaScript is already on the page: the step trends or the Mismatch section load it)."""
    import plotly.io as pio

    try:
        view = VT.view_of(analysis)
        if not view.multi_turn:
            return ""
        df = VT.table(view)
        out = ["<h2>Turns: figures by turn of the conversation</h2>", frame_table(df, _cell)]
        if any(r["mismatch_abs_mean"] is not None for r in view.summary["by_turn"]):
            out += [pio.to_html(f, full_html=False, include_plotlyjs=False)
                    for f in (VT.mismatch_by_step(view), VT.start_vs_body(view))]
        return "".join(out)
    except Exception as e:  # the report never fails on its turn section
        warnings.warn(f"kldiag report: turn section skipped ({type(e).__name__}: {e})", stacklevel=2)
        return f"<h2>Turns</h2><p>Skipped: {html.escape(type(e).__name__)}: {html.escape(str(e))}</p>"
