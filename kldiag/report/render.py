"""What `kldiag report` shows: the stdout summary and the HTML page.

The page is one self-contained file that opens offline: Plotly's JavaScript is embedded
once, with the first figure (plotly.io.to_html with include_plotlyjs=True, then False).
Token text is model output, hence untrusted: every piece and every message goes through
html.escape before it reaches the page, and through `printable` before a terminal. What the
page says about the run (verdict, causes, episodes, fixes) is the report's Diagnosis; its step
charts are the dashboard Overview's (kldiag.views.charts).
"""

from __future__ import annotations

import html
import math
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kldiag.analysis.reducers.coverage_table import coverage_of
from kldiag.diagnosis.text import verdict_line
from kldiag.fmt import metric as fmt_num
from kldiag.report import mismatch as RM
from kldiag.report import routing as RR
from kldiag.report import turns as RT
from kldiag.report.build import Offender, Report, fmt_weight_max, has_reference, principal
from kldiag.report.coverage import coverage_lines, flagged_line, staleness_lines, staleness_of
from kldiag.report.coverage import section_html as coverage_html
from kldiag.report.tables import html_table
from kldiag.views import charts as VC

# ---- text -----------------------------------------------------------------------------


def printable(piece: str) -> str:
    """Token text safe for a terminal: control characters (ANSI escapes included) as \\x.. escapes."""
    return "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in piece)


def in_context(o: Offender, show: Callable[[str], str], mark: Callable[[str], str]) -> str:
    """The offending token between its neighbours. Subword pieces carry their own spaces
    (" um"); word-level pieces do not, so those are joined with a space."""
    pieces = [*o.before, o.piece, *o.after]
    sep = "" if any(p[:1].isspace() or p[-1:].isspace() for p in pieces) else " "
    parts = [show(p) for p in o.before] + [mark(show(o.piece))] + [show(p) for p in o.after]
    return sep.join(parts)


def episode_lines(rep: Report) -> list[str]:
    """What fired, one line per alert episode of the diagnosis (at most config.text_episodes)."""
    eps = rep.diagnosis.episodes
    if not eps:
        return ["alert episodes: none"]
    shown = eps[:rep.config.text_episodes]
    lines = [f"alert episodes ({len(eps)}):"]
    lines += [f"  [{e.severity:8s}] {e.kind:19s} {printable(e.message)}" for e in shown]
    if len(eps) > len(shown):
        lines.append(f"  ... {len(eps) - len(shown)} more on the HTML page")
    return lines


def format_text(rep: Report) -> str:
    """The short stdout summary."""
    f = rep.facts
    assumed = " (assumed: the manifest does not say)" if rep.estimator_assumed else ""
    lines = [(f"kldiag report: {rep.run_dir}  (loss {rep.estimator}{assumed}, beta {f['beta']}, "
              f"{f['steps']} steps, {f['tokens']} tokens)"),
             verdict_line(rep.diagnosis) + (f"; onset at step {rep.onset_step}" if rep.onset_step is not None
                                            else "")]
    head = principal(rep.diagnosis) if rep.diagnosis is not None else None
    if head:
        lines.append(f"principal cause: {head}")
    if rep.analysis is not None:
        lines.append(flagged_line(rep.analysis.steps))
    if rep.first_moved:
        lines.append(f"first to move: {rep.first_moved[1]} at step {rep.first_moved[0]} ({rep.first_moved[2]})")
    lines += episode_lines(rep)
    if rep.offenders:
        lines.append("top offending tokens (largest |k3 weight|):")
    for o in rep.offenders[:rep.config.text_tokens]:
        ctx = in_context(o, printable, lambda p: f"[{p}]")
        ratio = f"e^{o.d:.1f}" if math.isfinite(o.d) else "n/a"  # no logp_ref: no ratio
        lines.append(f"  step {o.step:5d} seq {o.seq} pos {o.pos}: |k3 w| {fmt_num(abs(o.weight_k3))}  "
                     f"|k3_is w| {fmt_num(abs(o.weight_k3_is))}  pi_ref/pi_theta = {ratio}  {ctx}")
    if not has_reference(rep.analysis.steps):
        lines.append("estimators: no reference log-probs (logp_ref) recorded")
    else:
        lines.append("estimators on this run's tokens: " + "; ".join(
            f"{c['estimator']} mean {fmt_num(c['mean'])} max|w| {fmt_weight_max(c)}" for c in rep.comparison
            if c["estimator"] != "k1"))
    lines.append("recommendations (the diagnosis's causes, worst first):")
    lines += [textwrap.fill(r, 100, initial_indent="  - ", subsequent_indent="    ") for r in rep.recommendations]
    if rep.analysis is not None:  # an MoE run's routing first (the verdict's finding when it has one), engine
        lines += RR.text_lines(rep.analysis)  # parity and drift, multi-turn runs, staleness, what was recorded
        lines += RM.text_lines(rep.analysis, rep.diagnosis)
        lines += RT.text_lines(rep.analysis)
        lines += staleness_lines(staleness_of(rep.analysis))
        lines += coverage_lines(coverage_of(rep.analysis))
    return "\n".join(lines)


# ---- HTML ---------------------------------------------------------------------------------


def figures(rep: Report) -> list[Any]:
    """The dashboard Overview's step trends (kldiag.views.charts), the diagnosis's onsets marked
    and the blow-up limit drawn on the |gradient weight| chart."""
    return VC.step_trends(rep.analysis.steps.to_pandas(), VC.trend_onsets(rep.diagnosis),
                          blowup_weight=rep.facts["blowup_weight"])


_CSS = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}
.v-healthy{color:#1a7f37}.v-warning{color:#9a6700}.v-unstable{color:#cf222e}code{background:#f4f4f4}
mark{background:#ffd7d5;font-weight:bold}.ctx{font-family:monospace;white-space:pre}"""



def _offender_rows(rep: Report) -> str:
    if rep.analysis is not None and not has_reference(rep.analysis.steps):
        return "<p>Not measured: the offending tokens are ranked by their K3 weight, which needs logp_ref.</p>"
    rows = []
    for o in rep.offenders:
        ctx = in_context(o, html.escape, lambda p: f"<mark>{p}</mark>")
        cells = [str(o.step), str(o.seq), str(o.pos), fmt_num(o.weight_k3), fmt_num(o.weight_k3_is), f"{o.d:.2f}"]
        rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + f"<td class=ctx>{ctx}</td></tr>")
    head = "".join(f"<th>{h}</th>" for h in ("step", "seq", "pos", "k3 weight", "k3_is weight",
                                             "d = log(pi_ref/pi_theta)", "in context"))
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>"


def render_html(rep: Report) -> str:
    """One self-contained HTML page: Plotly's JavaScript is embedded once, with the first figure."""
    import plotly.io as pio

    figs = figures(rep) if rep.analysis is not None and rep.analysis.steps.num_rows else []
    plots = "".join(pio.to_html(f, full_html=False, include_plotlyjs=(i == 0)) for i, f in enumerate(figs))
    if not figs:  # Plotly's JavaScript once, before the routing and mismatch charts
        from plotly.offline import get_plotlyjs

        plots = f"<script type='text/javascript'>{get_plotlyjs()}</script>"
    if rep.analysis is not None:  # the charts a run without logp_ref (or advantages) cannot draw, said
        plots += "".join(f"<p>{html.escape(g)}</p>" for g in VC.trend_gaps(rep.analysis.steps.to_pandas()))
    e, f = html.escape, rep.facts
    head = principal(rep.diagnosis) if rep.diagnosis is not None else None
    main = f"<p class='principal'>Principal cause: <b>{e(head)}</b></p>" if head else ""
    if rep.analysis is not None:
        main += f"<p>{e(flagged_line(rep.analysis.steps).capitalize())}</p>"
    first = (f"<p>First to move (the earliest alert episode): <b>{e(rep.first_moved[1])}</b> at step "
             f"{rep.first_moved[0]}: {e(rep.first_moved[2])}</p>" if rep.first_moved else "")
    onset = f" &middot; onset at step <b>{rep.onset_step}</b>" if rep.onset_step is not None else ""
    comp = html_table(["estimator", "mean value", "worst step mean", "max |weight|", "p99 |weight| (worst step)",
                   "expected gradient"], [[c["estimator"], fmt_num(c["mean"]), fmt_num(c["worst_step_mean"]),
                                           fmt_weight_max(c), fmt_num(c["weight_p99"]), c["target"]]
                                          for c in rep.comparison])
    if not has_reference(rep.analysis.steps):
        comp = "<p>No reference log-probs (logp_ref) recorded: no KL term to compare.</p>"
    recs = "".join(f"<li>{e(r)}</li>" for r in rep.recommendations)
    name = str(rep.run_dir).rstrip("/").rsplit("/", 1)[-1]  # a path or a URI
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>kldiag report: {e(name)}"
            f"</title><style>{_CSS}</style></head><body><h1>kldiag report: {e(str(rep.run_dir))}</h1>"
            f"<p>KL loss <code>{e(rep.estimator)}</code>{' (assumed)' if rep.estimator_assumed else ''}, beta "
            f"{e(str(f['beta']))}, {f['steps']} steps, {f['tokens']} tokens</p>"
            f"<h2 class='v-{e(rep.verdict)}'>Verdict: {e(rep.verdict.upper())}{onset}</h2>{main}{first}"
            f"<h2>What fired</h2>{_fired(rep)}"
            f"<h2>Recommendations</h2><ul>{recs}</ul><h2>Per step</h2>{plots}"
            f"<h2>Top offending tokens</h2>{_offender_rows(rep)}"
            f"<h2>Estimators on this run's tokens</h2>{comp}{_routing(rep)}{_mismatch(rep, False)}{_turns(rep)}"
            f"{coverage_html(rep.analysis) if rep.analysis is not None else ''}</body></html>")


def _fired(rep: Report) -> str:
    """The diagnosis's causes and alert episodes, as two tables (or a line saying there are none)."""
    dg = rep.diagnosis
    causes = (html_table(["cause", "severity", "onset"], [[c.cause, c.severity, "" if c.onset is None else c.onset]
                                                      for c in dg.causes]) if dg.causes else "<p>No cause.</p>")
    episodes = (html_table(["episode", "severity", "start", "end", "peak step", "peak value", "finding"],
                       [[x.kind, x.severity, x.start, "ongoing" if x.end is None else x.end, x.peak_step,
                         fmt_num(x.peak_value), x.message] for x in dg.episodes])
                if dg.episodes else "<p>No alert episode.</p>")
    return causes + episodes


def _mismatch(rep: Report, include_plotlyjs: bool) -> str:
    """The dashboard's Mismatch page, as HTML: engine parity, and drift against mismatch."""
    return (RM.section_html(rep.analysis, rep.analysis.manifest, include_plotlyjs, rep.diagnosis)
            if rep.analysis is not None else "")


def _turns(rep: Report) -> str:
    """The per-turn figures of a multi-turn run."""
    return RT.section_html(rep.analysis) if rep.analysis is not None else ""


def _routing(rep: Report) -> str:
    """MoE routing, when the run recorded routes."""
    return RR.section_html(rep.analysis) if rep.analysis is not None else ""


def write_html(rep: Report, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_html(rep), encoding="utf-8")
    return path
