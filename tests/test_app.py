"""The Streamlit app under AppTest: every page runs, its widgets change what it shows, bad
input gives a message instead of a traceback, and a part published while the app runs
shows up after a refresh."""

from __future__ import annotations

import gc
import os
import shutil
import sys
import weakref
from pathlib import Path

import pytest
from conftest import APP_EVIL_PIECE
from streamlit.testing.v1 import AppTest

from kldiag.tools.synth import SynthConfig, make_run
from kldiag.views import pages as V

MAIN = Path(__file__).resolve().parent.parent / "app" / "main.py"
PAGES = ["overview", "distributions", "tokens", "sequence", "estimators", "compare"]


def _app(monkeypatch, *runs: Path) -> AppTest:
    monkeypatch.setenv("KLDIAG_RUNS", os.pathsep.join(str(r) for r in runs))
    return AppTest.from_file(str(MAIN), default_timeout=60).run()


def _page(at: AppTest, name: str) -> AppTest:
    return at.switch_page(f"app_pages/{name}.py").run()


def _ok(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]


def _metric(at: AppTest, label: str) -> str:
    return next(m.value for m in at.metric if m.label == label)


@pytest.mark.parametrize("name", PAGES)
def test_every_page_runs_and_draws(monkeypatch, app_runs, name):
    at = _page(_app(monkeypatch, app_runs["k3"], app_runs["k3_is"]), name)
    _ok(at)
    assert at.title[0].value
    if name == "tokens":
        assert len(at.dataframe[0].value) > 0
    else:
        assert len(at.get("plotly_chart")) >= 1


def test_overview_headline_and_onset(monkeypatch, app_runs):
    at = _app(monkeypatch, app_runs["k3"])
    _ok(at)
    assert _metric(at, "Steps") == "12"
    assert float(_metric(at, "Max |k3 weight|")) > 1000 > float(_metric(at, "Max |k3_is weight|"))
    # The blow-up from |weight| ~ 0.1 to 1e4 at step 8 is an alert; its onset is marked on the charts.
    assert len(at.dataframe[0].value) >= 1 and 8 in set(at.dataframe[0].value["step"])
    charts = [c.proto.spec.replace(" ", "") for c in at.get("plotly_chart")]
    assert all('"dash":"dash"' in c for c in charts)


def test_token_filters_change_the_table(monkeypatch, app_runs):
    at = _page(_app(monkeypatch, app_runs["k3"]), "tokens")
    all_rows = at.dataframe[0].value
    lo, hi = int(all_rows["step"].min()), int(all_rows["step"].max())
    assert hi > lo
    at.slider(key="tok_steps").set_value((hi, hi)).run()
    some = at.dataframe[0].value
    assert 0 < len(some) < len(all_rows) and set(some["step"]) == {hi}
    at.slider(key="tok_steps").set_value((lo, hi)).run()
    at.number_input(key="tok_threshold").set_value(float(all_rows["weight_k3_abs"].median())).run()
    assert len(at.dataframe[0].value) < len(all_rows)
    at.number_input(key="tok_threshold").set_value(0.0).run()
    at.selectbox(key="tok_sort").set_value("step").run()
    at.toggle(key="tok_desc").set_value(False).run()
    assert at.dataframe[0].value["step"].is_monotonic_increasing


def test_selecting_a_token_opens_its_sequence(monkeypatch, app_runs):
    at = _page(_app(monkeypatch, app_runs["k3"]), "tokens")
    first = at.dataframe[0].value.iloc[0]
    at.session_state["tok_table"] = {"selection": {"rows": [0], "columns": [], "cells": []}}
    at.run()
    _ok(at)
    assert at.title[0].value == "Sequence"
    assert at.selectbox(key="seq_step").value == int(first["step"])
    assert at.selectbox(key="seq_seq").value == int(first["seq"])


def test_sequence_text_is_escaped_and_colour_follows_the_quantity(monkeypatch, app_runs):
    at = _page(_app(monkeypatch, app_runs["k3"]), "sequence")
    _ok(at)
    body = at.get("html")[0].proto.body
    assert "&lt;img src=x onerror=alert(1)&gt;" in body
    assert APP_EVIL_PIECE not in body and "<img" not in body
    at.radio(key="seq_quantity").set_value("rho").run()
    assert at.get("html")[0].proto.body != body


def test_estimators_delta_slider_changes_masked_fraction(monkeypatch, app_runs):
    at = _page(_app(monkeypatch, app_runs["k3"]), "estimators")
    _ok(at)
    label = next(m.label for m in at.metric if m.label.startswith("Sequences masked"))
    at.select_slider(key="opsm_delta").set_value(0.0).run()
    low = float(_metric(at, "Sequences masked at delta = 0").rstrip("%"))
    at.select_slider(key="opsm_delta").set_value(1.0).run()
    high = float(_metric(at, "Sequences masked at delta = 1").rstrip("%"))
    assert label and low > high == 0.0


def test_distributions_and_compare_selectors(monkeypatch, app_runs):
    at = _page(_app(monkeypatch, app_runs["k3"], app_runs["k3_is"]), "distributions")
    before = at.get("plotly_chart")[0].proto.spec
    at.segmented_control(key="dist_metric").set_value("rho").run()
    _ok(at)
    assert at.get("plotly_chart")[0].proto.spec != before and "rho" in at.get("plotly_chart")[0].proto.spec
    at = _page(at, "compare")
    assert at.multiselect(key="cmp_runs").value == ["k3", "k3_is"]
    at.selectbox(key="cmp_metric").set_value("weight_k3_abs_max").run()
    _ok(at)
    spec = at.get("plotly_chart")[0].proto.spec
    assert "max |k3 weight| (weight_k3_abs_max) per step" in spec and '"k3_is"' in spec  # in words, with the column


@pytest.mark.parametrize("name", PAGES)
def test_bad_runs_give_messages_not_tracebacks(monkeypatch, app_runs, name):
    at = _page(_app(monkeypatch, app_runs["notarun"]), name)
    assert not at.exception
    assert any("not a kldiag run" in e.value for e in at.error)
    at = _page(_app(monkeypatch, app_runs["empty"]), name)
    assert not at.exception and not at.error
    assert any("no tokens yet" in i.value for i in at.info)


@pytest.mark.parametrize("name", PAGES)
def test_run_without_reference_says_so(monkeypatch, app_runs, name):
    at = _page(_app(monkeypatch, app_runs["noref"]), name)
    assert not at.exception, [e.value for e in at.exception]
    if name != "compare":
        assert any("no reference log-probs" in i.value for i in at.info)


def test_live_refresh_shows_a_new_part(monkeypatch, app_runs, tmp_path):
    run = tmp_path / "live"
    shutil.copytree(app_runs["k3"], run, ignore=shutil.ignore_patterns(".kldiag"))
    at = _app(monkeypatch, run)
    at.toggle(key="live").set_value(True).run()
    assert _metric(at, "Steps") == "12"
    from kldiag.views import dashboard as VD

    assert str(run) in VD._PREPARING  # Live on: the refresh's pass made ready in the background
    VD._PREPARING[str(run)].join()
    make_run(run, SynthConfig(steps=13, seqs_per_step=16, seq_len=(8, 24), vocab_size=64, seed=1),
             steps=range(12, 13), manifest=False)
    at.run()  # what the live fragment's timer triggers: it sees a new part key and reruns the app
    _ok(at)
    assert _metric(at, "Steps") == "13"


def test_live_readies_the_refresh_of_an_analysed_run_only(monkeypatch, app_runs, tmp_path):
    from kldiag.views import dashboard as VD

    run = tmp_path / "live-first"
    shutil.copytree(app_runs["k3"], run, ignore=shutil.ignore_patterns(".kldiag"))
    monkeypatch.setenv("KLDIAG_RUNS", str(run))
    at = AppTest.from_file(str(MAIN), default_timeout=60)
    at.session_state["live"] = True  # on from the first run: the sidebar comes before the page analyses
    at.run()
    _ok(at)
    assert str(run) not in VD._PREPARING  # no cold analysis beside the page's own
    at.run()
    assert str(run) in VD._PREPARING  # analysed now: its refresh is readied
    VD._PREPARING[str(run)].join()


def test_live_refresh_drops_the_older_analysis(monkeypatch, app_runs, tmp_path):
    """A new part re-keys the run: the app's loaders drop the older analysis (and the Mismatch page's view
    holding it) instead of keeping one per refresh, each with its token sample."""
    run = tmp_path / "live"
    shutil.copytree(app_runs["k3"], run, ignore=shutil.ignore_patterns(".kldiag"))
    at = _page(_app(monkeypatch, run), "mismatch")
    _ok(at)
    D = sys.modules["dash_data"]  # the app's module, as AppTest left it in this process
    old_keys = D._CURRENT[str(run)]
    assert old_keys == D.stamp(V.part_keys(str(run)))  # the loaders' key: one short digest, cheap to hash
    old = weakref.ref(D.analysis_of(str(run), old_keys))
    make_run(run, SynthConfig(steps=13, seqs_per_step=16, seq_len=(8, 24), vocab_size=64, seed=1),
             steps=range(12, 13), manifest=False)
    _ok(_page(at, "overview"))
    assert D._CURRENT[str(run)] != old_keys
    gc.collect()
    assert old() is None


# ---- the `kldiag dashboard` launcher -----------------------------------------------------


def test_dashboard_cli_rejects_a_bad_path_before_launching(capsys, app_runs):
    from kldiag.cli import main

    assert main(["dashboard", str(app_runs["k3"]), str(app_runs["notarun"])]) == 2
    err = capsys.readouterr().err
    assert "not a kldiag run" in err and "notarun" in err


def test_dashboard_command_binds_localhost_headless_with_runs_after_dashdash(app_runs):
    from kldiag.cli import build_parser
    from kldiag.cli.dashboard import app_path, streamlit_command

    args = build_parser().parse_args(["dashboard", str(app_runs["k3"]), "--port", "8999"])
    assert (args.host, args.port) == ("127.0.0.1", 8999)
    cmd = streamlit_command([app_runs["k3"], app_runs["k3_is"]], args.port, args.host)
    assert cmd[1:4] == ["-m", "streamlit", "run"] and cmd[4] == str(app_path()) == str(MAIN)
    opts = dict(zip(cmd[5:cmd.index("--"):2], cmd[6:cmd.index("--"):2], strict=True))
    assert opts == {"--server.address": "127.0.0.1", "--server.port": "8999", "--server.headless": "true",
                    "--browser.gatherUsageStats": "false", "--client.toolbarMode": "viewer"}
    assert cmd[cmd.index("--") + 1:] == [str(app_runs["k3"]), str(app_runs["k3_is"])]
