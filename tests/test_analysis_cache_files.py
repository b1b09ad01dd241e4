"""kldiag.analysis.cache.files and `kldiag cache`: which files of RUN/.kldiag the default reads ask for,
and a prune that removes only the others (every default read stays warm after it)."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

import kldiag
from kldiag.analysis.cache import files as cache_files
from kldiag.analysis.reducers import topk
from kldiag.analysis.reducers.turns import TurnReducer
from kldiag.cli import main
from kldiag.cli.cache import live
from kldiag.format import open_run
from kldiag.tools.synth import SynthConfig, make_run
from kldiag.views import dashboard

DEFAULT = [*dashboard.reducers(), topk.TopkReducer()]


@pytest.fixture
def run(tmp_path: Path) -> Path:
    path = tmp_path / "run"
    make_run(path, SynthConfig(steps=6, seqs_per_step=8, seq_len=(5, 30), rows_per_file=120, seed=4))
    kldiag.analyze(path, kldiag.AnalysisConfig(), DEFAULT)  # the default reads' cache
    return path


LATER = 5.0  # seconds: a listing this long after the files were written (younger ones are kept)


def folders(path: Path) -> dict[str, cache_files.FolderUsage]:
    r = open_run(path)
    return {u.folder: u for u in cache_files.usage(r.cache_dir(), live(r), time.time() + LATER)}


def stale_names(path: Path) -> dict[str, set[str]]:
    return {k: {f.name for f in u.stale} for k, u in folders(path).items() if u.stale}


def test_the_default_reads_cache_is_all_live(run):
    got = folders(run)
    n_parts = len(open_run(run).parts())
    assert n_parts > 3
    assert {"analysis", "turns", "estimators", "topk", "reducers", "prefix"} <= set(got)
    assert "tokens" not in got or got["tokens"].files == 0  # the token sample: in its merged state only (reducers/)
    assert all(u.stale_files == 0 for u in got.values())
    assert got["analysis"].files == got["turns"].files == n_parts  # a partial per part
    assert got["analysis"].bytes == sum(f.stat().st_size for f in (run / ".kldiag" / "analysis").iterdir())


def test_old_versions_and_other_settings_are_stale_and_a_prune_keeps_every_default_read_warm(run):
    cache = run / ".kldiag"
    before = {p for p in cache.rglob("*") if p.is_file()}
    old_turns = dataclasses.replace(TurnReducer(), version=TurnReducer.version - 1)  # an older kldiag's
    kldiag.analyze(run, kldiag.AnalysisConfig(tau=50.0), [old_turns])  # and an analysis at other thresholds
    added = {p for p in cache.rglob("*") if p.is_file()} - before
    assert {p.parent.name for p in added} >= {"analysis", "turns", "reducers", "prefix"}
    stale = stale_names(run)
    assert {(k, n) for k, ns in stale.items() for n in ns} == {(p.parent.name, p.name) for p in added}
    tables = kldiag.analyze(run, kldiag.AnalysisConfig(), DEFAULT)

    rows = cache_files.prune(cache, live(open_run(run)), time.time() + LATER)
    assert sum(u.stale_files for u in rows) == len(added)
    assert {p for p in cache.rglob("*") if p.is_file()} == before  # the default reads' files, all of them
    assert stale_names(run) == {}
    again = kldiag.analyze(run, kldiag.AnalysisConfig(), DEFAULT)
    assert again.files_new == 0  # nothing the default reads ask for was removed
    assert again.steps.equals(tables.steps)
    for name in ("turns", "tokens", "estimators"):
        for k, v in tables.reduced[name].items():
            assert np.array_equal(np.asarray(again.reduced[name][k]), np.asarray(v), equal_nan=True), (name, k)


def test_parts_no_longer_listed_retired_folders_and_dead_temporary_files_are_stale(run):
    cache = run / ".kldiag"
    last = open_run(run).parts()[-1]
    Path(last.path).unlink()  # a part removed from the run: its partials are read no more
    (cache / "context").mkdir()
    (cache / "context" / "0123.part").write_bytes(b"x" * 10)  # a reducer kldiag no longer has
    young, dead = cache / "turns" / ".a.part.1.2.tmp", cache / "turns" / ".b.part.1.2.tmp"
    young.write_bytes(b"y")
    dead.write_bytes(b"z")
    old = time.time() + LATER - 2 * cache_files.TMP_AGE_S
    os.utime(dead, (old, old))
    stale = stale_names(run)
    assert stale["context"] == {"0123.part"}
    assert dead.name in stale["turns"] and young.name not in stale["turns"]  # a write in flight is kept
    for folder in ("analysis", "turns", "scan"):  # the token sample's partials: in its merged state only
        assert len(stale[folder] - {dead.name}) == 1, folder  # the removed part's partial


def test_folders_kldiag_does_not_know_are_kept(run):
    mine = run / ".kldiag" / "my_reducer"
    mine.mkdir()
    (mine / "a.part").write_bytes(b"1")
    got = folders(run)["my_reducer"]
    assert not got.judged and got.files == 1 and got.stale_files == 0
    cache_files.prune(run / ".kldiag", live(open_run(run)), time.time() + LATER)
    assert (mine / "a.part").exists()


def test_a_file_written_after_the_listing_is_kept(run):
    """A reader that went on while the live set was listed may have written a new part's partial: kept."""
    since = time.time() + LATER
    (run / ".kldiag" / "context").mkdir()
    old, new = run / ".kldiag" / "context" / "old.part", run / ".kldiag" / "context" / "new.part"
    old.write_bytes(b"o")
    new.write_bytes(b"n")
    os.utime(new, (since + 10, since + 10))
    cache_files.prune(run / ".kldiag", live(open_run(run)), since)
    assert not old.exists() and new.exists()


def test_the_command_lists_and_prunes(run, capsys):
    kldiag.analyze(run, kldiag.AnalysisConfig(clamp=5.0), [])  # other thresholds: stale for the default reads
    then = time.time() - LATER  # written a while before the command lists the run
    for f in (run / ".kldiag").rglob("*"):
        os.utime(f, (then, then))
    assert main(["cache", str(run)]) == 0
    out = capsys.readouterr().out
    assert "stale:" in out and "--prune" in out and "analysis" in out
    assert main(["cache", str(run), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["stale_bytes"] > 0 and not got["pruned"]
    by = {f["folder"]: f for f in got["folders"]}
    assert by["analysis"]["stale_files"] == len(open_run(run).parts()) and by["prefix"]["stale_files"] == 2
    assert main(["cache", str(run), "--prune"]) == 0
    assert "removed:" in capsys.readouterr().out
    assert main(["cache", str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stale_bytes"] == 0


def test_the_command_on_a_run_without_a_cache_and_on_no_run(tmp_path, capsys):
    path = tmp_path / "fresh"
    make_run(path, SynthConfig(steps=2, seqs_per_step=2, seq_len=(4, 6)))
    assert main(["cache", str(path)]) == 0
    assert "no cache yet" in capsys.readouterr().out
    assert main(["cache", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kldiag: error:") and len(err.strip().splitlines()) == 1


def test_the_command_on_an_s3_run_reads_its_local_cache(s3, tmp_path, monkeypatch, capsys):
    """An s3:// run's cache is a local folder per URI (KLDIAG_CACHE_DIR): listed and pruned there, and no
    credential reaches what the command prints."""
    from s3util import SECRET

    monkeypatch.setenv("KLDIAG_CACHE_DIR", str(tmp_path / "cache"))
    uri = f"s3://{s3.bucket()}/runs/c"
    with kldiag.Recorder(uri, beta=0.04, estimator="k3", rotate_seconds=None) as rec:
        rng = np.random.default_rng(0)
        for step in range(4):
            logp = -rng.exponential(0.7, (4, 12)).astype(np.float32)
            rec.record(step=step, logp=logp, logp_ref=logp - 0.1, logp_old=logp)
    kldiag.analyze(uri, kldiag.AnalysisConfig(), DEFAULT)
    kldiag.analyze(uri, kldiag.AnalysisConfig(weight_limit=3.0), [])  # other thresholds: stale
    cache = open_run(uri).cache_dir()
    assert str(cache).startswith(str(tmp_path / "cache"))
    then = time.time() - LATER
    for f in cache.rglob("*"):
        os.utime(f, (then, then))
    assert main(["cache", uri, "--json"]) == 0
    out = capsys.readouterr().out
    got = json.loads(out)
    assert got["cache_dir"] == str(cache) and got["stale_bytes"] > 0 and SECRET not in out
    assert main(["cache", uri, "--prune"]) == 0
    assert SECRET not in capsys.readouterr().out
    assert kldiag.analyze(uri, kldiag.AnalysisConfig(), DEFAULT).files_new == 0
