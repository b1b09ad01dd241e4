"""Every subcommand, on a table of bad inputs: exit 2, one `kldiag: error:` line on stderr naming the
fix, no traceback, and every input file byte for byte as it was (sha256 before and after).

Placeholders in a case: {run} a small run, {file} an existing file, {dir} an existing directory,
{missing} a path that does not exist, {taken} a port another socket holds on 127.0.0.1."""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from kldiag.cli import COMMAND_MODULES, build_parser, main
from kldiag.errors import KldiagError
from kldiag.tools.synth import SynthConfig, make_run

# (case id, argv); the first word is the subcommand.
CASES = [
    ("lab-samples", "lab --samples 1"),
    ("lab-trials-text", "lab --trials many"),
    ("analyze-file", "analyze {run}/run.json"),
    ("analyze-missing", "analyze {missing}"),
    ("analyze-not-a-run", "analyze {dir}"),
    ("analyze-out-file", "analyze {run} --out {file}"),
    ("analyze-out-in-run", "analyze {run} --out {run}/tokens"),
    ("analyze-workers", "analyze {run} --workers 0"),
    ("analyze-workers-text", "analyze {run} --workers x"),
    ("dashboard-file", "dashboard {run}/run.json"),
    ("dashboard-missing", "dashboard {missing}"),
    ("dashboard-port-taken", "dashboard {run} --port {taken}"),
    ("dashboard-port-range", "dashboard {run} --port 99999"),
    ("dashboard-logs-missing", "dashboard {run} --logs {missing}"),
    ("demo-out-file", "demo --out {file} --no-dashboard --steps 2"),
    ("demo-steps", "demo --steps 0"),
    ("demo-port-taken", "demo --out {dir} --port {taken} --steps 2"),
    ("report-file", "report {run}/run.json"),
    ("report-missing", "report {missing} -o {dir}/r.html"),
    ("report-out-dir", "report {run} -o {dir}"),
    ("report-out-run-file", "report {run} -o {run}/run.json"),
    ("report-out-other-file", "report {run} -o {file}"),
    ("report-fail-on", "report {run} --fail-on bogus"),
    ("report-blowup-weight", "report {run} --blowup-weight -1"),
    ("watch-missing", "watch {missing} --once"),
    ("watch-file", "watch {run}/run.json --once"),
    ("watch-interval", "watch {run} --interval 0"),
    ("watch-fail-on", "watch {run} --fail-on bogus --once"),
    ("import-src-missing", "import slime {missing} {dir}/new_run"),
    ("import-framework", "import bogus {dir} {dir}/new_run"),
    ("import-run-file", "import slime {dir} {file}"),
    ("export-missing", "export tensorboard {missing} {dir}/tb"),
    ("export-file", "export tensorboard {run}/run.json {dir}/tb"),
    ("export-logdir-file", "export tensorboard {run} {file}"),
    ("export-format", "export parquet {run} {dir}/tb"),
    ("crosswalk-file", "crosswalk {run}/run.json -f trl"),
    ("crosswalk-missing", "crosswalk {missing} -f trl"),
    ("crosswalk-framework", "crosswalk {run} -f bogus"),
    ("crosswalk-set", "crosswalk {run} -f trl --set foo"),
    ("audit-logs-missing", "audit {run} --logs {missing} -f trl"),
    ("audit-logs-unknown", "audit {run} --logs {file} -f trl"),
    ("audit-file", "audit {run}/run.json --logs {file} -f trl"),
    ("audit-fail-on", "audit {run} --logs {file} -f trl --fail-on bogus"),
    ("serve-metrics-file", "serve-metrics {run}/run.json --once"),
    ("serve-metrics-port-range", "serve-metrics {run} --port 99999 --once"),
    ("serve-metrics-interval", "serve-metrics {run} --interval 0"),
    ("serve-metrics-port-taken", "serve-metrics {run} --port {taken} --once"),
    ("mcp-root-missing", "mcp --root {missing}"),
    ("mcp-root-file", "mcp --root {file}"),
    ("cache-missing", "cache {missing}"),
    ("cache-not-a-run", "cache {dir}"),
    ("grafana-out-file", "grafana --out {file}"),
    ("unknown-command", "bogus {run}"),
    # a run.json holding valid JSON that is not an object (a list)
    ("analyze-json-list", "analyze {listrun}"),
    ("report-json-list", "report {listrun} -o {dir}/r.html"),
    ("watch-json-list", "watch {listrun} --once"),
    ("crosswalk-json-list", "crosswalk {listrun} -f trl"),
    ("cache-json-list", "cache {listrun}"),
    ("dashboard-json-list", "dashboard {listrun}"),
    # a run directory whose name is not UTF-8 (Parquet paths must be)
    ("analyze-not-utf8", "analyze {badname}"),
    ("report-not-utf8", "report {badname} -o {dir}/r.html"),
    ("watch-not-utf8", "watch {badname} --once"),
    ("crosswalk-not-utf8", "crosswalk {badname} -f trl"),
    # --set checked before the analysis reads or writes anything (the digests say nothing was written)
    ("analyze-set-value", "analyze {run} --set routing_replay=maybe"),
    ("analyze-set-empty", "analyze {run} --set routing_replay="),
    ("analyze-set-no-equals", "analyze {run} --set routing_replay"),
    ("report-set-value", "report {run} -o {dir}/r.html --set routing_replay=maybe"),
    # a run whose only part is truncated: exit 2, and no RUN/.kldiag/prefix/seqs left behind
    ("analyze-no-rows", "analyze {broken}"),
]
# Run as a child process: a regression here would start a server or train (or, in-process, replace
# pytest by Streamlit); the others run in-process, and these prove no traceback reaches a terminal.
SUBPROCESS = {"dashboard-json-list",
              "dashboard-file", "dashboard-port-taken", "dashboard-port-range", "dashboard-logs-missing",
              "demo-out-file", "demo-port-taken", "analyze-file", "report-out-dir", "watch-missing"}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("cli_errors")
    make_run(root / "run", SynthConfig(steps=3, seqs_per_step=4, seq_len=(4, 8), vocab_size=0))
    (root / "file.txt").write_text("an existing file\n")
    (root / "dir").mkdir()
    shutil.copytree(root / "run", root / "listrun")
    (root / "listrun" / "run.json").write_text("[1, 2]")
    shutil.copytree(root / "run", root / "bad\udcffname")  # the bytes b"bad\xffname", as Python names them
    make_run(root / "broken", SynthConfig(steps=2, seqs_per_step=4, seq_len=(4, 8), vocab_size=0))
    for part in (root / "broken" / "tokens").rglob("*.parquet"):
        part.write_bytes(part.read_bytes()[:300])
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield {"run": root / "run", "file": root / "file.txt", "dir": root / "dir", "listrun": root / "listrun",
               "badname": root / "bad\udcffname", "broken": root / "broken",
               "missing": root / "nosuch", "taken": taken.getsockname()[1], "root": root}


def digests(root: Path) -> dict[str, str]:
    """sha256 of every file under root (the run, the file, the directory), by relative path."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def argv_of(template: str, inputs: dict) -> list[str]:
    return template.format(**inputs).split()


def run_cli(case: str, argv: list[str], capsys) -> tuple[int, str]:
    if case in SUBPROCESS:
        root = str(Path(__file__).parents[1])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
        env.pop("KLDIAG_DEBUG", None)
        p = subprocess.run([sys.executable, "-m", "kldiag", *argv], capture_output=True, text=True, timeout=120,
                           env=env)
        return p.returncode, p.stderr
    capsys.readouterr()
    try:
        rc = main(argv)
    except SystemExit as e:  # a bad argument: argparse exits, as ever, after Parser.error's one line
        rc = e.code
    return rc, capsys.readouterr().err


@pytest.mark.parametrize(("case", "template"), CASES, ids=[c for c, _ in CASES])
def test_bad_input_is_one_line_and_exit_2(case, template, inputs, capsys, monkeypatch):
    monkeypatch.delenv("KLDIAG_DEBUG", raising=False)
    before = digests(inputs["root"])
    rc, err = run_cli(case, argv_of(template, inputs), capsys)
    lines = err.strip().splitlines()
    assert rc == 2, (rc, err)
    assert "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith("kldiag: error: "), err
    assert digests(inputs["root"]) == before


def test_every_subcommand_has_a_case():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert len(COMMAND_MODULES) == len(sub.choices)
    assert set(sub.choices) <= {t.split()[0] for _, t in CASES}


def test_port_error_names_the_flag(inputs):
    err = subprocess.run([sys.executable, "-m", "kldiag", *argv_of("dashboard {run} --port {taken}", inputs)],
                         capture_output=True, text=True, timeout=120).stderr
    assert "--port" in err and str(inputs["taken"]) in err and "dashboard on" not in err


def test_file_for_run_names_its_directory(inputs, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv_of("analyze {run}/run.json", inputs))
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert f"pass its directory {inputs['run']}" in err


def test_warning_is_one_line_without_source(capsys):
    """A warning raised during a subcommand: `kldiag: warning: ...` once, no file:line, no source line."""
    from kldiag.cli import warning_line

    assert warning_line("kldiag: skipping part x", UserWarning, "engine.py", 85) == "kldiag: warning: skipping part x\n"
    assert warning_line("a late step", UserWarning, "engine.py", 85, "warnings.warn(x)") == \
        "kldiag: warning: a late step\n"


def test_warnings_during_main_use_the_formatter(inputs, capsys, monkeypatch):
    import kldiag.cli.lab as lab

    def warn_then_fail(args):
        warnings.warn("kldiag: skipping part p.parquet: truncated", stacklevel=2)
        return 0

    monkeypatch.setattr(lab, "_main", warn_then_fail)
    assert main(["lab"]) == 0
    assert capsys.readouterr().err == "kldiag: warning: skipping part p.parquet: truncated\n"
    assert warnings.formatwarning.__module__ == "warnings"  # restored after main


def test_debug_shows_the_traceback(inputs, monkeypatch):
    monkeypatch.setenv("KLDIAG_DEBUG", "1")
    with pytest.raises(KldiagError, match="--out"):
        main(argv_of("analyze {run} --out {file}", inputs))


def test_warnings_of_every_reading_subcommand_are_one_line_each(tmp_path):
    """A run with a truncated part: analyze, report, crosswalk and export warn that they skip it in one
    `kldiag: warning:` line each (no source line, no second prefix, not twice)."""
    run = tmp_path / "run"
    parts = make_run(run, SynthConfig(steps=6, seqs_per_step=8, seq_len=(8, 16), vocab_size=0, rows_per_file=200))
    broken = sorted(parts)[1]
    broken.write_bytes(broken.read_bytes()[:100])
    for argv in (["analyze", str(run), "--no-cache"], ["report", str(run), "-o", str(tmp_path / "r.html")],
                 ["crosswalk", str(run), "-f", "trl"], ["export", "tensorboard", str(run), str(tmp_path / "tb")]):
        err = subprocess.run([sys.executable, "-m", "kldiag", *argv], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}).stderr
        warned = [ln for ln in err.splitlines() if "warning:" in ln or "Warning" in ln]
        assert len(warned) == 1 and warned[0].startswith("kldiag: warning: skipping "), (argv, err)
        assert broken.name in warned[0] and "kldiag: warning: kldiag:" not in err and "UserWarning" not in err
        assert all(ln.startswith("kldiag") for ln in err.splitlines()), err


def test_an_unforeseen_os_error_is_one_line(capsys, monkeypatch):
    import kldiag.cli.lab as lab

    def denied(args):
        raise PermissionError(13, "Permission denied", "/srv/runs/r/report.html")

    monkeypatch.setattr(lab, "_main", denied)
    assert main(["lab"]) == 2
    err = capsys.readouterr().err
    assert err == ("kldiag: error: /srv/runs/r/report.html: permission denied; check the path and its permissions "
                   "(KLDIAG_DEBUG=1 shows where it failed)\n")


def test_crosswalk_on_a_run_with_no_readable_rows_exits_2_like_analyze(inputs, capsys):
    before = digests(inputs["root"])
    rc, err = run_cli("crosswalk-no-rows", ["crosswalk", str(inputs["broken"]), "-f", "trl"], capsys)
    assert rc == 2 and err.strip().splitlines()[-1].startswith("kldiag: error: run ")
    assert "no readable token rows" in err and "Traceback" not in err
    assert digests(inputs["root"]) == before


def _help(argv: list[str], capsys) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines: compare words


def test_help_names_the_run_alike_and_says_what_each_option_does(capsys):
    for name in ("analyze", "report", "dashboard", "watch", "serve-metrics", "crosswalk", "cache", "audit"):
        text = _help([name], capsys)
        assert "RUN_DIR" not in text and " RUN" in text, name
    analyze = _help(["analyze"], capsys)
    assert "(AnalysisConfig." not in analyze
    assert "--tau TAU flag a token as theta_ll_ref" in analyze
    assert "--alert-factor ALERT_FACTOR an alert's jump" in analyze
    assert "--seed SEED seed of the samples" in _help(["lab"], capsys)
    fail_on = _help(["watch"], capsys)
    assert all(n in fail_on for n in ("early", "latent", "k3_weight_blowup", "routing_replay_broken"))
    assert "RUN LOGDIR" in _help(["export"], capsys).split("usage:")[1].split("`")[0]


def test_a_run_path_that_is_not_utf8_is_named_with_the_fix(inputs, capsys):
    rc, err = run_cli("analyze-not-utf8", ["analyze", str(inputs["badname"])], capsys)
    assert rc == 2 and "bad\\xffname" in err and "not valid UTF-8" in err and "ln -s" in err


@pytest.mark.parametrize("value", ["routing_replay=maybe", "routing_replay=", "routing_replay"])
def test_set_is_checked_before_any_work(inputs, tmp_path, capsys, value):
    run = shutil.copytree(inputs["run"], tmp_path / "run", ignore=shutil.ignore_patterns(".kldiag"))
    for argv in (["analyze", str(run)], ["report", str(run), "-o", str(tmp_path / "r.html")]):
        rc, err = run_cli("set", [*argv, "--set", value], capsys)
        assert rc == 2 and "--set" in err and "routing_replay" in err
        assert not (run / ".kldiag").exists() and not (tmp_path / "r.html").exists()  # nothing read, nothing written


def test_a_failed_analysis_leaves_no_cache_folders(inputs, tmp_path, capsys):
    run = shutil.copytree(inputs["broken"], tmp_path / "run", ignore=shutil.ignore_patterns(".kldiag"))
    rc, err = run_cli("no-rows", ["analyze", str(run)], capsys)
    assert rc == 2 and "no readable token rows" in err
    assert not (run / ".kldiag").exists(), sorted(p.relative_to(run) for p in run.rglob("*"))
