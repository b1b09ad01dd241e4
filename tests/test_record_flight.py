"""The flight recorder: a sampled recording keeps its last steps whole and publishes them as a bundle."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import kldiag
from kldiag.diagnosis import diagnose
from kldiag.live.guard import Guard
from kldiag.record import flight as FL


def batch(rng, step: int, blow: bool = False, b: int = 8, t: int = 12) -> dict[str, np.ndarray]:
    logp = -rng.exponential(0.7, (b, t)).astype(np.float32)
    ref = (logp + rng.normal(0, 0.05, (b, t))).astype(np.float32)
    if blow:  # pi_ref/pi_theta = e^8 on one token of every row: |k3 weight| ~ 3000
        logp[:, 5], ref[:, 5] = -9.0, -1.0
    return {"logp": logp, "logp_ref": ref, "logp_old": logp.copy(), "token_ids": rng.integers(0, 50, (b, t))}


def test_the_ring_keeps_the_last_steps_within_its_bounds():
    ring = FL.Ring(steps=3, max_bytes=1 << 30)
    rng = np.random.default_rng(0)
    for step in range(10):
        for micro in range(2):
            ring.add(step, micro, 0, batch(rng, step))
    held = ring.snapshot()
    assert sorted({e.step for e in held}) == [7, 8, 9] and len(held) == 6
    small = FL.Ring(steps=100, max_bytes=3 * held[0].nbytes)  # the byte bound wins: the oldest go first
    for step in range(10):
        small.add(step, 0, 0, batch(rng, step))
    assert [e.step for e in small.snapshot()] == [7, 8, 9] and small.nbytes <= small.max_bytes


def test_a_sampled_run_publishes_its_last_steps_whole_when_the_guard_fires(tmp_path, capsys):
    rng = np.random.default_rng(1)
    run = tmp_path / "run"
    rec = kldiag.Recorder(run, beta=0.04, estimator="k3", every_n_steps=4, seq_fraction=0.5, flight_steps=3,
                          rotate_seconds=None)
    guard = Guard(on="blowup", action="log,flight", recorder=rec, estimator="k3")
    assert rec.flight_on and rec.flight_nbytes == 0
    fired = []
    for step in range(12):
        data = batch(rng, step, blow=step >= 9)
        rec.record(step=step, **data)
        guard.observe(step, data["logp"], data["logp_ref"], data["logp_old"])
        fired += guard.end_step(step)
    rec.close()
    guard.close()
    assert [e.kind for e in fired] == ["blowup"] and len(guard.flights) == 1
    bundle = Path(guard.flights[0])
    assert bundle.parent == run / "flight" and bundle.name == "000000009-blowup"
    whole = kldiag.analyze(bundle)
    assert whole.steps.column("step").to_pylist() == [7, 8, 9] and whole.info["rows"] == 3 * 8 * 12
    assert diagnose(whole).verdict == "unstable"  # the bundle opens like any run
    summary = json.loads((bundle / FL.SUMMARY).read_text())
    assert summary["trigger"]["kind"] == "blowup" and summary["steps"] == [7, 8, 9]
    assert summary["worst_tokens"][0]["step"] == 9 and abs(summary["worst_tokens"][0]["weight_k3"]) > 1000
    assert summary["step_figures"]["step"][-1] == 9
    sampled = kldiag.analyze(run)  # the run itself still holds only its sample
    assert sampled.steps.column("step").to_pylist() == [0, 4, 8]
    assert not any("flight" in p.parts for p in (run / "tokens").rglob("*.parquet"))


def test_no_ring_without_sampling_and_a_flight_guard_needs_a_recorder(tmp_path):
    with kldiag.Recorder(tmp_path / "all", flight_steps=3) as rec:  # every row is recorded: nothing to keep
        rec.record(step=0, logp=np.full((2, 3), -1.0, np.float32))
    assert not rec.flight_on and rec.dump_flight() is None
    with pytest.raises(ValueError, match="recorder="):
        Guard(action="flight")
    with pytest.raises(ValueError, match="flight_steps"):
        kldiag.RecorderConfig(flight_steps=-1)
