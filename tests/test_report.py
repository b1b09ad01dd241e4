"""The post-mortem report: its rules (pure functions), and the report on real runs."""

from __future__ import annotations

import html
from pathlib import Path

import numpy as np
import pytest

import kldiag
from kldiag.report import build as R
from kldiag.report import render as report_render
from kldiag.cli import main

SAMPLE_LOGS = Path(__file__).resolve().parent.parent / "sample_logs"
EVIL = "<img src=x onerror=alert(1)>"

STEPS = np.arange(10, 16)


# ---- rules ---------------------------------------------------------------------------------


def test_rule_blowup_names_the_first_step_and_the_peak():
    r = R.rule_blowup(STEPS, [1.0, 2.0, 150.0, np.nan, 900.0, 3.0], "k3", 100.0)
    assert r.fired and r.step == 12
    assert "900" in r.message and "step 14" in r.message
    calm = R.rule_blowup(STEPS, [1.0, 2.0, 50.0, np.nan, 90.0, 3.0], "k3_is", 100.0)
    assert not calm.fired and calm.step is None and "k3_is" in calm.message


def test_rule_blowup_counts_an_infinite_weight():
    assert R.rule_blowup(STEPS, [1, 1, 1, 1, np.inf, 1], "k3", 100.0).step == 14


def test_rule_nonfinite():
    r = R.rule_nonfinite(STEPS, [0, 0, 0, 2, 0, 1], [0, 1, 0, 0, 0, 0])
    assert r.fired and r.step == 11 and "3 non-finite and 1 positive" in r.message
    assert not R.rule_nonfinite(STEPS, np.zeros(6), np.zeros(6)).fired


def test_rule_blame_only_judges_a_k3_loss():
    share = [0.1, 0.2, 0.7, 0.9, 0.1, 0.0]
    r = R.rule_blame(STEPS, share, "k3", 0.5)
    assert r.fired and r.step == 12 and "2 steps" in r.message
    assert not R.rule_blame(STEPS, share, "k3_is", 0.5).fired


def test_rule_latent_says_whose_weight_it_is():
    assert "not this run's loss" in R.rule_latent(STEPS, [1, 1, 500, 1, 1, 1], "k3_is", 100.0).message
    assert not R.rule_latent(STEPS, np.ones(6), "k3", 100.0).fired


def test_rule_mismatch_needs_to_dominate_the_drift():
    kl = np.full(6, 0.05)  # a typical |log(pi_old/mu)| of sqrt(0.1) = 0.32
    assert R.rule_mismatch(STEPS, kl, np.full(6, 0.1), 0.01).fired
    assert not R.rule_mismatch(STEPS, kl, np.full(6, 0.5), 0.01).fired  # drift is larger
    assert not R.rule_mismatch(STEPS, np.full(6, 0.001), np.zeros(6), 0.01).fired
    unknown = R.rule_mismatch(STEPS, np.full(6, np.nan), np.zeros(6), 0.01)
    assert not unknown.fired and "unknown" in unknown.message


def test_verdict_levels():
    ok = R.RuleResult("blame", False, None, "")
    assert R.verdict([ok]) == "healthy"
    assert R.verdict([ok, R.RuleResult("latent", True, 3, "")]) == "healthy"  # a note, not a problem
    assert R.verdict([ok, R.RuleResult("mismatch", True, 3, "")]) == "warning"
    assert R.verdict([R.RuleResult("mismatch", True, 3, ""), R.RuleResult("nonfinite", True, 1, "")]) == "unstable"


def test_parse_rules():
    assert R.parse_rules("blowup, nonfinite") == ("blowup", "nonfinite")
    assert R.parse_rules("all") == R.RULE_NAMES
    with pytest.raises(ValueError, match="unknown rule.*blowpu.*choose from"):
        R.parse_rules("blowup,blowpu")
    with pytest.raises(ValueError):
        R.parse_rules(" , ")


def test_recommendations_are_concrete():
    recs = " ".join(R.recommendations({"blowup"}, "k3", {"opsm_masked_frac": 0.25}))
    assert "use_bias_correction_kl=True" in recs and "off_policy_mask_threshold" in recs and "25.0%" in recs
    assert "vllm_importance_sampling_correction" in " ".join(R.recommendations({"mismatch"}, "k3_is", {}))
    assert R.recommendations(set(), "k3_is", {})[0].startswith("Nothing to fix")


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
    import shutil

    src = SAMPLE_LOGS / name
    return Path(shutil.copytree(src, tmp_path / name, ignore=shutil.ignore_patterns(".kldiag")))


def _first_blowup_step(run_dir: Path, limit: float) -> int:
    """Independent of the analysis engine: the first step whose K3 weight passes `limit`."""
    from kldiag import estimators as E

    t = kldiag.open_run(run_dir).read(["step", "logp", "logp_ref"]).to_pydict()
    w = np.abs(E.weight_k3(np.asarray(t["logp"]), np.asarray(t["logp_ref"])))
    return int(np.min(np.asarray(t["step"])[w > limit]))


def test_report_on_the_unstable_sample_run_names_the_blowup_and_its_onset(tmp_path, capsys):
    run = _copy_run("demo_k3", tmp_path)
    out = tmp_path / "k3.html"
    assert main(["report", str(run), "-o", str(out), "--fail-on", "blowup"]) == 1
    text = capsys.readouterr().out
    onset = _first_blowup_step(run, R.ReportConfig.blowup_weight)
    assert "verdict: UNSTABLE" in text and f"onset at step {onset}" in text
    assert "[FIRED] blowup" in text and "use_bias_correction_kl=True" in text
    assert "first to move:" in text
    page = out.read_text()
    assert f"onset at step <b>{onset}</b>" in page and "Verdict: UNSTABLE" in page
    assert any(html.escape(p) in page for p in (" um", " like", " basically", " actually"))


def test_report_on_the_corrected_sample_run_is_healthy(tmp_path, capsys):
    run = _copy_run("demo_k3_is", tmp_path)
    assert main(["report", str(run), "-o", str(tmp_path / "is.html"), "--fail-on", "blowup,nonfinite"]) == 0
    text = capsys.readouterr().out
    # Not unstable: no blow-up. The demo's sampler runs at temperature 1.2 on purpose, which the
    # diagnosis may name (engine_temperature_mismatch): a warning about the engine, not the KL.
    assert "verdict: UNSTABLE" not in text and "[ok   ] blowup" in text
    assert "[FIRED] latent" in text  # its tokens would blow K3 up: a note, not a failure


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
    assert e.value.code == 2 and "choose from" in capsys.readouterr().err


def test_nonfinite_run_is_unstable(tmp_path):
    from kldiag.tools.synth import SynthConfig, make_run

    make_run(tmp_path / "nan", SynthConfig(steps=6, estimator="k3_is", nonfinite=((3, "logp"),), positive=(4,)))
    rep = R.build_report(kldiag.analyze(tmp_path / "nan"))
    assert rep.verdict == "unstable" and rep.onset_step == 3
    assert R.exit_code(rep, ("nonfinite",)) == 1 and R.exit_code(rep, ("blowup",)) == 0


def test_run_without_reference_is_not_judged_on_kl(tmp_path):
    from kldiag.tools.synth import SynthConfig, make_run

    make_run(tmp_path / "noref", SynthConfig(steps=4, reference=False, on_policy=True))
    rep = R.build_report(kldiag.analyze(tmp_path / "noref"))
    assert rep.verdict == "healthy"
    assert all("not judged" in r.message for r in rep.rules if r.name in ("blowup", "blame", "latent"))
    assert "no reference log-probs" in report_render.format_text(rep)
