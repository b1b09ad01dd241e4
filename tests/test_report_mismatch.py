"""`kldiag report` carries the Mismatch page's sections: parity with the implied temperature, drift vs
mismatch and the probability-bucket chart, what-if at default thresholds, the run's framework crosswalk."""

from __future__ import annotations

import re

import kldiag
from kldiag.report.build import build_report
from kldiag.report.render import format_text, render_html


def test_demo_report_has_the_mismatch_sections():
    rep = build_report(kldiag.analyze("sample_logs/demo_k3"))
    text = format_text(rep)
    assert "Implied engine temperature: 1.2" in text and "engine_temperature_mismatch" in text
    page = render_html(rep)
    for h in ("Mismatch: engine against trainer", "What if: corrections at their default thresholds",
              "Crosswalk: verl's own metrics from these tokens"):
        assert f"<h2>{h}</h2>" in page, h
    assert "the low-probability-token pitfall" in page
    assert page.count("window.PlotlyConfig") == 1  # plotly.js embedded once
    rows = re.findall(r"<tr><td>(tis_token|opsm)</td><td>(pi_old|mu)</td>", page)
    assert len(rows) == 4
    assert "<td>rollout_corr/k3_kl</td>" in page


def test_report_without_sampler_says_so():
    rep = build_report(kldiag.analyze("sample_logs/trl_grpo_tiny"))
    assert "no sampler log-probs (logp_sampler) recorded" in format_text(rep)
    page = render_html(rep)
    assert "Crosswalk: trl's own metrics" in page and "<td>kl</td>" in page


def test_holding_makes_the_view_tokens_once(monkeypatch):
    import gc

    from kldiag.mismatch import sample as SS
    from kldiag.views import mismatch as VM
    analysis = kldiag.analyze("sample_logs/demo_k3")
    view = VM.view_of(analysis)
    SS.sample_of(analysis)._thin.clear()  # a small run's fit set is its whole set, kept: a large run's is not
    made = []
    real = SS.from_columns
    monkeypatch.setattr(SS, "from_columns", lambda *a, **k: made.append(1) or real(*a, **k))
    gc.collect()
    with VM.holding(view):  # the report's dozen what-if replays: the set is made once
        for _ in range(3):
            assert len(view.tokens) and gc.collect() >= 0
    assert len(made) == 1
    view.tokens  # released on leaving: weakly kept only, so made again
    assert len(made) == 2 and "_held" not in view.__dict__


def test_report_says_what_part_of_a_large_run_the_mismatch_section_reads(monkeypatch):
    """A capped token sample (every k-th step, a share of each step's prompt groups) is named under the
    section's heading, as the dashboard's caption names it."""
    import dataclasses

    from kldiag.report import mismatch as RM
    from kldiag.views import mismatch as VM
    analysis = kldiag.analyze("sample_logs/demo_k3")
    view = VM.view_of(analysis)
    assert "A large run" not in RM.section_html(analysis, analysis.manifest)  # the whole run: nothing said
    capped = dataclasses.replace(view, step_stride=4, group_share=0.5)
    capped.analysis = view.analysis
    monkeypatch.setattr(VM, "view_of", lambda a: capped)
    page = RM.section_html(analysis, analysis.manifest)
    assert "<p>A large run: these figures read every 4th step and 50% of each step&#x27;s prompt groups" in page
