"""engine_wrong_weights (kldiag/diagnosis/wrong_weights.py): the engine serves the reference model from a step."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from kldiag.analysis import AnalysisConfig, analyze
from kldiag.diagnosis import diagnose
from kldiag.diagnosis import wrong_weights as WW
from kldiag.diagnosis.core import reducers
from kldiag.mismatch import parity as P
from kldiag.tools import truth as T

SMALL = dict(steps=40, **T.TEST_SIZE)


def test_named_from_the_step_the_reference_is_served(tmp_path):
    sc = replace(T.SCENARIOS["engine_wrong_weights"], wrong_from=20, **SMALL)
    T.make_run(tmp_path / "r", sc)
    a = analyze(tmp_path / "r", AnalysisConfig(), reducers())
    dg = diagnose(a)
    assert dg.verdict == "unstable" and [c.cause for c in dg.causes] == ["engine_wrong_weights"]
    c = dg.causes[0]
    assert c.onset == 20 and c.severity == "critical"
    ev = c.evidence
    assert ev["d_ref_after"] < 0.25 * ev["d_old_after"] and ev["d_ref_before"] > ev["d_old_before"]
    # the distances are numpy's on the fit set's tokens
    ts = P.tokens_for(a)
    d = WW.distances(ts)
    ok = ts.mask & np.isfinite(ts.logp_ref) & (ts.step == 25)
    assert d["d_ref"][d["step"] == 25][0] == pytest.approx(np.abs(ts.logp_sampler - ts.logp_ref)[ok].mean())
    assert "#1695" not in c.fix and "resume" in c.fix  # a TRL run: TRL's words


def test_twin_close_reference_is_healthy(tmp_path):
    sc = replace(T.SCENARIOS["wrong_weights_twin"], **SMALL)
    T.make_run(tmp_path / "r", sc)
    dg = diagnose(analyze(tmp_path / "r", AnalysisConfig(), reducers()))
    assert dg.verdict == "healthy" and not dg.causes
