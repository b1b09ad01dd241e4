"""The dashboard's turn views under AppTest on a tiny-model multi-turn run with re-tokenised boundaries
(kldiag/tools/agentic_runs.py): the Sequence page shows turn boundaries and greys tool spans; the
Mismatch page draws the per-turn charts and table. A single-turn run shows neither."""

from __future__ import annotations

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from kldiag.tools.agentic_runs import AgenticRun, make_run

MAIN = Path(__file__).resolve().parent.parent / "app" / "main.py"
pytestmark = pytest.mark.filterwarnings("ignore:kldiag.*placeholder")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("agentic")
    return {"multi": make_run(root / "multi", AgenticRun(steps=6, retokenize=True)),
            "single": make_run(root / "single", AgenticRun(steps=6, turns=1))}


def _page(monkeypatch, run: Path, page: str) -> AppTest:
    monkeypatch.setenv("KLDIAG_RUNS", str(run))
    at = AppTest.from_file(str(MAIN), default_timeout=120).run()
    at = at.switch_page(f"app_pages/{page}.py").run()
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]
    return at


def test_sequence_page_shows_turns(monkeypatch, runs):
    at = _page(monkeypatch, runs["multi"], "sequence")
    body = at.get("html")[0].proto.body
    assert [f'data-turn="{t}"' in body for t in (-1, 0, 1, 2)] == [True] * 4
    assert "not trained (tool reply / prompt)" in body
    assert any("3 turns" in c.value for c in at.caption)


def test_mismatch_page_charts_turns(monkeypatch, runs):
    at = _page(monkeypatch, runs["multi"], "mismatch")
    assert "Engine mismatch by turn" in [s.value for s in at.subheader]
    specs = [c.proto.spec for c in at.get("plotly_chart")]
    assert any("by turn" in s for s in specs) and any("first token" in s for s in specs)
    table = next(d.value for d in at.dataframe if "turn" in d.value.columns)
    assert list(table["turn"]) == ["0", "1", "2"]


def test_single_turn_run_has_no_turn_sections(monkeypatch, runs):
    at = _page(monkeypatch, runs["single"], "mismatch")
    assert "Engine mismatch by turn" not in [s.value for s in at.subheader]
    seq = _page(monkeypatch, runs["single"], "sequence")
    assert "data-turn" not in seq.get("html")[0].proto.body
