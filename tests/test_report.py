"""The post-mortem report: it judges nothing itself. Its verdict, causes, episodes, recommendations
and `--fail-on` exit code are the Diagnosis's; its step charts are the dashboard Overview's."""

from __future__ import annotations

import ast
import html
import shutil
from pathlib import Path

import numpy as np
import pytest

import kldiag
from kldiag.analysis.rules.episodes import KINDS
from kldiag.cli import main
from kldiag.cli import report as cli_report
from kldiag.diagnosis import CAUSE_NAMES, Cause, Diagnosis, DiagnosisConfig, Episode, diagnose
from kldiag.report import build as R
from kldiag.report import render as report_render
from kldiag.views import charts as VC

SAMPLE_LOGS = Path(__file__).resolve().parent.parent / "sample_logs"
EVIL = "<img src=x onerror=alert(1)>"

REPORT_DIR = Path(R.__file__).resolve().parent
RULE_ENGINE = ("rule_blowup", "rule_nonfinite", "rule_blame", "rule_latent", "rule_mismatch", "evaluate_rules",
               "RULE_NAMES", "FAILING", "NOTES", "verdict", "parse_rules", "exit_code", "recommendations",
               "RuleResult", "first_step")


# ---- no rule engine of its own ----------------------------------------------------------------


def test_the_report_has_no_rule_engine_and_no_thresholds():
    for name in RULE_ENGINE:
        assert not hasattr(R, name) and not hasattr(report_render, name), name
    for path in REPORT_DIR.glob("*.py"):  # no module under kldiag/report defines a rule
        funcs = [n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)]
        assert not [f for f in funcs if f.startswith("rule") or f in RULE_ENGINE], path.name
    fields = set(R.ReportConfig.__dataclass_fields__)
    assert not fields & {"blowup_weight", "blame_share", "mismatch_kl"}  # thresholds: DiagnosisConfig's only
    assert isinstance(R.ReportConfig().diagnosis, DiagnosisConfig)


def _diagnosis() -> Diagnosis:
    causes = [Cause("k3_weight_blowup", 12, "critical", {}, "set use_bias_correction_kl=True", "K3 blows up."),
              Cause("engine_mismatch", 3, "info", {}, "match the engine", "a small mismatch")]
    eps = [Episode("mismatch", 3, 5, 4, 0.02, "warning", "mismatch msg", metric="mismatch_kl"),
           Episode("blowup", 14, None, 20, 900.0, "critical", "blowup msg", metric="weight_k3_abs_max")]
    return Diagnosis("unstable", causes, eps)


def test_what_the_report_takes_from_a_diagnosis():
    dg = _diagnosis()
    assert R.fired(dg) == {"k3_weight_blowup", "engine_mismatch", "mismatch", "blowup"}
    assert R.verdict_onset(dg) == 12  # the critical cause's onset, not the earlier info note's
    assert R.first_moved(dg) == (3, "mismatch_kl", "mismatch msg")
    recs = R.fixes(dg)
    assert recs[0] == "k3_weight_blowup (critical, from step 12): K3 blows up. Fix: set use_bias_correction_kl=True"
    assert "a small mismatch" in recs[1] and "match the engine" in recs[1]
    assert R.verdict_onset(Diagnosis("healthy", [], dg.episodes)) is None
    assert R.fixes(Diagnosis("healthy"))[0].startswith("Nothing to fix")


@pytest.mark.parametrize(("text", "names"), [
    ("blowup", ("blowup", "k3_weight_blowup")),
    ("nonfinite", ("nonfinite", "invalid", "numerical_fault")),
    ("blame", ("blame_share",)),
    ("latent", ("latent",)),
    ("mismatch", ("mismatch", "engine_mismatch", "engine_temperature_mismatch", "engine_raw_logprobs",
                  "engine_wrong_token", "engine_precision", "engine_stale_weights", "engine_async_lag",
                  "engine_retokenization", "engine_truncated_sampling", "engine_wrong_weights",
                  "engine_low_precision")),
    ("numerical_fault, flagged_onset", ("numerical_fault", "flagged_onset")),
    ("blowup,k3_weight_blowup", ("blowup", "k3_weight_blowup")),
])
def test_fail_on_names_map_to_episode_kinds_and_causes(text, names):
    assert cli_report.parse_fail_on(text) == names


def test_fail_on_accepts_every_kind_and_cause():
    for name in (*KINDS, *CAUSE_NAMES):  # a kind that is also an older rule's name stands for more
        assert cli_report.parse_fail_on(name) == cli_report.ALIASES.get(name, (name,)) and name in \
            cli_report.parse_fail_on(name)
    assert set(cli_report.parse_fail_on("all")) == {*KINDS, *CAUSE_NAMES}
    with pytest.raises(ValueError, match="unknown rule.*blowpu.*choose from.*k3_weight_blowup"):
        cli_report.parse_fail_on("blowup,blowpu")
    with pytest.raises(ValueError):
        cli_report.parse_fail_on(" , ")


def test_printable_neutralises_terminal_escapes():
    assert report_render.printable("\x1b[31m um\n") == "\\x1b[31m um\\n"


def test_in_context_keeps_subword_spaces_and_spaces_out_words():
    def offender(before, piece, after):
        return R.Offender(1, 2, 3, piece, before, after, -500.0, 2.0, 6.2)

    mark = lambda p: f"[{p}]"  # noqa: E731
    assert report_render.in_context(offender([" the", " cat"], " um", ["."]), str, mark) == " the cat[ um]."
    assert report_render.in_context(offender(["the", "cat"], "um", []), str, mark) == "the cat [um]"


def test_abs_bound_of_a_histogram():
    edges = np.array([-2.0, -1.0, 0.0, 1.0, 2.0])
    counts = np.zeros((3, 6), dtype=np.int64)
    assert R.abs_bound(edges, counts) == 0.0
    counts[1, 3] = 4  # 0 <= v < 1
    assert R.abs_bound(edges, counts) == 1.0
    counts[2, 0] = 1  # below -2
    assert R.abs_bound(edges, counts) == np.inf


# ---- the report on real runs ----------------------------------------------------------------


def _copy_run(name: str, tmp_path: Path) -> Path:
    """A sample run copied out of the repository, so the analysis cache lands in tmp."""
    src = SAMPLE_LOGS / name
    return Path(shutil.copytree(src, tmp_path / name, ignore=shutil.ignore_patterns(".kldiag")))


@pytest.fixture(scope="module")
def sample_runs(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("samples")
    return {name: _copy_run(name, tmp) for name in ("demo_k3", "demo_k3_is")}


def _same_as_diagnose(rep: R.Report, dg: Diagnosis) -> None:
    assert rep.verdict == dg.verdict
    assert [c.cause for c in rep.diagnosis.causes] == [c.cause for c in dg.causes]
    assert [(e.kind, e.start, e.end) for e in rep.diagnosis.episodes] == [(e.kind, e.start, e.end) for e in dg.episodes]
    assert rep.fired() == {c.cause for c in dg.causes} | {e.kind for e in dg.episodes}
    assert len(rep.recommendations) == max(1, len(dg.causes))
    for rec, c in zip(rep.recommendations, dg.causes, strict=False):
        assert rec.startswith(c.cause) and c.fix in rec and c.summary.rstrip(".") in rec


@pytest.mark.parametrize("name", ["demo_k3", "demo_k3_is"])
def test_the_report_says_what_diagnose_says(sample_runs, name):
    analysis = kldiag.analyze(sample_runs[name])
    dg = diagnose(analysis)
    rep = R.build_report(analysis)
    _same_as_diagnose(rep, dg)
    if name == "demo_k3":
        assert rep.verdict == "unstable" and dg.causes[0].cause == "k3_weight_blowup"
        assert rep.onset_step == dg.causes[0].onset
    else:
        assert rep.verdict != "unstable" and "k3_weight_blowup" not in rep.fired()
    assert R.build_report(analysis, diagnosis=dg).diagnosis is dg  # a caller's diagnosis is not redone


def test_the_report_draws_the_overviews_step_charts(sample_runs):
    rep = R.build_report(kldiag.analyze(sample_runs["demo_k3"]))
    figs = report_render.figures(rep)
    assert [f.layout.title.text for f in figs] == [c.title for c in VC.STEP_TRENDS]
    limit = [t for t in figs[VC.WEIGHT_CHART].data if t.name == "blow-up limit"]
    assert len(limit) == 1 and list(limit[0].y) == [DiagnosisConfig().blowup_weight] * 2
    labels = {a.text for f in figs for a in f.layout.annotations}
    assert any("k3_weight_blowup" in t for t in labels)  # the causes' onsets, as on the dashboard


def _first_blowup_step(run_dir: Path, limit: float) -> int:
    """Independent of the analysis engine: the first step whose K3 weight passes `limit`."""
    from kldiag import estimators as E

    t = kldiag.open_run(run_dir).read(["step", "logp", "logp_ref"]).to_pydict()
    w = np.abs(E.weight_k3(np.asarray(t["logp"]), np.asarray(t["logp_ref"])))
    return int(np.min(np.asarray(t["step"])[w > limit]))


def test_report_on_the_unstable_sample_run_names_the_blowup_and_its_onset(sample_runs, tmp_path, capsys):
    run = sample_runs["demo_k3"]
    out = tmp_path / "k3.html"
    assert main(["report", str(run), "-o", str(out), "--fail-on", "blowup"]) == 1
    text, err = capsys.readouterr()
    dg = diagnose(kldiag.analyze(run))
    onset = dg.causes[0].onset
    assert "verdict: UNSTABLE: k3_weight_blowup" in text and f"onset at step {onset}" in text
    assert "failing on cause k3_weight_blowup (critical" in err and "episode blowup" in err
    # the blow-up episode starts where the K3 weight first passes the limit (computed here without the engine)
    first = _first_blowup_step(run, DiagnosisConfig().blowup_weight)
    assert min(e.start for e in dg.episodes if e.kind == "blowup") == first
    assert f"blowup              steps {first}-" in text and "first to move:" in text
    assert dg.causes[0].fix in " ".join(text.split())
    page = out.read_text()
    assert f"onset at step <b>{onset}</b>" in page and "Verdict: UNSTABLE" in page
    assert html.escape(dg.causes[0].fix) in page and "<h2>What fired</h2>" in page
    assert any(html.escape(p) in page for p in (" um", " like", " basically", " actually"))


@pytest.mark.parametrize(("name", "fail_on", "code"), [
    ("demo_k3", "k3_weight_blowup", 1),
    ("demo_k3", "nonfinite,numerical_fault,entropy_collapse", 0),
    ("demo_k3_is", "blowup,nonfinite", 0),
    ("demo_k3_is", "latent", 1),  # its tokens would blow K3 up: an info episode, still there
    ("demo_k3_is", "mismatch", 1),  # the demo's engine samples at temperature 1.2 on purpose
    ("demo_k3_is", "engine_temperature_mismatch", 1),
    ("demo_k3_is", "k3_weight_blowup,offpolicy_drift", 0),
])
def test_fail_on_exits_1_when_the_diagnosis_has_a_named_finding(sample_runs, tmp_path, capsys, name, fail_on, code):
    assert main(["report", str(sample_runs[name]), "-o", str(tmp_path / "r.html"), "--fail-on", fail_on]) == code
    err = capsys.readouterr().err
    assert ("kldiag report: failing on" in err) == bool(code)


def test_thresholds_go_to_the_diagnosis(sample_runs, tmp_path, capsys):
    run = sample_runs["demo_k3"]
    assert main(["report", str(run), "-o", str(tmp_path / "r.html"), "--blowup-weight", "1e9",
                 "--fail-on", "k3_weight_blowup"]) == 1  # its blame rule still fires, as a warning
    text = capsys.readouterr().out
    dg = diagnose(kldiag.analyze(run), DiagnosisConfig(blowup_weight=1e9))
    assert dg.verdict == "warning" and f"verdict: {dg.verdict.upper()}" in text
    assert "blowup" not in {e.kind for e in dg.episodes} and "] blowup" not in text


def test_html_is_self_contained_and_escapes_untrusted_token_text(tmp_path, capsys):
    from kldiag.tools import demo
    from kldiag.tools import demo_train as T
    pieces = list(T.vocab())
    for i in T.FILLER_IDS:  # the punished tokens: the top offenders
        pieces[T.N_PROMPT + i] = EVIL
    cfg = T.DemoConfig(steps=60, pieces=tuple(pieces))
    run = demo.train_one(cfg, tmp_path).run_dir
    rep = R.build_report(kldiag.analyze(run))
    assert EVIL in {o.piece for o in rep.offenders}
    page = report_render.render_html(rep)
    assert EVIL not in page and "<img" not in page and html.escape(EVIL) in page
    assert page.count("<script") >= 2 and "<script src=" not in page  # plotly.js embedded, nothing fetched
    assert page.count("plotly.js v") == 1  # the bundle, once


def test_fail_on_rejects_unknown_rules(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["report", str(tmp_path), "--fail-on", "explode"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "choose from" in err
    assert all(n in err for n in ("blowup", "latent", "blame_share", "k3_weight_blowup", "engine_temperature_mismatch"))


def test_nonfinite_run_is_unstable(tmp_path):
    from kldiag.tools.synth import SynthConfig, make_run

    make_run(tmp_path / "nan", SynthConfig(steps=6, estimator="k3_is", nonfinite=((3, "logp"),), positive=(4,)))
    analysis = kldiag.analyze(tmp_path / "nan")
    rep = R.build_report(analysis)
    _same_as_diagnose(rep, diagnose(analysis))
    assert rep.verdict == "unstable" and rep.onset_step == 3
    assert cli_report.failing(rep, cli_report.parse_fail_on("nonfinite"))[0].startswith("cause numerical_fault")
    assert cli_report.failing(rep, cli_report.parse_fail_on("blowup")) == []


def test_run_without_reference_is_not_judged_on_kl(tmp_path, capsys):
    from kldiag.tools.synth import SynthConfig, make_run

    make_run(tmp_path / "noref", SynthConfig(steps=4, reference=False, on_policy=True))
    analysis = kldiag.analyze(tmp_path / "noref")
    rep = R.build_report(analysis)
    _same_as_diagnose(rep, diagnose(analysis))
    assert rep.verdict == "healthy" and rep.fired() == set() and rep.onset_step is None
    text = report_render.format_text(rep)
    assert "no reference log-probs" in text and "Nothing to fix" in text
    assert main(["report", str(tmp_path / "noref"), "-o", str(tmp_path / "r.html"), "--fail-on", "all"]) == 0
