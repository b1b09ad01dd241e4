"""The dashboard's Overview leads with the verdict and the causes of kldiag.diagnosis."""

from __future__ import annotations

from pathlib import Path

from streamlit.testing.v1 import AppTest

from kldiag.diagnosis import diagnose
from kldiag.views.diagnosis import cause_onsets, md

MAIN = Path(__file__).resolve().parent.parent / "app" / "main.py"


def _overview(monkeypatch, run: Path) -> AppTest:
    monkeypatch.setenv("KLDIAG_RUNS", str(run))
    at = AppTest.from_file(str(MAIN), default_timeout=60).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def test_overview_leads_with_verdict_causes_and_fix(monkeypatch, app_runs):
    import kldiag

    at = _overview(monkeypatch, app_runs["k3"])
    texts = [m.value for m in at.markdown]
    first = next(i for i, t in enumerate(texts) if "Verdict:" in t)
    assert "UNSTABLE" in texts[first] and "`k3_weight_blowup` from step 8" in texts[first]
    assert any(t.startswith("**Fix:**") and "rho" in t for t in texts)
    assert at.expander[0].label.startswith("k3_weight_blowup (critical · onset step 8)")
    dg = diagnose(kldiag.analyze(app_runs["k3"]))
    assert cause_onsets(dg)[0] == (8, "k3_weight_blowup")
    charts = [c.proto.spec.replace(" ", "") for c in at.get("plotly_chart")]
    assert all('"k3_weight_blowup"' in c for c in charts[:2])  # the onset is marked, labelled by its cause


def test_overview_of_a_healthy_run(monkeypatch, app_runs):
    at = _overview(monkeypatch, app_runs["k3_is"])
    verdict = next(m.value for m in at.markdown if "Verdict:" in m.value)
    assert "HEALTHY" in verdict and not at.error


def test_markdown_escaping_keeps_code_spans():
    assert md("rho * k3 for pi_theta `use_bias_correction_kl=True`") == (
        "rho \\* k3 for pi\\_theta `use_bias_correction_kl=True`")
