"""The Mismatch sections of `kldiag report` (text and HTML), the same views as the dashboard's Mismatch page:
engine/trainer parity, drift against mismatch, the low-probability pitfall, what-if corrections at their
default thresholds, and the crosswalk of the run's framework (mean and last value of each metric)."""

from __future__ import annotations

import html
import math
import warnings
from typing import Any

import numpy as np

from kldiag.diagnosis import diagnose
from kldiag.fmt import num
from kldiag.mismatch import whatif as W
from kldiag.report.tables import html_table
from kldiag.views import charts as VC
from kldiag.views import leads as VL
from kldiag.views import mismatch as VM


def _cell(x: Any) -> str:
    """A table cell; NaN and infinities read "-" (a what-if or crosswalk figure the run cannot give)."""
    return "-" if isinstance(x, float) and not math.isfinite(x) else num(x)


def whatif_rows(view: VM.MismatchView) -> list[list[str]]:
    """One row per correction and convention at the default thresholds (VM.whatif_table)."""
    return [[r["method"], r["old"], f"{r['token_frac']:.2%}", f"{r['seq_frac']:.2%}", _cell(r["ess"]),
             f"{r['mass_removed_pos_share']:.1%}", f"{r['mass_removed_neg_share']:.1%}", r["denominator"],
             _cell(r["grad_scale"])] for r in VM.whatif_table(view)]


def crosswalk_rows(analysis, manifest) -> tuple[str, list[list[str]], dict[str, str]]:
    fw = VM.own_framework(manifest)
    frame, reasons = VM.crosswalk_frame(analysis, fw)
    rows = []
    for c in frame.columns[1:]:
        v = frame[c].astype(float)
        rows.append([c, _cell(float(np.nanmean(v))) if v.notna().any() else "-",
                     _cell(float(v.dropna().iloc[-1])) if v.notna().any() else "-"])
    return fw, rows, reasons


def text_lines(analysis, diagnosis=None) -> list[str]:
    """The stdout lines of the Mismatch section (`diagnosis`: the run's, else diagnosed here)."""
    view = VM.view_of(analysis)
    if not view.has_sampler:
        return ["mismatch: no sampler log-probs (logp_sampler) recorded: engine parity not checked"]
    s = view.summary
    lines = [f"mismatch: |log pi_theta/pi_old| (drift) {s['drift_abs']:.4g}, |log pi_old/mu| (engine) "
             f"{s['mismatch_abs']:.4g} nats per token (engine share {s['mismatch_share']:.0%})"]
    lines += [f"  {label}: {value}" for label, value, _ in VM.parity_rows(view)[:1]]
    dg = diagnosis or diagnose(analysis)
    lines += [f"  {f}" for f in VM.parity_findings(dg)]
    note = VL.parity_note(dg)  # "agree up to float noise" only beside a healthy verdict
    if note is not None:
        lines.append(f"  {note[1]}")
    return lines


def _figures(view: VM.MismatchView) -> list[Any]:
    """The dashboard's Mismatch charts (kldiag.views.charts), drawn once for both."""
    return [VC.drift_vs_mismatch(view.by_step), VC.mismatch_by_prob(view.by_prob)]



def section_html(analysis, manifest, include_plotlyjs: bool = False, diagnosis=None) -> str:
    """The HTML of the Mismatch sections (escaped; Plotly's JS only when include_plotlyjs; `diagnosis`:
    the run's, else diagnosed here)."""
    import plotly.io as pio

    try:
        view = VM.view_of(analysis)
        out = ["<h2>Mismatch: engine against trainer</h2>"]
        if view.step_stride > 1 or view.group_share < 1:
            out.append(f"<p>{html.escape(VM.sample_caption(view))}</p>")
        if view.has_sampler:
            out.append(html_table(["check", "value", "meaning"], VM.parity_rows(view)))
            dg = diagnosis or diagnose(analysis)
            out += [f"<p><b>{html.escape(f)}</b></p>" for f in VM.parity_findings(dg)]
            if (note := VL.parity_note(dg)) is not None:
                out.append(f"<p>{html.escape(note[1])}</p>")
            out += [pio.to_html(f, full_html=False, include_plotlyjs=include_plotlyjs and i == 0)
                    for i, f in enumerate(_figures(view))]
        else:
            out.append("<p>No sampler log-probs (logp_sampler) recorded: the engine's mu is unknown.</p>")
        out.append("<h2>What if: corrections at their default thresholds</h2>")
        with VM.holding(view):  # one token set for every replay and the crosswalk
            why = VM.whatif_missing(VM.whatif_frame(view, W.WhatIf()))
            if why:
                out.append(f"<p>{html.escape(why)}</p>")
            else:
                out.append(html_table(["correction", "old", "tokens masked/clipped", "sequences affected", "mean ESS",
                                       "PG mass removed, A>0", "PG mass removed, A<0", "loss denominator",
                                       "gradient scale"], whatif_rows(view)))
                out.append("<p>Loss denominator: <i>all</i>, the framework's token-mean keeps the rejected tokens in its "
                           "count (the kept gradient shrinks); <i>kept</i>, it counts only the kept ones. Gradient scale: "
                           "the corrected policy-gradient weight per token over the uncorrected, under that denominator "
                           "(mean over steps).</p>")
            fw, rows, reasons = crosswalk_rows(analysis, manifest)
        out.append(f"<h2>Crosswalk: {html.escape(fw)}'s own metrics from these tokens</h2>")
        out.append(html_table(["metric", "mean over steps", "last step"], rows))
        out += [f"<p><code>{html.escape(k)}</code> is null: {html.escape(v)}</p>" for k, v in reasons.items()]
        return "".join(out)
    except Exception as e:  # the report never fails on its mismatch sections
        warnings.warn(f"kldiag report: mismatch sections skipped ({type(e).__name__}: {e})", stacklevel=2)
        return f"<h2>Mismatch</h2><p>Skipped: {html.escape(type(e).__name__)}: {html.escape(str(e))}</p>"
