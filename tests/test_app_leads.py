"""Every page leads with what the run measured (AppTest): an MoE run without logp_ref or advantages, whose replay
broke (kldiag/tools/routing_runs.py, routing_replay R3), shows no nan tile, no green all-clear, and says on each
page which column a figure needs and how to record it."""

from __future__ import annotations

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest
from test_app_mismatch import open_sections

from kldiag.tools.routing_runs import batches, write

MAIN = Path(__file__).resolve().parent.parent / "app" / "main.py"


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    data = [{k: v for k, v in d.items() if k != "logp_ref"} for d in batches(gap=1.5)]
    return write(tmp_path_factory.mktemp("leads") / "moe", data, config={"routing_replay": "R3", "beta": 0.0})


def _page(monkeypatch, run: Path, page: str | None = None) -> AppTest:
    monkeypatch.setenv("KLDIAG_RUNS", str(run))
    at = AppTest.from_file(str(MAIN), default_timeout=120).run()
    if page:
        at = at.switch_page(f"app_pages/{page}.py").run()
    if page == "mismatch":
        at = open_sections(at)  # the what-if and the crosswalk: run once their expanders are opened
    assert not at.exception, [e.value for e in at.exception]
    assert not at.success, [s.value for s in at.success]  # the verdict is unstable: no green anywhere
    assert not [m for m in at.metric if "nan" in str(m.value).lower()], [(m.label, m.value) for m in at.metric]
    return at


def test_overview(monkeypatch, moe_run):
    at = _page(monkeypatch, moe_run)
    tiles = {m.label: m.value for m in at.metric}
    assert tiles["Flagged tokens"] == "n/a" and "Latest KL(mu||pi_old)" in tiles and "Routed differently" in tiles
    assert any("is not drawn" in c.value and "needs logp_ref" in c.value for c in at.caption)
    alerts = at.dataframe[0].value
    assert "ongoing" in set(alerts["end"]) and list(alerts.columns).index("message") < 5
    recorded = next(d.value for d in at.dataframe if "how to record" in d.value.columns)
    assert "logp_ref=" in " ".join(recorded["how to record"])


def test_tokens_list_what_was_measured(monkeypatch, moe_run):
    at = _page(monkeypatch, moe_run, "tokens")
    assert any("logp_ref, which this run did not record" in i.value for i in at.info)
    heads = [s.value for s in at.subheader]
    assert "Tokens routed to other experts by the engine" in heads and "Tokens with the largest engine mismatch" in heads
    routed = next(d.value for d in at.dataframe if "layers routed differently" in d.value.columns)
    assert len(routed) and (routed["layers routed differently"] > 0).all()


def test_sequence_estimators_mismatch_compare(monkeypatch, moe_run):
    at = _page(monkeypatch, moe_run, "sequence")
    assert at.radio(key="seq_quantity").value == "mismatch"  # not d (it needs pi_ref), not rho (1 everywhere)
    bodies = " ".join(h.proto.body for h in at.get("html"))
    assert "kldiag-scale" in bodies and "kldiag-routed" in bodies  # the colour scale; tokens routed differently
    at = _page(monkeypatch, moe_run, "estimators")
    assert any("needs advantage" in i.value for i in at.info) and not any("masked" in m.label for m in at.metric)
    at = _page(monkeypatch, moe_run, "mismatch")
    heads = [s.value for s in at.subheader]
    assert heads.index("MoE routing: engine vs trainer experts") < heads.index("Engine vs trainer parity")
    assert any("routing_replay_broken" in e.value for e in at.error)
    assert any("needs advantage" in i.value for i in at.info)  # the what-if: no 0% and nan
    at = _page(monkeypatch, moe_run, "compare")
    assert any("no KL term in the loss (beta = 0)" in c.value for c in at.caption)
    assert "mismatch_kl" in at.selectbox(key="cmp_metric").value
