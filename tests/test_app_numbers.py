"""One number per quantity on the dashboard, under AppTest: on a run with NaN log-probs the
Overview, Tokens and Estimators pages show the same flagged count; non-finite rows come first and
the Sequence page opens on a faulty sequence; a deep link to a run, step or sequence that does
not exist says so and where it went instead."""

from __future__ import annotations

import re

import pytest
from test_app_dash import _app, _ok

import kldiag
from kldiag.tools.synth import SynthConfig, make_run
from kldiag.views import numbers as VN


@pytest.fixture(scope="module")
def nan_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("nan") / "nan"
    make_run(run, SynthConfig(steps=6, seqs_per_step=16, seq_len=(8, 24), vocab_size=0, blowup_step=3,
                              blowup_frac=0.02, nonfinite=tuple((s, "logp") for s in range(6)), seed=1))
    return run


def _flagged(text: str) -> int:
    return int(re.search(r"([\d,]+) flagged tokens", text).group(1).replace(",", ""))


def test_flagged_is_one_number_on_every_page(monkeypatch, nan_run):
    a = kldiag.analyze(nan_run)
    total, tokens = VN.flagged_total(a.steps.to_pandas())
    assert total > 0 and tokens > 0
    share = f"{total / tokens:.3%}"

    at = _app(monkeypatch, nan_run)
    _ok(at)
    assert next(m for m in at.metric if m.label == "Flagged tokens").value == share
    assert any(f"{total:,} tokens" in c.value for c in at.caption)

    at = _app(monkeypatch, nan_run, page="tokens")
    _ok(at)
    caption = next(c.value for c in at.caption if "The table holds" in c.value)
    assert _flagged(caption) == total and share in caption and "non-finite" in caption
    table = at.dataframe[0].value
    n_bad = int(a.flags.to_pandas()["nonfinite"].sum())
    assert n_bad > 0 and table["nonfinite"].iloc[:n_bad].all()  # sorted by |k3 weight|: NaN rows first

    at = _app(monkeypatch, nan_run, page="estimators")
    _ok(at)
    assert next(m for m in at.metric if m.label == "Flagged").value == share


def test_sequence_page_opens_on_a_faulty_sequence(monkeypatch, nan_run):
    seqs = kldiag.analyze(nan_run).sequences.to_pandas()
    at = _app(monkeypatch, nan_run, page="sequence")
    _ok(at)
    step, seq = at.selectbox(key="seq_step").value, at.selectbox(key="seq_seq").value
    row = seqs[(seqs["step"] == step) & (seqs["seq"] == seq)].iloc[0]
    assert row["nonfinite_count"] > 0


def test_deep_links_to_what_does_not_exist_say_where_they_went(monkeypatch, nan_run):
    at = _app(monkeypatch, nan_run, query={"run": "nosuch"})
    _ok(at)
    assert any("`nosuch`" in w.value and "showing `nan`" in w.value for w in at.warning)
    at = _app(monkeypatch, nan_run, query={"run": "nan", "step": "9999", "seq": "3"}, page="sequence")
    _ok(at)
    notice = next(w.value for w in at.warning if "9999" in w.value)
    step, seq = at.selectbox(key="seq_step").value, at.selectbox(key="seq_seq").value
    assert "the run has no step 9999" in notice and f"{seq} at step {step}" in notice
    at = _app(monkeypatch, nan_run, query={"run": "nan", "step": "2", "seq": "123456"}, page="sequence")
    _ok(at)
    assert any("step 2 has no sequence 123456" in w.value for w in at.warning)
