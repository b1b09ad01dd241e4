"""engine_low_precision (kldiag/diagnosis/low_precision.py): a mismatch that steps with each weight version."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from kldiag.analysis import AnalysisConfig, analyze
from kldiag.diagnosis import diagnose
from kldiag.diagnosis import low_precision as LP
from kldiag.diagnosis.core import reducers
from kldiag.diagnosis.routing import apply_settings
from kldiag.tools import truth as T

SMALL = dict(steps=60, **T.TEST_SIZE)


def test_rollout_dtype_kinds():
    class M:
        config: dict = {}

    for value, kind in (("fp8", "low"), ("FP8-E4M3", "low"), ("mxfp8", "low"), ("int8", "low"),
                        ("bfloat16", "high"), ("bf16", "high"), ("torch.float16", "high"), (None, "unknown")):
        M.config = {"rollout_dtype": value}
        assert LP.rollout_dtype(M)[1] == kind, value


def test_jumps_are_the_windows_z():
    lv = {"level": np.array([0.1, 0.1, 0.3]), "se": np.array([0.01, 0.01, 0.02])}
    np.testing.assert_allclose(LP.jumps(lv), [0.0, 0.2 / np.sqrt(0.01 ** 2 + 0.02 ** 2)])


@pytest.fixture(scope="module")
def fp8_run(tmp_path_factory):
    """The FP8 scenario without the dtype in its manifest (for --set)."""
    run = tmp_path_factory.mktemp("lp") / "run"
    T.make_run(run, replace(T.SCENARIOS["engine_low_precision"], rollout_dtype="", **SMALL))
    return run


def test_named_with_the_dtype_set_and_not_for_bf16(fp8_run):
    a = analyze(fp8_run, AnalysisConfig(), reducers())
    apply_settings(a.manifest, ["rollout_dtype=fp8"])
    dg = diagnose(a)
    c = next(c for c in dg.causes if c.cause == "engine_low_precision")
    assert c.onset <= 5 and c.evidence["rollout_dtype"] == "fp8" and c.evidence["jump_share"] >= 0.3
    assert {"engine_mismatch", "engine_precision"}.isdisjoint({x.cause for x in dg.causes})
    b = analyze(fp8_run, AnalysisConfig(), reducers())
    apply_settings(b.manifest, ["rollout_dtype=bf16"])
    assert "engine_low_precision" not in {x.cause for x in diagnose(b).causes}


def test_cli_set_rollout_dtype(fp8_run):
    out = subprocess.run([sys.executable, "-m", "kldiag", "analyze", str(fp8_run), "--json", "--set",
                          "rollout_dtype=fp8"], capture_output=True, text=True, check=False)
    causes = {c["cause"]: c for c in json.loads(out.stdout)["diagnosis"]["causes"]}
    assert causes["engine_low_precision"]["evidence"]["rollout_dtype"] == "fp8"
    bad = subprocess.run([sys.executable, "-m", "kldiag", "analyze", str(fp8_run), "--set", "dtype=fp8"],
                         capture_output=True, text=True, check=False)
    assert bad.returncode != 0 and "rollout_dtype" in bad.stderr


def test_twin_flat_fp8_is_healthy(tmp_path):
    T.make_run(tmp_path / "r", replace(T.SCENARIOS["low_precision_twin"], **SMALL))
    dg = diagnose(analyze(tmp_path / "r", AnalysisConfig(), reducers()))
    assert dg.verdict == "healthy" and not dg.causes
