"""The Mismatch page's MoE routing section under AppTest: a run with recorded routes (kldiag/tools/routing_runs.py)
shows the agreement-by-layer heatmap, the mismatch by side and the table; a run without routes shows none."""

from __future__ import annotations

from pathlib import Path

from streamlit.testing.v1 import AppTest

from kldiag.tools.routing_runs import batches as _data
from kldiag.tools.routing_runs import write as _write

MAIN = Path(__file__).resolve().parent.parent / "app" / "main.py"
TITLE = "MoE routing: engine vs trainer experts"


def _page(monkeypatch, run: Path) -> AppTest:
    monkeypatch.setenv("KLDIAG_RUNS", str(run))
    at = AppTest.from_file(str(MAIN), default_timeout=120).run()
    at = at.switch_page("app_pages/mismatch.py").run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def test_mismatch_page_shows_routing(monkeypatch, tmp_path):
    at = _page(monkeypatch, _write(tmp_path / "run", _data(gap=1.5)))
    assert TITLE in [s.value for s in at.subheader]
    specs = [c.proto.spec for c in at.get("plotly_chart")]
    assert any("by layer and step" in s for s in specs) and any("routed alike vs differently" in s for s in specs)
    assert all('"subtitle"' in s for s in specs if "by layer and step" in s)  # the shared layout
    assert any("routed differently carry" in c.value for c in at.markdown)
    heads = [s.value for s in at.subheader]
    assert heads.index(TITLE) < heads.index("Engine vs trainer parity")  # an MoE run leads with its routing
    table = next(d.value for d in at.dataframe if "tokens" in d.value.columns and "count" in d.value.columns)
    assert list(table["tokens"]) == ["routed alike", "routed differently"]


def test_run_without_routes_has_no_routing_section(monkeypatch, tmp_path):
    data = [{k: v for k, v in d.items() if not k.startswith("experts")} for d in _data()]
    at = _page(monkeypatch, _write(tmp_path / "run", data))
    assert TITLE not in [s.value for s in at.subheader]


def test_trainer_routes_only_say_what_is_missing(monkeypatch, tmp_path):
    """Only the trainer's routes: no agreement chart, no 100%; an info naming the engine side and experts_sampler."""
    data = [{k: v for k, v in d.items() if k != "experts_sampler"} for d in _data()]
    at = _page(monkeypatch, _write(tmp_path / "run", data))
    assert TITLE in [s.value for s in at.subheader]
    info = " ".join(i.value for i in at.info)
    assert "experts_sampler" in info and "not measured" in info
    specs = [c.proto.spec for c in at.get("plotly_chart")]
    assert not any("by layer and step" in s for s in specs)
    assert not any("100.00%" in m.value for m in at.markdown)
