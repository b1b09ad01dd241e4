"""The local engine's threads: as many as the cores this process may use (its affinity, not the
machine's count) or AnalysisConfig.threads; the removed process pool (workers) is refused with one
line naming the replacement, from the API and from the CLI."""

from __future__ import annotations

import pytest

import kldiag
from kldiag.analysis import AnalysisConfig
from kldiag.analysis.runtime import part_fold, worker
from kldiag.cli import main
from kldiag.tools.synth import SynthConfig, make_run


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    path = tmp_path_factory.mktemp("threads") / "run"
    make_run(path, SynthConfig(steps=6, seqs_per_step=6, seq_len=(8, 30), rows_per_file=200, vocab_size=0))
    return path


@pytest.fixture
def pools(monkeypatch) -> list[int]:
    """The thread count of every fold_parts call of the local engine."""
    seen: list[int] = []
    real = part_fold.fold_parts

    def spy(jobs, batch_size, errors, threads=None):
        seen.append(threads)
        return real(jobs, batch_size, errors, threads=threads)

    monkeypatch.setattr(part_fold, "fold_parts", spy)
    return seen


def test_thread_count_follows_the_affinity_and_the_config(run, pools, monkeypatch):
    monkeypatch.setattr(worker.os, "sched_getaffinity", lambda pid: {3, 5, 7}, raising=False)
    assert worker.cpus() == 3
    default = kldiag.analyze(run, AnalysisConfig(use_cache=False))
    one = kldiag.analyze(run, AnalysisConfig(use_cache=False, threads=1))
    assert pools == [3, 1]
    assert default.steps.equals(one.steps) and default.sequences.equals(one.sequences)
    monkeypatch.setattr(worker.os, "sched_getaffinity", lambda pid: (_ for _ in ()).throw(OSError()))
    monkeypatch.setattr(worker.os, "cpu_count", lambda: 5)
    assert worker.cpus() == 5  # no affinity to read: the machine's count


def test_workers_is_refused_naming_threads(run, capsys):
    with pytest.raises(ValueError, match=r"workers is gone.*threads=N"):
        kldiag.analyze(run, AnalysisConfig(workers=2))
    with pytest.raises(ValueError, match="threads"):
        kldiag.analyze(run, AnalysisConfig(threads=0))
    for argv in (["--workers", "2"], ["--workers", "1"], ["--threads", "0"]):
        with pytest.raises(SystemExit) as e:
            main(["analyze", str(run), *argv])
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and err[0].startswith("kldiag: error: "), err
        assert "--threads" in err[0]
    assert main(["analyze", str(run), "--threads", "2", "--no-cache", "--json"]) == 0
