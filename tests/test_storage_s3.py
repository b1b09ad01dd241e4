"""Runs on object storage, against a real S3 server (moto, 127.0.0.1; fixture `s3` in conftest)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from s3util import SECRET

import kldiag
from kldiag import format as F
from kldiag.cli import main as cli
from kldiag.errors import RecorderError, StorageError
from kldiag.record.recorder import Recorder
from kldiag.report.build import offenders

B, T = 4, 5


def record(run: str | Path, steps: range, rank: int = 0, world_size: int = 1, **kw: object) -> Recorder:
    with Recorder(run, beta=0.04, estimator="k3", rank=rank, world_size=world_size, rotate_steps=3, **kw) as rec:
        for step in steps:
            rng = np.random.default_rng([rank, step])
            logp = -rng.exponential(1.0, (B, T)).astype(np.float32)
            rec.record(step=step, logp=logp, logp_ref=logp - rng.exponential(0.5, (B, T)).astype(np.float32),
                       logp_old=logp + 0.01, advantages=rng.normal(size=B).astype(np.float32))
    return rec


@pytest.fixture()
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KLDIAG_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_record_analyse_and_report_on_s3_equal_local(s3, tmp_path: Path, cache_dir: Path, capsys) -> None:
    bucket = s3.bucket()
    uri = f"s3://{bucket}/runs/exp1"
    for rank in (0, 1):
        record(uri, range(8), rank=rank, world_size=2)
        record(tmp_path / "local", range(8), rank=rank, world_size=2)
    keys = s3.keys(bucket)
    assert "runs/exp1/run.json" in keys and any(k.startswith("runs/exp1/tokens/rank-1/part-") for k in keys)
    assert not any(".tmp" in k or "/." in k for k in keys)  # no temp objects: one PUT per part
    remote = kldiag.analyze(uri)
    local = kldiag.analyze(tmp_path / "local")
    assert remote.run_dir == f"s3://{bucket}/runs/exp1"
    assert remote.steps.equals(local.steps) and remote.sequences.equals(local.sequences)
    assert remote.flags.drop_columns([]).num_rows == local.flags.num_rows
    assert not any(k.startswith("runs/exp1/.kldiag") for k in s3.keys(bucket))  # the cache stays local
    assert list(cache_dir.rglob("*.part"))
    ctx = [[(o.step, o.seq, o.pos, o.before, o.after) for o in offenders(a, 5, 3)] for a in (remote, local)]
    assert ctx[0] == ctx[1] and any(b or f for *_, b, f in ctx[0])  # read from the objects' row groups
    assert cli(["report", uri, "-o", str(tmp_path / "r.html")]) == 0
    assert f"s3://{bucket}/runs/exp1" in (tmp_path / "r.html").read_text()
    capsys.readouterr()
    assert cli(["analyze", uri, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["run_dir"] == uri


def test_incremental_reanalysis_reads_only_new_parts(s3, cache_dir: Path) -> None:
    uri = f"s3://{s3.bucket()}/run"
    record(uri, range(6))
    first = kldiag.analyze(uri)
    assert first.files_new == first.files > 1
    again = kldiag.analyze(uri)
    assert again.files_new == 0 and again.steps.equals(first.steps)
    record(uri, range(6, 9))  # a later attempt recording new steps: nothing superseded
    grown = kldiag.analyze(uri)
    assert grown.files == first.files + 1 and grown.files_new == 1
    assert grown.steps.num_rows == 9 and grown.info["superseded_rows"] == 0


def test_restart_on_s3_supersedes(s3, cache_dir: Path) -> None:
    uri = f"s3://{s3.bucket()}/run"
    record(uri, range(6))
    record(uri, range(3, 6))
    a = kldiag.analyze(uri)
    assert a.superseded.to_pylist() == [{"rank": 0, "attempt": 0, "rows": 3 * B * T}]
    assert (a.steps.column("tokens").to_numpy() == B * T).all()


_KILLED_WRITER = """
import sys, numpy as np, kldiag
rec = kldiag.Recorder(sys.argv[1], rotate_rows=40)
step = 0
while True:
    rec.record(step=step, logp=-np.ones((2, 20), np.float32))
    if step == 3:
        print("ready", flush=True)
    step += 1
"""


def test_killed_writer_leaves_only_whole_objects(s3, tmp_path: Path, cache_dir: Path) -> None:
    bucket = s3.bucket()
    uri = f"s3://{bucket}/run"
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, uri], stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(Path(kldiag.__file__).parents[1])})
    try:
        assert proc.stdout.readline().strip() == b"ready"
        deadline = time.monotonic() + 60
        while len(F.list_parts(uri)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    parts = F.list_parts(uri)
    assert len(parts) >= 3
    table = kldiag.open_run(uri).read(strict=True)  # every visible object is a whole part
    assert table.num_rows == 40 * len(parts)


def test_analysis_while_a_writer_publishes(s3, cache_dir: Path) -> None:
    """A list that races a write sees a part or not, never a piece: no analysis fails."""
    uri = f"s3://{s3.bucket()}/run"
    record(uri, range(2))
    done = threading.Event()

    def write() -> None:
        record(uri, range(2, 40))
        done.set()

    thread = threading.Thread(target=write)
    thread.start()
    rows = []
    while not done.is_set():
        rows.append(kldiag.analyze(uri).info["rows"])
    thread.join()
    assert rows == sorted(rows) and kldiag.analyze(uri).info["rows"] == 40 * B * T


def test_missing_bucket_is_a_clear_error_without_credentials(s3, capsys) -> None:
    uri = "s3://no-such-bucket-kldiag/run"
    with pytest.raises(StorageError, match="no-such-bucket-kldiag.*does not exist") as err:
        Recorder(uri)
    assert SECRET not in str(err.value)
    with pytest.raises(StorageError, match="no-such-bucket-kldiag"):
        kldiag.open_run(uri)
    assert cli(["analyze", uri]) == 2
    msg = capsys.readouterr().err
    assert msg.count("\n") == 1 and "no-such-bucket-kldiag" in msg and SECRET not in msg


def test_credentials_never_reach_the_manifest(s3, cache_dir: Path) -> None:
    bucket = s3.bucket()
    uri = f"s3://{bucket}/run"
    record(uri, range(2))
    blob = kldiag.open_run(uri).store.read_bytes(F.MANIFEST).decode()
    assert SECRET not in blob and os.environ["AWS_ACCESS_KEY_ID"] not in blob


def test_unknown_scheme_names_the_extra_and_creates_nothing(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(StorageError, match=r"nosuchfs://.*(fsspec|install)"):
        Recorder("nosuchfs://bucket/run")
    with pytest.raises(StorageError, match="nosuchfs://"):
        kldiag.open_run("nosuchfs://bucket/run")
    assert list(tmp_path.iterdir()) == []  # never a local directory named after the scheme


def test_fsspec_filesystems_work_too() -> None:
    """Any fsspec scheme (here the in-memory one) records and analyses like a local run."""
    pytest.importorskip("fsspec")
    uri = "memory://kldiag-test/run"
    record(uri, range(4))
    a = kldiag.analyze(uri, kldiag.AnalysisConfig(use_cache=False))
    assert a.steps.num_rows == 4 and a.info["rows"] == 4 * B * T


def test_network_error_mid_run_is_counted_and_training_goes_on(tmp_path: Path) -> None:
    from s3util import moto_s3

    with moto_s3() as server:  # its own server: this test stops it mid-run
        uri = f"s3://{server.bucket()}/run"
        rec = Recorder(uri, rotate_steps=1)
        rec.record(step=0, logp=-np.ones((2, 3), np.float32))
        rec.flush()
        published = kldiag.open_run(uri).read()
        assert published.num_rows == 6
        server.server.stop()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(1, 4):
                rec.record(step=step, logp=-np.ones((2, 3), np.float32))
            rec.close()
        msgs = [str(w.message) for w in caught if "kldiag" in str(w.message)]
        assert len(msgs) == 1 and "cannot" in msgs[0] and SECRET not in msgs[0]
        assert rec.stats["write_errors"] >= 3 and rec.stats["lost_rows"] == 18
        server.server = _restarted(server)  # moto_s3 stops it again on exit


def _restarted(server):
    from moto.server import ThreadedMotoServer

    host, port = server.endpoint.rsplit("//", 1)[1].split(":")
    fresh = ThreadedMotoServer(ip_address=host, port=int(port), verbose=False)
    fresh.start()
    return fresh


def test_network_error_strict_raises(tmp_path: Path) -> None:
    from s3util import moto_s3

    with moto_s3() as server:
        uri = f"s3://{server.bucket()}/run"
        rec = Recorder(uri, rotate_steps=1, strict=True)
        server.server.stop()
        rec.record(step=0, logp=-np.ones((2, 3), np.float32))
        with pytest.raises(RecorderError, match=r"s3://.*/run"):
            rec.flush()
        with pytest.raises(RecorderError):  # strict: closing cannot write the statistics either
            rec.close()
        server.server = _restarted(server)
