"""mixed_version_rollout (kldiag/diagnosis/versions.py, version_jumps.py): sequences generated across a weight
update, with per-token versions and without (a jump inside the sequence); small known-truth runs."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from kldiag.analysis import AnalysisConfig, analyze
from kldiag.diagnosis import diagnose
from kldiag.diagnosis import version_jumps as VJ
from kldiag.diagnosis.core import reducers
from kldiag.tools import truth as T

SMALL = dict(steps=40, **T.TEST_SIZE)


def _diagnosed(tmp_path, name, **kw):
    sc = replace(T.SCENARIOS[name], **{**SMALL, **kw})
    T.make_run(tmp_path / name, sc)
    return diagnose(analyze(tmp_path / name, AnalysisConfig(), reducers()))


@pytest.mark.parametrize("versions", [True, False])
def test_mixed_versions_named_with_their_evidence(tmp_path, versions):
    dg = _diagnosed(tmp_path, "mixed_version_rollout", versions=versions)
    c = next(c for c in dg.causes if c.cause == "mixed_version_rollout")
    assert c.onset <= 2 and c.severity == "warning" and "engine_mismatch" not in {x.cause for x in dg.causes}
    ev = c.evidence
    if versions:  # the truth: 30% of the groups change version at a uniform position; 0.3 nats of logit noise after
        assert 0.2 < ev["mixed_share"] < 0.4 and ev["versions_max"] == 2
        assert ev["mixed_mismatch_abs_mean"] > 3 * ev["single_mismatch_abs_mean"]
        assert ev["mixed_mismatch_after_change"] > 5 * ev["mixed_mismatch_before_change"]
        assert ev["positions"]["examples"] and ev["stamps"] == "per-token policy_version"
    else:
        assert ev["stamps"].startswith("none") and ev["level_after_jump"] > 5 * ev["level_before_jump"]
        assert 0.05 <= ev["jump_share"] < 0.3


@pytest.mark.parametrize("versions", [True, False])
def test_twin_is_healthy(tmp_path, versions):
    dg = _diagnosed(tmp_path, "mixed_version_twin", versions=versions)
    assert dg.verdict == "healthy" and not dg.causes


def test_sequence_jumps_finds_the_split():
    """Two sequences of 20 tokens: one steps from 0.01 to 0.2 at position 12, one is flat; numpy on the split."""
    rng = np.random.default_rng(0)
    x = np.abs(rng.normal(0, 0.01, 40))
    x[12:20] = np.abs(rng.normal(0, 0.2, 8))
    step, seq, pos = np.zeros(40, np.int64), np.repeat([0, 1], 20), np.tile(np.arange(20), 2)
    sj = VJ.sequence_jumps(step, seq, pos, x)
    assert sj["jumps"].tolist() == [True, False] and sj["pos"][0] == 12
    assert sj["before"][0] == pytest.approx(x[:12].mean()) and sj["after"][0] == pytest.approx(x[12:20].mean())
    y = np.log(x[:20] + VJ.LOG_FLOOR)
    sd = np.sqrt((((y[:12] - y[:12].mean()) ** 2).sum() + ((y[12:] - y[12:].mean()) ** 2).sum()) / 18)
    assert sj["t"][0] == pytest.approx((y[12:].mean() - y[:12].mean()) / (sd * np.sqrt(1 / 12 + 1 / 8)))
