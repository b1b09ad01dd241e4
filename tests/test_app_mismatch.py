"""The Mismatch page under AppTest: on the demo run (engine at temperature 1.2) it reports the implied
temperature, draws the decomposition and the probability-bucket chart, the what-if sliders change
the figures, and the crosswalk table follows the framework picked; a run without sampler log-probs
gets a message instead of charts it cannot draw."""

from __future__ import annotations

import os
from pathlib import Path

from streamlit.testing.v1 import AppTest

MAIN = Path(__file__).resolve().parent.parent / "app" / "main.py"
ROOT = Path(__file__).resolve().parent.parent


def _page(monkeypatch, run: str, opened: bool = True) -> AppTest:
    """The Mismatch page of `run`, its what-if and crosswalk expanders opened (as a user's click does) unless
    not `opened`."""
    monkeypatch.setenv("KLDIAG_RUNS", os.pathsep.join([str(ROOT / run)]))
    at = AppTest.from_file(str(MAIN), default_timeout=120).run()
    at = at.switch_page("app_pages/mismatch.py").run()
    if opened:
        at = open_sections(at)
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]
    return at


def open_sections(at: AppTest) -> AppTest:
    """Open the page's what-if and crosswalk expanders (their bodies run only once opened) and rerun."""
    at.session_state[WHATIF_KEY] = True
    at.session_state[CROSSWALK_KEY] = True
    return at.run()


WHATIF_KEY, CROSSWALK_KEY = "mm_whatif", "mm_crosswalk"


def _metrics(at: AppTest) -> dict[str, str]:
    return {m.label: m.value for m in at.metric}


def test_demo_run_parity_charts_and_sliders(monkeypatch):
    at = _page(monkeypatch, "sample_logs/demo_k3")
    m = _metrics(at)
    assert abs(float(m["Implied engine temperature"]) - 1.2) < 1e-3
    assert any("engine_temperature_mismatch" in w.value for w in at.warning)
    titles = [c.proto.spec for c in at.get("plotly_chart")]
    assert any("sampler's probability" in t for t in titles) and len(titles) >= 5
    base = _metrics(at)["Tokens masked or clipped"]
    at.slider(key="wi_cap").set_value(1.2).run()
    tighter = _metrics(at)["Tokens masked or clipped"]
    assert float(tighter.rstrip("%")) > float(base.rstrip("%"))
    at.selectbox(key="wi_method").set_value("opsm").run()
    assert _metrics(at)["PG mass removed, A > 0"] == "0.0%"  # OPSM only drops negative-advantage sequences
    at.radio(key="wi_conv").set_value("trainer").run()
    assert not at.exception
    table = at.dataframe[0].value
    assert "rollout_corr/k3_kl" in table.columns and len(table) == 200  # verl: the demo is no framework
    at.selectbox(key="cw_fw").set_value("nemo-rl").run()
    assert list(at.dataframe[0].value.columns)[:2] == ["step", "token_mult_prob_error"]


def test_run_without_sampler_says_so(monkeypatch):
    at = _page(monkeypatch, "sample_logs/trl_grpo_tiny")
    assert any("no sampler log-probs" in i.value for i in at.info)
    assert at.radio(key="wi_conv").value == "trainer"
    assert list(at.dataframe[0].value.columns)[:2] == ["step", "kl"]  # the run's own framework: TRL
    assert any("is null" in c.value for c in at.caption)


def test_the_2026_corrections_on_the_page(monkeypatch):
    """DPPO, M2PO, sequence log-prob-error and any-token rejection are on the what-if, each with its denominator."""
    at = _page(monkeypatch, "sample_logs/demo_k3")
    at.selectbox(key="wi_method").set_value("dppo_tv").run()
    base = float(_metrics(at)["Tokens masked or clipped"].rstrip("%"))
    at.slider(key="wi_tv").set_value(0.05).run()
    assert float(_metrics(at)["Tokens masked or clipped"].rstrip("%")) > base
    assert any("Loss denominator after rejection: **all**" in c.value for c in at.caption)
    at.selectbox(key="wi_method").set_value("seq_error").run()
    assert any("**kept**" in c.value and "NeMo-RL" in c.value for c in at.caption)
    for method in ("dppo_kl", "m2po", "any_token"):
        at.selectbox(key="wi_method").set_value(method).run()
        assert not at.exception, method


def test_what_if_and_crosswalk_run_only_once_opened(monkeypatch):
    """The first render shows the two sections' expanders closed, with no figure of theirs (nothing computed: no
    0% or empty table in their place); opened, each shows its figures."""
    at = _page(monkeypatch, "sample_logs/demo_k3", opened=False)
    labels = [e.label for e in at.expander]
    assert any(lab.startswith("What if") for lab in labels) and any("crosswalk" in lab for lab in labels)
    assert "Tokens masked or clipped" not in _metrics(at) and not at.dataframe
    assert "Implied engine temperature" in _metrics(at)  # the parity section above them is drawn
    at.session_state[WHATIF_KEY] = True
    at.run()
    assert "Tokens masked or clipped" in _metrics(at) and not at.dataframe
    at.session_state[CROSSWALK_KEY] = True
    at.run()
    assert "rollout_corr/k3_kl" in at.dataframe[0].value.columns
