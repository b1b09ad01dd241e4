"""Shared fixtures. app_*: small runs for the dashboard tests (test_views, test_app, test_browser)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kldiag.format import Manifest, write_manifest, write_vocab
from kldiag.tools.synth import SynthConfig, make_run

# Model output is untrusted: the dashboard must show this piece as text, never as a tag.
APP_EVIL_PIECE = "<img src=x onerror=alert(1)>"
APP_VOCAB_SIZE = 64


def app_vocab() -> list[str]:
    """Pieces of the test vocab: every 8th one is the hostile piece."""
    return [APP_EVIL_PIECE if i % 8 == 0 else f"tok{i} " for i in range(APP_VOCAB_SIZE)]


def app_make_runs(root: Path) -> dict[str, Path]:
    """A K3 run that blows up at step 8, a healthy k3_is run, an on-policy run with no
    reference, an empty run and a directory that is not a run."""
    small = {"steps": 12, "seqs_per_step": 16, "seq_len": (8, 24), "vocab_size": APP_VOCAB_SIZE, "rows_per_file": 1500}
    runs = {
        "k3": (SynthConfig(**small, blowup_step=8, blowup_frac=0.02, seed=1)),
        "k3_is": (SynthConfig(**small, estimator="k3_is", seed=2)),
        "noref": (SynthConfig(**small, reference=False, on_policy=True, seed=3)),
    }
    out = {}
    for name, cfg in runs.items():
        make_run(root / name, cfg)
        write_vocab(root / name, app_vocab())
        out[name] = root / name
    write_manifest(root / "empty", Manifest(trainer={"name": "test"}))
    out["empty"] = root / "empty"
    (root / "notarun").mkdir()
    (root / "notarun" / "hello.txt").write_text("not a run")
    out["notarun"] = root / "notarun"
    return out


@pytest.fixture(scope="session")
def app_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return app_make_runs(tmp_path_factory.mktemp("app_runs"))


@pytest.fixture(scope="session")
def s3():
    """A real S3 server (moto, 127.0.0.1) for the whole session; tests make their own buckets."""
    from s3util import moto_s3

    with moto_s3() as server:
        yield server


@pytest.fixture(autouse=True)
def _restore_main_module():
    """Streamlit's AppTest runs the app as `__main__` and leaves it in sys.modules; a process
    pool started later (analyze(workers=2)) then re-runs app/main.py in each worker, which
    dies on its imports. Every test gets back the `__main__` it started with."""
    main = sys.modules["__main__"]
    yield
    sys.modules["__main__"] = main

