"""Missing data is a diagnosis: unreadable or empty parts and step gaps inside a rank are the `data_missing`
cause on every face (analyze, report, watch, the guard, the dashboard), and steps a recorder skips by design
are not. Input files are never changed."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import kldiag
from kldiag.analysis.rules import episodes as EP
from kldiag.analysis.runtime.lost import NOTHING_PUBLISHED, no_tokens_reason
from kldiag.cli import main
from kldiag.diagnosis import diagnose, missing
from kldiag.errors import EmptyRunError
from kldiag.format import TOKEN_SCHEMA, part_name, publish_part, rank_dir
from kldiag.live.guard import Guard
from kldiag.tools.synth import SynthConfig, make_run

ROOT = Path(__file__).resolve().parent.parent
SMALL = SynthConfig(steps=30, seqs_per_step=4, seq_len=(4, 12), vocab_size=16)
THIRDS = (range(0, 10), range(10, 20), range(20, 30))


def three_parts(run: Path, cfg: SynthConfig = SMALL, spoil=None) -> list[Path]:
    """A 30-step run in three parts per rank (steps 0-9, 10-19, 20-29); `spoil(path)` is applied to
    the middle part of every rank."""
    paths = []
    for k, steps in enumerate(THIRDS):
        new = make_run(run, cfg, steps=steps, manifest=k == 0)
        if k == 1 and spoil is not None:
            for p in new:
                spoil(p)
        paths += new
    return paths


def truncate(p: Path) -> None:
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])


def hashes(run: Path) -> dict[str, str]:
    """sha256 of every input file of the run (the cache under .kldiag is kldiag's own)."""
    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run.rglob("*")) if p.is_file() and ".kldiag" not in p.relative_to(run).parts}


def cause(dg, name: str = "data_missing"):
    found = [c for c in dg.causes if c.cause == name]
    return found[0] if found else None


def analyzed(run: Path, warns: bool = False, **kw):
    """The analysis (no cache: each test sees its own reading); `warns`: a skipped part is warned about."""
    with pytest.warns(UserWarning, match="skipping part") if warns else contextlib.nullcontext():
        return kldiag.analyze(run, kldiag.AnalysisConfig(use_cache=False, **kw))


@pytest.fixture(scope="module")
def truncated(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("truncated") / "run"
    three_parts(run, spoil=truncate)
    return run


def test_a_truncated_middle_part_is_named_with_its_steps_and_rank(truncated):
    before = hashes(truncated)
    a = analyzed(truncated, warns=True)
    (lost,) = a.lost
    assert (lost.rank, lost.step_min, lost.step_max, lost.reason) == (0, 10, 19, "unreadable")
    assert lost.name == "part-000000010-000000019-a0000-000001.parquet"
    dg = diagnose(a)
    c = cause(dg)
    assert dg.verdict != "healthy" and c.severity == "warning" and c.onset == 10
    (part,) = c.evidence["parts"]
    assert (part["part"], part["rank"], part["step_min"], part["step_max"], part["steps"]) == (lost.name, 0, 10, 19, 10)
    assert c.evidence["steps_missing"] == 10 and c.evidence["steps_expected"] == 30 and c.evidence["gaps"] == []
    assert "steps 10-19" in c.summary and "rank 0" in c.summary and lost.name in c.summary
    assert hashes(truncated) == before


def test_the_cli_faces_show_it_and_fail_on_it(truncated, tmp_path, capsys):
    before = hashes(truncated)
    assert main(["analyze", str(truncated)]) == 0
    text = capsys.readouterr().out
    assert "verdict: WARNING: data_missing from step 10" in text and "(rank 0, steps 10-19) is unreadable" in text
    assert main(["analyze", str(truncated), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["diagnosis"]["verdict"] == "warning"
    assert [c["cause"] for c in out["diagnosis"]["causes"]] == ["data_missing"]
    assert out["lost_parts"][0]["step_min"] == 10 and out["lost_parts"][0]["reason"] == "unreadable"
    for rule in ("all", "data_missing"):
        html = tmp_path / f"{rule}.html"
        assert main(["report", str(truncated), "-o", str(html), "--fail-on", rule]) == 1
        captured = capsys.readouterr()
        assert "data_missing (warning, from step 10)" in captured.out and "steps 10-19" in captured.out
        assert "failing on cause data_missing" in captured.err
        assert "data_missing" in html.read_text() and "steps 10-19" in html.read_text()
        assert main(["watch", str(truncated), "--once", "--fail-on", rule]) == 1
        captured = capsys.readouterr()
        assert "verdict: WARNING: data_missing" in captured.out and "failing on data_missing" in captured.err
    assert main(["report", str(truncated), "-o", str(tmp_path / "r.html"), "--fail-on", "blowup"]) == 0
    assert main(["watch", str(truncated), "--once", "--fail-on", "blowup"]) == 0
    capsys.readouterr()
    assert hashes(truncated) == before


def test_watch_fails_on_it_from_a_real_process(truncated):
    before = hashes(truncated)
    done = subprocess.run([sys.executable, "-m", "kldiag", "watch", str(truncated), "--once", "--fail-on", "all"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 1, done.stderr
    assert "failing on data_missing" in done.stderr and "Traceback" not in done.stderr
    assert hashes(truncated) == before


def test_audit_fails_on_it(truncated, tmp_path, capsys):
    from test_audit import write_log

    import kldiag.crosswalk as X

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the skipped part
        truth = {r["step"]: r for r in X.records(X.crosswalk(truncated, "trl"), reasons=False)}
    logs = write_log(tmp_path / "log.jsonl", truth, {})
    before = hashes(truncated)
    assert main(["audit", str(truncated), "--logs", str(logs), "-f", "trl", "--fail-on", "disagreement"]) == 0
    assert main(["audit", str(truncated), "--logs", str(logs), "-f", "trl", "--fail-on", "disagreement,data_missing"]) == 1
    err = capsys.readouterr().err
    assert "failing on data_missing (warning, from step 10)" in err and "steps 10-19" in err
    assert hashes(truncated) == before


def test_a_zero_byte_part(tmp_path, capsys):
    run = tmp_path / "run"
    three_parts(run, spoil=lambda p: p.write_bytes(b""))
    before = hashes(run)
    c = cause(diagnose(analyzed(run, warns=True)))
    (part,) = c.evidence["parts"]
    assert (part["reason"], part["step_min"], part["step_max"], part["rank"]) == ("empty: 0 bytes", 10, 19, 0)
    assert main(["report", str(run), "-o", str(tmp_path / "r.html"), "--fail-on", "data_missing"]) == 1
    assert main(["watch", str(run), "--once", "--fail-on", "all"]) == 1
    capsys.readouterr()
    assert hashes(run) == before


def test_a_zero_row_part(tmp_path):
    run = tmp_path / "run"
    make_run(run, SMALL, steps=range(0, 10))
    publish_part(TOKEN_SCHEMA.empty_table(), rank_dir(run, 0), part_name(10, 19, 1))
    make_run(run, SMALL, steps=range(20, 30), manifest=False)
    c = cause(diagnose(analyzed(run)))
    (part,) = c.evidence["parts"]
    assert (part["reason"], part["step_min"], part["step_max"]) == ("empty: 0 rows", 10, 19)


def test_a_run_whose_only_part_is_corrupt_says_so(tmp_path):
    run = tmp_path / "run"
    (only,) = make_run(run, SMALL, steps=range(0, 10))
    truncate(only)
    before = hashes(run)
    with pytest.warns(UserWarning), pytest.raises(EmptyRunError, match="1 skipped as unreadable"):
        kldiag.analyze(run)
    reason = no_tokens_reason(run)
    assert reason != NOTHING_PUBLISHED and only.name in reason and "unreadable" in reason
    assert hashes(run) == before
    fresh = tmp_path / "fresh"
    make_run(fresh, SMALL, steps=range(0))
    assert no_tokens_reason(fresh) == NOTHING_PUBLISHED


def test_no_cause_on_healthy_multi_rank_and_live_runs(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    three_parts(one)
    three_parts(two, SynthConfig(**{**SMALL.__dict__, "ranks": 2}))
    # a live run: the newest part of rank 1 is still being written under its temp name, so rank 1 ends at
    # step 19 while rank 0 has published step 29
    make_run(two, SynthConfig(**{**SMALL.__dict__, "ranks": 2}), steps=range(30, 40), manifest=False)
    newest = sorted(rank_dir(two, 1).glob("part-*"))[-1]
    newest.rename(newest.with_name(f".{newest.name}.999999.tmp"))
    for run in (one, two):
        a = analyzed(run)
        assert not a.lost and cause(diagnose(a)) is None


def record(run: Path, steps, rank: int = 0, world_size: int = 1, **options) -> None:
    rng = np.random.default_rng(rank)
    with kldiag.Recorder(run, beta=0.04, estimator="k3", rank=rank, world_size=world_size, rotate_seconds=None,
                         rotate_steps=10, **options) as rec:
        for step in steps:
            logp = -rng.exponential(0.5, (4, 8)).astype(np.float32)
            ref = np.minimum(logp + 0.01 * rng.standard_normal((4, 8)), 0.0).astype(np.float32)
            rec.record(step=step, logp=logp, logp_ref=ref)


def test_steps_skipped_by_design_are_not_gaps(tmp_path):
    every = tmp_path / "every"
    record(every, range(60), every_n_steps=5)
    a = analyzed(every)
    assert a.steps.num_rows == 12 and cause(diagnose(a)) is None
    sampled = tmp_path / "sampled"
    record(sampled, [s for s in range(30) if s not in (12, 13)], seq_fraction=0.5)
    c = cause(diagnose(analyzed(sampled)))
    assert c is None  # a sampled step may hold no sequence: gaps are not judged


def test_a_gap_inside_a_rank(tmp_path):
    run = tmp_path / "run"
    record(run, [s for s in range(30) if s not in (12, 13)])
    c = cause(diagnose(analyzed(run)))
    assert c.evidence["parts"] == [] and c.evidence["gaps"] == [{"rank": 0, "first": 12, "last": 13, "steps": 2}]
    assert c.onset == 12 and c.severity == "warning" and "rank 0 has no rows at steps 12-13" in c.summary


def test_a_rank_missing_steps_other_ranks_have(tmp_path):
    run = tmp_path / "run"
    record(run, range(30), rank=0, world_size=2)
    record(run, [s for s in range(30) if not 10 <= s <= 19], rank=1, world_size=2)
    for per_rank in (False, True):
        dg = diagnose(analyzed(run, per_rank=per_rank))
        c = cause(dg)
        assert c.evidence["gaps"] == [{"rank": 1, "first": 10, "last": 19, "steps": 10}], per_rank
        assert c.evidence["steps_missing"] == 10 and dg.verdict == "warning"


def test_a_lost_part_that_a_restart_re_recorded_is_not_missing(tmp_path):
    run = tmp_path / "run"
    three_parts(run, spoil=truncate)
    a = analyzed(run, warns=True)
    assert cause(diagnose(a)).evidence["steps_missing"] == 10
    make_run(run, SynthConfig(**{**SMALL.__dict__, "attempt": 1}), steps=range(10, 30), manifest=False)
    a = analyzed(run, warns=True)
    assert len(a.lost) == 1 and cause(diagnose(a)) is None  # attempt 1 re-recorded steps 10-29


def test_critical_when_most_of_the_run_is_lost(tmp_path):
    run = tmp_path / "run"
    for k, steps in enumerate(THIRDS):
        (p,) = make_run(run, SMALL, steps=steps, manifest=k == 0)
        if k > 0:
            truncate(p)
    with pytest.warns(UserWarning):
        c = cause(diagnose(kldiag.analyze(run)))
    assert c.severity == "critical" and c.evidence["share"] == pytest.approx(20 / 30)


class _Recorder:
    """What the guard reads of a kldiag.Recorder for data_missing: its stats."""

    def __init__(self):
        self.stats = {"dropped_rows": 0, "lost_rows": 0, "write_errors": 0}


def test_the_guard_acts_on_rows_the_recorder_lost():
    assert "data_missing" in EP.parse_rules("all") and EP.parse_rules("data_missing") == ("data_missing",)
    assert EP.parse_rules("blowup,data_missing") == ("blowup", "data_missing")
    with pytest.raises(ValueError, match="data_missing"):
        EP.parse_rules("nosuch")
    rec = _Recorder()
    guard = Guard(on="data_missing", action="log,stop", recorder=rec)
    try:
        logp = np.full((2, 4), -1.0, np.float32)
        guard.observe(0, logp, logp_ref=logp)
        assert guard.end_step(0) == [] and not guard.should_stop
        rec.stats["lost_rows"] = 8
        guard.observe(1, logp, logp_ref=logp)
        (e,) = guard.end_step(1)
        assert (e.kind, e.start) == ("data_missing", 1) and "8 row(s)" in e.message and guard.should_stop
        assert guard.end_step(2) == []  # nothing more lost
    finally:
        guard.close()


def test_the_dashboard_shows_it(monkeypatch, truncated, tmp_path):
    from streamlit.testing.v1 import AppTest

    main_py = str(ROOT / "app" / "main.py")
    monkeypatch.setenv("KLDIAG_RUNS", str(truncated))
    at = AppTest.from_file(main_py, default_timeout=120).run()
    assert not at.exception, [e.value for e in at.exception]
    assert any(x.label.startswith("data_missing (warning") for x in at.expander)
    corrupt = tmp_path / "corrupt"
    (only,) = make_run(corrupt, SMALL, steps=range(0, 10))
    truncate(only)
    monkeypatch.setenv("KLDIAG_RUNS", str(corrupt))
    at = AppTest.from_file(main_py, default_timeout=120).run()
    assert any("unreadable" in e.value and only.name in e.value for e in at.error)
    assert not any("nothing has been published" in i.value for i in at.info)


def test_steps_that_jump_far_past_their_stride_are_not_judged_for_gaps(tmp_path):
    """Steps 0-3 then 3,000,000 (stride 1): the grid between them is not made (2^20 steps at most);
    no gap is claimed, and a lost part there is still named."""
    run = tmp_path / "run"
    make_run(run, SMALL, steps=range(4))
    (p,) = make_run(run, SMALL, steps=[3_000_000], manifest=False)
    a = analyzed(run)
    cov = missing.coverage(a)
    assert not cov.judged_gaps and "3,000,001 steps" in cov.not_judged and cov.gaps == []
    assert cause(diagnose(a)) is None
    truncate(p)
    c = cause(diagnose(analyzed(run, warns=True)))
    assert c is not None and c.evidence["parts_lost"] == 1 and "not judged" in c.summary
