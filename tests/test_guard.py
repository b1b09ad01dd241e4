"""kldiag.Guard from a plain training loop: per-step figures as the analysis computes them,
acting at the onset, and never taking a run down on an error of its own."""

from __future__ import annotations

import numpy as np
import pytest

import kldiag
from kldiag.diagnosis import DiagnosisConfig
from kldiag.live import guard as G


def batch(rng, blow: bool = False, nan: bool = False):
    logp = -rng.exponential(0.7, (4, 16))
    d = rng.normal(0, 0.05, logp.shape)
    if blow:
        d[0, 3] = 8.0  # pi_theta = e^-8 pi_ref: |k3 weight| ~ 3000
        logp[0, 3] = -9.0
    logp_ref = np.minimum(logp + d, 0.0)
    logp_old = np.minimum(logp - rng.normal(0, 0.02, logp.shape), 0.0)
    if nan:
        logp[1, 2] = np.nan
    return logp.astype(np.float32), logp_ref.astype(np.float32), logp_old.astype(np.float32)


def loop(guard, steps, blow_from=None, nan_at=None, record_to=None):
    """A training loop: two micro-batches per step; stops when the guard says so."""
    rng = np.random.default_rng(0)
    rec = kldiag.Recorder(record_to, beta=0.04, estimator="k3", rotate_seconds=None) if record_to else None
    last = None
    for step in range(steps):
        for _ in range(2):
            logp, logp_ref, logp_old = batch(rng, blow_from is not None and step >= blow_from, step == nan_at)
            guard.observe(step, logp, logp_ref, logp_old)
            if rec:
                rec.record(step=step, logp=logp, logp_ref=logp_ref, logp_old=logp_old)
        last = step
        if guard.end_step(step) and guard.should_stop:
            break
    if rec:
        rec.close()
    guard.close()
    return last


def test_guard_stops_at_the_blowup_onset_and_agrees_with_the_analysis(tmp_path):
    calls = []
    guard = kldiag.Guard(on="blowup", action="log,stop,call", callback=calls.append)
    stopped = loop(guard, 30, blow_from=12, record_to=tmp_path)
    assert stopped == 12 and guard.should_stop and not guard.should_save
    assert [(e.kind, e.start) for e in calls] == [("blowup", 12)]
    a = kldiag.analyze(tmp_path, kldiag.AnalysisConfig(use_cache=False))
    mine = guard.table()
    for col in ("tokens", "weight_k3_abs_max", "weight_k3_is_abs_max", "blame_share", "flagged_frac",
                "nonfinite_count", "drift_abs_mean"):
        np.testing.assert_allclose(mine[col], a.steps.column(col).to_numpy(zero_copy_only=False).astype(float),
                                   rtol=1e-6, err_msg=col)


def test_guard_on_nonfinite_saves_without_stopping(capsys):
    guard = kldiag.Guard(on="nonfinite", action="log,save")
    assert loop(guard, 10, nan_at=4) == 9  # no stop: it ran to the end
    assert guard.should_save and not guard.should_stop and [e.start for e in guard.fired] == [4]
    assert "kldiag guard: nonfinite episode started at step 4" in capsys.readouterr().err


def test_healthy_loop_is_never_acted_upon():
    guard = kldiag.Guard(on="all")
    assert loop(guard, 25) == 24 and guard.fired == [] and not guard.should_stop


def test_an_internal_error_disables_the_guard_and_training_goes_on(monkeypatch):
    def broken(*a, **k):
        raise MemoryError("no room")

    monkeypatch.setattr(G, "step_sums", broken)
    guard = kldiag.Guard(on="blowup")
    with pytest.warns(UserWarning, match="guard disabled"):
        assert loop(guard, 20, blow_from=5) == 19
    assert not guard.should_stop and isinstance(guard.failed, MemoryError)


def test_options_are_checked():
    with pytest.raises(ValueError, match="choose from"):
        kldiag.Guard(on="blowupp")
    with pytest.raises(ValueError, match="unknown guard action"):
        kldiag.Guard(action="explode")
    with pytest.raises(ValueError, match="callback"):
        kldiag.Guard(action="call")
    g = kldiag.Guard(on="blowup", config=DiagnosisConfig(blowup_weight=5.0))
    assert g.context["config"].blowup_weight == 5.0
    g.close()
