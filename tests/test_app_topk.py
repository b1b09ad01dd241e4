"""The Tokens page's top-k section under AppTest: a run with both sides' top-k lists shows the
metrics, the token picker and the engine-vs-trainer bar chart; a run without the columns shows none."""

from __future__ import annotations

import os

from streamlit.testing.v1 import AppTest
from test_app_mismatch import MAIN
from test_topk import record_run


def _tokens_page(monkeypatch, run) -> AppTest:
    monkeypatch.setenv("KLDIAG_RUNS", os.fspath(run))
    at = AppTest.from_file(str(MAIN), default_timeout=120).run()
    at = at.switch_page("app_pages/tokens.py").run()
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]
    return at


def test_tokens_page_draws_both_distributions(monkeypatch, tmp_path):
    record_run(tmp_path / "with", topk=True)
    at = _tokens_page(monkeypatch, tmp_path / "with")
    assert "Top-k distributions: engine vs trainer" in [s.value for s in at.subheader]
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Tokens with both lists"] == "56"  # 4 steps x (15 tokens - 1 out of the loss)
    spec = at.get("plotly_chart")[-1].proto.spec
    assert "engine (mu)" in spec and "trainer (pi)" in spec
    first = at.selectbox(key="topk_pick").value
    at.selectbox(key="topk_pick").set_value(at.selectbox(key="topk_pick").options[1]).run()
    assert not at.exception and at.get("plotly_chart")[-1].proto.spec != spec and first.startswith("step ")
    at.selectbox(key="topk_pick").set_value("another token ...").run()
    at.number_input(key="topk_pos").set_value(99).run()  # no such position: said, not drawn
    assert any("No top-k list" in i.value for i in at.info)


def test_tokens_page_without_topk_columns(monkeypatch, tmp_path):
    record_run(tmp_path / "without", topk=False)
    at = _tokens_page(monkeypatch, tmp_path / "without")
    assert "Top-k distributions: engine vs trainer" not in [s.value for s in at.subheader]
