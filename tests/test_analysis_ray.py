"""The Ray engine (kldiag/analysis/runtime/ray.py) on a local Ray started here (2 CPUs, one
session for the module): equal to the local engine on the shipped samples, on a multi-rank
run with a corrupt part, on a run in S3; a worker SIGKILLed mid-pass is retried and the result
equals the local engine's; a worker that keeps dying is retried, then its part named;
without Ray, --engine ray names the extra and `import kldiag` never imports Ray."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from analysis_same import assert_same_analysis

import kldiag
from kldiag.analysis import AnalysisConfig
from kldiag.analysis import protocol as reduce
from kldiag.analysis.core import partials
from kldiag.analysis.pipeline import thresholds
from kldiag.analysis.runtime import ray as ray_engine
from kldiag.cli import build_parser, main
from kldiag.cli import engine_opts as engines
from kldiag.errors import CorruptPartError, EngineError
from kldiag.format import PartInfo, open_run
from kldiag.tools.synth import SynthConfig, make_run

SAMPLES = Path(__file__).resolve().parent.parent / "sample_logs"
LOCAL, RAY = AnalysisConfig(use_cache=False), AnalysisConfig(use_cache=False, engine="ray")


@pytest.fixture(scope="module")
def ray_session(s3):
    """One local Ray for the module, started after the S3 server so its workers see the
    AWS environment (as a cluster's nodes would have their own); shut down after."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False,
             object_store_memory=100 * 1024 * 1024)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def multirank(tmp_path_factory) -> Path:
    """3 ranks, small parts (steps span parts of a rank's), a corrupt part in the middle."""
    run = tmp_path_factory.mktemp("ray") / "run"
    make_run(run, SynthConfig(steps=6, seqs_per_step=8, seq_len=(5, 30), ranks=3, rows_per_file=200,
                              blowup_step=3, blowup_frac=0.05, nonfinite=((2, "logp"),)))
    parts = open_run(run).parts()
    Path(parts[len(parts) // 2].path).write_bytes(b"PAR1 torn")
    return run


def analyses(run, **kw):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        local = kldiag.analyze(run, AnalysisConfig(**{"use_cache": False, **kw}))
        remote = kldiag.analyze(run, AnalysisConfig(**{"use_cache": False, **kw}, engine="ray"))
    return local, remote, [str(w.message) for w in caught]


@pytest.mark.parametrize("sample", ["demo_k3", "demo_k3_is", "trl_grpo_tiny"])
def test_shipped_samples_equal_local(ray_session, sample):
    local, remote, _ = analyses(SAMPLES / sample, per_rank=True, trainer_compatible=True)
    assert_same_analysis(remote, local)


def test_multirank_run_with_corrupt_part(ray_session, multirank, tmp_path):
    local, remote, messages = analyses(multirank, per_rank=True)
    assert len(remote.skipped) == 1 and remote.skipped == local.skipped
    assert len(messages) == 2 and messages[0] == messages[1] and remote.skipped[0] in messages[0]
    assert_same_analysis(remote, local)
    for cfg in (LOCAL, RAY):  # strict: the same error, naming the part
        with pytest.raises(CorruptPartError, match=Path(remote.skipped[0]).name):
            kldiag.analyze(multirank, AnalysisConfig(strict=True, use_cache=False, engine=cfg.engine))
    run = tmp_path / "run"
    shutil.copytree(multirank, run)
    with pytest.warns(UserWarning):
        first = kldiag.analyze(run, AnalysisConfig(engine="ray"))  # Ray tasks fill the cache
    with pytest.warns(UserWarning):
        cached = kldiag.analyze(run)  # the local engine reads it: only the corrupt part is tried again
    # files_new counts the parts analysed now: the corrupt part is tried again each time but never analysed
    assert first.files_new == first.files - len(first.skipped) and cached.files_new == 0 and cached.skipped
    with pytest.warns(UserWarning):
        assert_same_analysis(cached, kldiag.analyze(run, LOCAL))


def test_restart_superseded_rows_equal_local(ray_session, tmp_path):
    """Superseded steps travel with each part (PartInfo.exclude) into the Ray tasks."""
    cfg = SynthConfig(steps=6, seqs_per_step=6, seq_len=(5, 30), ranks=2, rows_per_file=150)
    make_run(tmp_path / "run", cfg)
    make_run(tmp_path / "run", dataclasses.replace(cfg, attempt=1, seed=1), steps=range(3, 5), manifest=False)
    local, remote, _ = analyses(tmp_path / "run", per_rank=True)
    assert remote.info["superseded_rows"] > 0
    assert_same_analysis(remote, local)


@dataclass(frozen=True)
class DyingPart(PartInfo):
    """A part whose reader kills its worker process, counting the attempts in `log`."""

    log: str = ""

    def open(self):
        with open(self.log, "a") as f:
            f.write("x")
        os._exit(1)


def test_dying_worker_is_retried_then_the_part_named(ray_session, multirank, tmp_path):
    ray_session.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
    run = open_run(multirank)
    good = run.parts()[0]
    log = tmp_path / "attempts"
    dying = DyingPart(**{**good.__dict__, "path": str(tmp_path / "part-dying.parquet")}, log=str(log))
    red = partials.AnalysisReducer(thresholds(AnalysisConfig(), run.manifest))
    out = dict(ray_engine.compute([(good, [red]), (dying, [red])], 1 << 20))
    assert partials.from_arrays(out[0][red.name]).rows > 0
    assert isinstance(out[1], EngineError) and "part-dying.parquet" in str(out[1])
    assert log.read_text() == "x" * (ray_engine.MAX_RETRIES + 1)
    with pytest.raises(EngineError, match="part-dying.parquet failed"):
        list(ray_engine.compute([(dying, [red]), (good, [red])], 1 << 20, strict=True))


@dataclass(frozen=True)
class KillOnce:
    """A reducer riding along in the analysis's read: counts rows, and the first time a task reads
    the second batch of `part` it leaves `marker` and SIGKILLs its worker (the analysis reducer has
    folded a batch of that part already: killed mid-pass). Its later attempts find the marker."""

    marker: str
    part: str
    name: str = "kill_once"
    version: int = 1
    columns: tuple[str, ...] = ("step",)

    def settings(self) -> dict:
        return {}

    def start(self, part) -> dict:
        return {"part": str(part.path), "rows": 0, "batches": 0}

    def add(self, state: dict, batch) -> None:
        state["batches"] += 1
        if state["part"] == self.part and state["batches"] == 2 and not os.path.exists(self.marker):
            Path(self.marker).write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        state["rows"] += batch.num_rows

    def finish(self, state: dict, dropped: int) -> dict:
        return {"rows": np.array([state["rows"]], np.int64)}

    def merge(self, parts) -> dict:
        return {"rows": np.array([sum(int(p["rows"][0]) for p in parts)], np.int64)}


def test_task_killed_mid_pass_is_retried_and_equals_local(ray_session, tmp_path):
    ray_session.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
    make_run(tmp_path / "run", SynthConfig(steps=4, seqs_per_step=6, seq_len=(10, 40), ranks=2, rows_per_file=200,
                                           blowup_step=2, blowup_frac=0.05))
    parts = open_run(tmp_path / "run").parts()
    victim, marker = str(parts[1].path), tmp_path / "killed"
    cfg = AnalysisConfig(batch_size=64, per_rank=True)  # parts of up to 200 rows: several batches each
    local = kldiag.analyze(tmp_path / "run", dataclasses.replace(cfg, use_cache=False))
    remote = kldiag.analyze(tmp_path / "run", dataclasses.replace(cfg, engine="ray"),
                            reducers=[KillOnce(str(marker), victim)])
    assert marker.exists() and int(marker.read_text()) != os.getpid()  # a Ray worker was killed, not this process
    assert remote.skipped == [] and remote.files_new == len(parts)
    assert_same_analysis(remote, local)
    assert int(remote.reduced["kill_once"]["rows"][0]) == local.info["rows"]  # the killed attempt added nothing
    cache = open_run(tmp_path / "run").cache_dir()
    assert not list(cache.rglob("*.tmp"))  # the driver writes each partial atomically, once
    assert all(reduce.load_arrays(f) is not None for f in cache.rglob("*.part"))
    cached = kldiag.analyze(tmp_path / "run", cfg)  # the local engine reads back what the Ray tasks gave
    assert cached.files_new == 0
    assert_same_analysis(cached, local)


def test_run_in_s3_through_ray(ray_session, s3, multirank, tmp_path, monkeypatch):
    import boto3

    monkeypatch.setenv("KLDIAG_CACHE_DIR", str(tmp_path / "cache"))
    bucket = s3.bucket()
    client = boto3.client("s3", endpoint_url=s3.endpoint)
    for f in multirank.rglob("*"):
        if f.is_file() and ".kldiag" not in f.parts:
            client.upload_file(str(f), bucket, f"run/{f.relative_to(multirank).as_posix()}")
    uri = f"s3://{bucket}/run"
    with pytest.warns(UserWarning, match="skipping part s3://"):
        remote = kldiag.analyze(uri, AnalysisConfig(engine="ray"))
    local, _, _ = analyses(multirank)
    assert remote.run_dir == uri and remote.skipped == [f"{uri}/{Path(local.skipped[0]).relative_to(multirank)}"]
    remote.skipped = local.skipped
    assert_same_analysis(remote, local)
    assert list((tmp_path / "cache").rglob("*.part"))  # partials cached locally, by the driver


def test_cli_analyze_and_report_with_ray(ray_session, capsys, tmp_path):
    run = str(SAMPLES / "demo_k3")
    assert main(["analyze", run, "--engine", "ray", "--no-cache", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert main(["analyze", run, "--no-cache", "--json"]) == 0
    assert got == json.loads(capsys.readouterr().out)
    assert main(["report", run, "--engine", "ray", "-o", str(tmp_path / "r.html")]) in (0, 1)
    assert (tmp_path / "r.html").stat().st_size > 0


def test_dashboard_hands_the_engine_to_the_app():
    from kldiag.cli.dashboard import _env

    args = build_parser().parse_args(["dashboard", "r", "--engine", "ray", "--ray-address", "ray://head:10001"])
    env = _env(args)
    assert engines.from_env(env) == {"engine": "ray", "ray_address": "ray://head:10001"}
    assert engines.from_env({}) == {"engine": "local", "ray_address": None}
    with pytest.raises(ValueError, match="KLDIAG_ENGINE"):
        engines.from_env({engines.ENGINE_ENV: "spark"})


def test_without_ray_the_error_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    with pytest.raises(EngineError, match=r"pip install 'kldiag\[ray\]'"):
        kldiag.analyze(SAMPLES / "demo_k3", RAY)
    assert main(["analyze", str(SAMPLES / "demo_k3"), "--engine", "ray", "--no-cache"]) == 2
    assert "kldiag[ray]" in capsys.readouterr().err
    with pytest.raises(ValueError, match="engine"):
        kldiag.analyze(SAMPLES / "demo_k3", AnalysisConfig(engine="spark"))


def test_import_and_local_engine_never_import_ray():
    code = ("import sys, kldiag; kldiag.analyze(sys.argv[1], kldiag.AnalysisConfig(use_cache=False)); "
            "import kldiag.cli; kldiag.cli.build_parser(); assert 'ray' not in sys.modules, 'ray imported'")
    subprocess.run([sys.executable, "-c", code, str(SAMPLES / "demo_k3")], check=True, timeout=120)


def test_dashboard_app_analyses_with_ray(ray_session, monkeypatch):
    """The app reads the engine from the environment `kldiag dashboard --engine ray` sets."""
    from streamlit.testing.v1 import AppTest

    calls = []
    real = ray_engine.compute
    monkeypatch.setattr(ray_engine, "compute", lambda *a, **kw: calls.append(len(a[0])) or real(*a, **kw))
    monkeypatch.setenv("KLDIAG_RUNS", str(SAMPLES / "demo_k3_is"))
    monkeypatch.setenv(engines.ENGINE_ENV, "ray")
    at = AppTest.from_file(str(SAMPLES.parent / "app" / "main.py"), default_timeout=60).run()
    assert not at.exception, [e.value for e in at.exception]
    assert calls  # the analysis went through the Ray engine (no task when every part is cached)


class _FakeRay:
    """The few calls compute() makes, one task done per wait; `up` is ray.is_initialized()."""

    def __init__(self):
        self.up, self.cancelled = True, []

    def is_initialized(self):
        return self.up

    def wait(self, pending, num_returns):
        return pending[:1], pending[1:]

    def cancel(self, ref):
        self.cancelled.append(ref)


def test_a_generator_closed_after_shutdown_starts_no_ray(monkeypatch):
    """An abandoned compute() closed by the garbage collector after ray.shutdown() cancels nothing: ray.cancel
    would auto-start a local Ray in this process (it did, in the middle of a later test)."""
    fake = _FakeRay()
    monkeypatch.setattr(ray_engine, "connect", lambda address=None: fake)
    monkeypatch.setattr(ray_engine, "task", lambda ray: type("T", (), {"remote": staticmethod(lambda *a: object())}))
    monkeypatch.setattr(ray_engine, "_get", lambda ray, part, ref: {})
    jobs = [(None, []) for _ in range(4)]
    for up, cancelled in ((True, 2), (False, 0)):
        fake.up, fake.cancelled = True, []
        gen = ray_engine.compute(jobs, 1)
        assert next(gen) == (0, {})  # one task back, two still pending after the next wait
        assert next(gen) == (1, {})
        fake.up = up
        gen.close()
        assert len(fake.cancelled) == cancelled
