"""Attempts: a restart into the same run directory supersedes the steps it re-records."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

import kldiag
from kldiag import format as F
from kldiag.record.recorder import Recorder

B, T = 4, 6


def logps(step: int, shift: float) -> tuple[np.ndarray, np.ndarray]:
    """(logp, logp_ref) of a step; `shift` makes the attempts' values differ."""
    rng = np.random.default_rng(step)
    logp = -rng.exponential(1.0, (B, T)).astype(np.float32)
    return logp, (logp - 0.3 - shift).astype(np.float32)


def record(run: Path, steps: range, shift: float, **kw: object) -> Recorder:
    with Recorder(run, beta=0.04, estimator="k3", rotate_steps=4, **kw) as rec:
        for step in steps:
            logp, ref = logps(step, shift)
            rec.record(step=step, logp=logp, logp_ref=ref, advantages=np.ones(B, np.float32))
    return rec


def k3_mean(step: int, shift: float) -> float:
    logp, ref = logps(step, shift)
    d = ref.astype(np.float64) - logp
    return float(np.mean(np.exp(d) - d - 1))


@pytest.fixture()
def restarted(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    first = record(run, range(0, 30), shift=0.0)
    second = record(run, range(20, 40), shift=1.0)
    assert (first.attempt, second.attempt) == (0, 1)
    return run


def test_restart_uses_the_latest_attempt_per_step(restarted: Path) -> None:
    a = kldiag.analyze(restarted, kldiag.AnalysisConfig(use_cache=False))
    steps = a.steps.to_pandas().set_index("step")
    assert list(steps.index) == list(range(40))
    assert (steps["tokens"] == B * T).all()  # never both attempts' tokens for one step
    for s in range(40):
        assert steps.loc[s, "k3_mean"] == pytest.approx(k3_mean(s, 1.0 if s >= 20 else 0.0), rel=1e-5)
    sup = a.superseded.to_pylist()
    assert sup == [{"rank": 0, "attempt": 0, "rows": 10 * B * T}] and a.info["superseded_rows"] == 10 * B * T


def test_superseded_rows_stay_on_disk_and_readable(restarted: Path) -> None:
    run = kldiag.open_run(restarted)
    everything = run.read(include_superseded=True)
    assert everything.num_rows == (30 + 20) * B * T
    latest = run.read()
    assert latest.num_rows == 40 * B * T
    old = everything.filter(everything.column("attempt").to_numpy() == 0)
    assert sorted(set(old.column("step").to_pylist())) == list(range(30))


def test_no_sequence_mixes_attempts(restarted: Path) -> None:
    t = kldiag.open_run(restarted).read(columns=["seq", "attempt", "step"], include_superseded=True).to_pandas()
    per_seq = t.groupby("seq")["attempt"].nunique()
    assert (per_seq == 1).all()
    a = kldiag.analyze(restarted, kldiag.AnalysisConfig(use_cache=False))
    assert a.sequences.num_rows == 40 * B


def test_cached_analysis_follows_a_new_attempt(tmp_path: Path) -> None:
    run = tmp_path / "run"
    record(run, range(0, 12), shift=0.0)
    before = kldiag.analyze(run)
    assert before.steps.column("k3_mean")[10].as_py() == pytest.approx(k3_mean(10, 0.0), rel=1e-5)
    record(run, range(8, 12), shift=1.0)
    after = kldiag.analyze(run)  # cached partials of the first attempt must not be reused as they were
    assert after.steps.column("k3_mean")[10].as_py() == pytest.approx(k3_mean(10, 1.0), rel=1e-5)
    assert after.steps.column("k3_mean")[2].as_py() == pytest.approx(k3_mean(2, 0.0), rel=1e-5)
    assert after.files_new < after.files  # parts the new attempt does not touch come from the cache


def test_manifest_keeps_the_history_of_attempts(restarted: Path) -> None:
    m = json.loads((restarted / F.MANIFEST).read_text())
    assert [a["attempt"] for a in m["attempts"]] == [0, 1]
    assert m["started"] == m["attempts"][0]["started"] and m["format_version"] == F.FORMAT_VERSION
    assert m["writer"]["rows"] == 50 * B * T and m["writer"]["attempts_reported"] == [0, 1]


def test_attempts_are_per_rank_and_trainer_kl_uses_the_latest(tmp_path: Path) -> None:
    run = tmp_path / "run"
    for rank in (0, 1):
        record(run, range(0, 6), shift=0.0, rank=rank, world_size=2)
    record(run, range(4, 6), shift=1.0, rank=1, world_size=2)  # only rank 1 restarted
    parts = F.list_parts(run)
    assert {(p.rank, p.attempt) for p in parts} == {(0, 0), (1, 0), (1, 1)}
    a = kldiag.analyze(run, kldiag.AnalysisConfig(use_cache=False, trainer_compatible=True, per_rank=True))
    assert a.superseded.to_pylist() == [{"rank": 1, "attempt": 0, "rows": 2 * B * T}]
    by_rank = a.steps_by_rank.to_pandas().set_index(["step", "rank"])
    assert by_rank.loc[(5, 1), "k3_mean"] == pytest.approx(k3_mean(5, 1.0), rel=1e-5)
    assert by_rank.loc[(5, 0), "k3_mean"] == pytest.approx(k3_mean(5, 0.0), rel=1e-5)
    assert a.trainer_kl is not None and a.trainer_kl.num_rows == 6


def test_writer_removes_stale_temps_of_a_killed_predecessor(tmp_path: Path) -> None:
    run = tmp_path / "run"
    record(run, range(0, 2), shift=0.0)
    rank0 = F.rank_dir(run, 0)
    dead = rank0 / f".{F.part_name(2, 2, 5, 0)}.999999999.tmp"  # no such pid
    v1_style = rank0 / f".{F.part_name(3, 3, 6, None)}.tmp"
    live = rank0 / f".{F.part_name(4, 4, 7, 0)}.{os.getppid()}.tmp"  # a live process's: kept
    other_rank = F.rank_dir(run, 1) / f".{F.part_name(2, 2, 0, 0)}.999999999.tmp"
    for p in (dead, v1_style, live, other_rank):
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"half a part")
    record(run, range(2, 3), shift=0.0)
    assert not dead.exists() and not v1_style.exists()
    assert live.exists() and other_rank.exists()  # another rank's temps are its own writer's business


def test_cli_says_what_it_superseded(restarted: Path, capsys: pytest.CaptureFixture) -> None:
    from kldiag.cli import main

    assert main(["analyze", str(restarted)]) == 0
    out = capsys.readouterr().out
    assert f"superseded: {10 * B * T:,} rows" in out and "rank 0 attempt 0" in out
    assert main(["analyze", str(restarted), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["superseded"] == [{"rank": 0, "attempt": 0, "rows": 10 * B * T}]


def test_the_docs_duckdb_query_keeps_the_latest_attempt(restarted: Path) -> None:
    """docs/format.md's SQL for readers without kldiag gives the rows kldiag analyses."""
    import duckdb

    doc = (Path(__file__).resolve().parent.parent / "docs" / "format.md").read_text()
    sql = doc[doc.index("```sql") + 6:]
    sql = sql[: sql.index("```")].replace("RUN", str(restarted))
    got = duckdb.sql(sql).df()
    assert len(got) == 40 * B * T == kldiag.open_run(restarted).read().num_rows
    assert set(got[got.step >= 20].attempt) == {1} and set(got[got.step < 20].attempt) == {0}
