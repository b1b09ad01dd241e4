"""The dashboard features W&B and TensorBoard users expect, under AppTest: one smoothing
control and one step range per page, unified hover, decade log ticks, onset labels in
lanes, downloads on every page, deep links restored on load, the group view and the
Estimators scatter's labelled worst tokens."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import numpy as np
import plotly.graph_objects as go
import plotly.io as pio
import pytest
from conftest import APP_VOCAB_SIZE, app_vocab
from streamlit.testing.v1 import AppTest

import kldiag
from kldiag.format import write_vocab
from kldiag.tools.synth import SynthConfig, make_run

MAIN = Path(__file__).resolve().parent.parent / "app" / "main.py"


def _app(monkeypatch, *runs: Path, query: dict[str, str] | None = None, page: str | None = None) -> AppTest:
    monkeypatch.setenv("KLDIAG_RUNS", os.pathsep.join(str(r) for r in runs))
    at = AppTest.from_file(str(MAIN), default_timeout=60)
    for k, v in (query or {}).items():
        at.query_params[k] = v
    if page:
        at.switch_page(f"app_pages/{page}.py")
    return at.run()


def _ok(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]
    # st.error is also how the Overview's verdict says "unstable": only failures count here
    assert not [e.value for e in at.error if "Verdict" not in e.value]


def _y(trace) -> np.ndarray:
    """A trace's y values (Plotly 6 serialises numpy arrays as base64 typed arrays)."""
    y = trace.y
    if isinstance(y, dict) and "bdata" in y:
        return np.frombuffer(base64.b64decode(y["bdata"]), dtype=np.dtype(y["dtype"]))
    return np.asarray(y, dtype=np.float64)


def _figs(at: AppTest) -> list[go.Figure]:
    return [pio.from_json(c.proto.spec) for c in at.get("plotly_chart")]


@pytest.fixture(scope="module")
def group_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("groups") / "zero_spread"
    make_run(run, SynthConfig(steps=4, seqs_per_step=16, seq_len=(8, 24), vocab_size=APP_VOCAB_SIZE,
                              group_size=4, zero_spread_every=2, seed=5))
    write_vocab(run, app_vocab())
    return run


def test_one_smoothing_control_smooths_every_step_chart(monkeypatch, app_runs):
    at = _app(monkeypatch, app_runs["k3"])
    _ok(at)
    raw = _figs(at)
    assert all(f.layout.hovermode == "x unified" for f in raw)
    assert not any(t.name.endswith("(raw)") for f in raw for t in f.data)
    at.slider(key="ov_smoothing").set_value(0.9).run()
    _ok(at)
    smooth = _figs(at)
    assert len(smooth) == len(raw) == 6
    for before, after in zip(raw, smooth, strict=True):
        faint = [t for t in after.data if t.name.endswith("(raw)")]
        lines = [t for t in after.data if not t.name.endswith("(raw)")]
        assert len(faint) == len(lines) == len(before.data)  # one faint raw line behind each
        assert all(t.opacity < 0.5 for t in faint)
    k3 = next(t for t in smooth[0].data if t.name == "k3 mean")
    k3_raw = next(t for t in smooth[0].data if t.name == "k3 mean (raw)")
    assert _y(k3)[0] == pytest.approx(_y(k3_raw)[0])  # debiased: starts on the first point
    assert _y(k3)[-1] != pytest.approx(_y(k3_raw)[-1])


def test_step_range_zooms_every_chart_and_log_axes_label_decades(monkeypatch, app_runs):
    at = _app(monkeypatch, app_runs["k3"])
    at.slider(key="ov_steps").set_value((4, 10)).run()
    _ok(at)
    figs = _figs(at)
    assert all(tuple(f.layout.xaxis.range) == (4, 10) for f in figs)
    logs = [f for f in figs if f.layout.yaxis.type == "log"]
    assert len(logs) == 3
    # labelled at whole decades (dtick: decades between labels, from a decade), at least two of them
    assert all(f.layout.yaxis.dtick >= 1 and f.layout.yaxis.tick0 == int(f.layout.yaxis.tick0)
               and f.layout.yaxis.exponentformat == "power" for f in logs)
    assert all(f.layout.yaxis.range[1] - f.layout.yaxis.range[0] >= f.layout.yaxis.dtick for f in logs)
    # onset labels: paper-anchored annotations in lanes (one label per onset step)
    notes = [a for f in figs for a in f.layout.annotations if a.yref == "paper"]
    assert notes and any("weight_blowup" in a.text for a in notes)


def test_every_page_offers_csv_and_parquet(monkeypatch, app_runs):
    for page in ("overview", "distributions", "tokens", "sequence", "estimators"):
        at = _app(monkeypatch, app_runs["k3"], app_runs["k3_is"], page=page)
        _ok(at)
        labels = [b.proto.label for b in at.get("download_button")]
        assert labels.count("CSV") >= 1 and labels.count("PARQUET") >= 1, page


def test_deep_link_opens_the_token(monkeypatch, app_runs):
    flag = kldiag.analyze(app_runs["k3"]).flags.to_pylist()[0]
    query = {"run": "k3", "step": str(flag["step"]), "seq": str(flag["seq"]), "pos": str(flag["pos"])}
    at = _app(monkeypatch, app_runs["k3_is"], app_runs["k3"], query=query, page="sequence")
    _ok(at)
    assert at.session_state["run_label"] == "k3"
    assert at.selectbox(key="seq_step").value == flag["step"]
    assert at.selectbox(key="seq_seq").value == flag["seq"]
    focus = [h.proto.body for h in at.get("html") if "kldiag-focus" in h.proto.body]
    assert len(focus) == 1 and f"pos: {flag['pos']}" in focus[0].split("kldiag-focus")[1].split("</span>")[0]
    link = at.code[0].value
    assert f"step={flag['step']}" in link and f"seq={flag['seq']}" in link and f"pos={flag['pos']}" in link


def test_tokens_page_link_restores_its_filters(monkeypatch, app_runs):
    at = _app(monkeypatch, app_runs["k3"], query={"steps": "9-10", "flags": "weight_blowup"}, page="tokens")
    _ok(at)
    assert at.slider(key="tok_steps").value == (9, 10)
    assert at.multiselect(key="tok_flags").value == ["weight_blowup"]
    assert "steps=9-10" in at.code[0].value and "flags=weight_blowup" in at.code[0].value
    assert set(at.dataframe[0].value["step"]) <= {9, 10}


def test_group_view_shows_siblings_and_marks_zero_spread(monkeypatch, group_run):
    seqs = kldiag.analyze(group_run).sequences.to_pandas()
    zero = seqs[(seqs["step"] == 1) & (seqs["group"] % 2 == 0)].iloc[0]
    at = _app(monkeypatch, group_run, query={"step": "1", "seq": str(int(zero["seq"]))}, page="sequence")
    _ok(at)
    assert any(f"Group {int(zero['group'])}: 4 completions" in s.value for s in at.subheader)
    assert any("Zero advantage spread" in w.value for w in at.warning)
    siblings = [h for h in at.get("html") if "kldiag-sibling" in h.proto.body]
    assert len(siblings) == 4
    table = next(d.value for d in at.dataframe if "zero_spread" in d.value.columns)
    assert table["zero_spread"].all() and table["self"].iloc[0] and len(table) == 4
    other = seqs[(seqs["step"] == 1) & (seqs["group"] % 2 == 1)].iloc[0]
    at = _app(monkeypatch, group_run, query={"step": "1", "seq": str(int(other["seq"]))}, page="sequence")
    _ok(at)
    assert not any("Zero advantage spread" in w.value for w in at.warning)


def test_estimators_scatter_labels_flagged_and_top_tokens(monkeypatch, app_runs):
    at = _app(monkeypatch, app_runs["k3"], page="estimators")
    _ok(at)
    scatter = next(f for f in _figs(at) if "|gradient weight| against d" in f.layout.title.text)
    names = {t.name for t in scatter.data}
    assert any("flagged" in n for n in names) and any("sampled" in n for n in names)
    worst = max(np.nanmax(_y(t)) for t in scatter.data if t.name.startswith("k3,"))
    flags = kldiag.analyze(app_runs["k3"]).flags.to_pandas()
    assert worst == pytest.approx(flags["weight_k3"].abs().max(), rel=1e-6)


def test_distributions_and_compare_share_the_controls(monkeypatch, app_runs):
    at = _app(monkeypatch, app_runs["k3"], page="distributions")
    median = next(t for t in _figs(at)[1].data if t.name == "median")
    at.slider(key="dist_smoothing").set_value(0.9)
    at.slider(key="dist_steps").set_value((2, 9)).run()
    _ok(at)
    heat, bands = _figs(at)
    assert tuple(heat.layout.xaxis.range) == tuple(bands.layout.xaxis.range) == (2, 9)
    smooth = next(t for t in bands.data if t.name == "median")
    assert _y(smooth)[0] == pytest.approx(_y(median)[0]) and not np.allclose(_y(smooth), _y(median))
    at = _app(monkeypatch, app_runs["k3"], app_runs["k3_is"], page="compare")
    at.slider(key="cmp_smoothing").set_value(0.5).run()
    _ok(at)
    fig = _figs(at)[0]
    names = {t.name for t in fig.data}
    assert {"k3", "k3 (raw)", "k3_is", "k3_is (raw)"} <= names
    # by default each run shows its own loss weight, named in the hover, and the page gives each run's verdict
    hovers = {t.name: t.hovertemplate for t in fig.data if t.hovertemplate}
    assert "weight_k3_abs_max" in hovers["k3"] and "weight_k3_is_abs_max" in hovers["k3_is"]
    verdicts = [m.value for m in at.markdown if m.value.startswith("**k3")]  # in the Overview's colours
    assert len(verdicts) == 2 and all(":" in v and "[**" in v for v in verdicts)
