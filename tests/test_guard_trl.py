"""kldiag.Guard on a real TRL GRPOTrainer (examples/trl_grpo.py's tiny model and reward).

The reward punishes "the", a word the reference likes: with TRL's plain K3 penalty the
K3 weight 1 - pi_ref/pi_theta of the rare sampled "the" grows (past 20 near step 18, 60 by
step 28 of a 30-step run, seed 0), while k3_is's stays near 4 (10 at most); the guard is set
to a blow-up limit of 20 so the test stays short. It must
stop training at the first step where the recorded run crosses that limit, with a checkpoint
of that step and every row published. With use_bias_correction_kl=True (k3_is, weights of a
few units) the same guard never fires and the run goes to the end.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import kldiag
from kldiag.diagnosis import DiagnosisConfig
from kldiag.format import open_run
from kldiag.integrations.trl import attach

pytestmark = pytest.mark.slow

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import trl_grpo  # noqa: E402

LIMIT = 20.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return trl_grpo.build_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), seed=0)


def _guard() -> kldiag.Guard:
    return kldiag.Guard(on="blowup,nonfinite", action="log,save,stop", config=DiagnosisConfig(blowup_weight=LIMIT))


def test_guard_stops_a_k3_blowup_at_its_onset_with_a_checkpoint(model_dir, tmp_path):
    trainer = trl_grpo.make_trainer(model_dir, tmp_path / "out", steps=30, bias_correction=False)
    guard = _guard()
    attach(trainer, tmp_path / "run", guard=guard)
    trainer.train()
    stop = int(trainer.state.global_step)
    assert guard.should_stop and stop < 30
    a = kldiag.analyze(tmp_path / "run")
    steps = a.steps.column("step").to_numpy()
    w = a.steps.column("weight_k3_abs_max").to_numpy(zero_copy_only=False).astype(float)
    onset = int(steps[np.flatnonzero(w > LIMIT)[0]])
    assert stop == onset == guard.fired[0].start and guard.fired[0].kind == "blowup"
    assert int(steps[-1]) == stop  # the recorder closed: every row up to the stop is published
    assert (tmp_path / "out" / f"checkpoint-{stop}").is_dir()
    assert any("kldiag/guard" in h and f"blowup from step {stop}" in h["kldiag/guard"]
               for h in trainer.state.log_history)
    assert open_run(tmp_path / "run").manifest.config["guard_stop"]["step"] == stop


def test_guard_lets_the_bias_corrected_run_finish(model_dir, tmp_path):
    trainer = trl_grpo.make_trainer(model_dir, tmp_path / "out", steps=30, bias_correction=True)
    guard = _guard()
    attach(trainer, tmp_path / "run", guard=guard)
    trainer.train()
    assert int(trainer.state.global_step) == 30 and guard.fired == [] and guard.estimator == "k3_is"
    assert not guard.should_save and not list((tmp_path / "out").glob("checkpoint-*"))
    w = kldiag.analyze(tmp_path / "run").steps.column("weight_k3_is_abs_max").to_numpy(zero_copy_only=False)
    assert np.nanmax(w.astype(float)) < LIMIT  # its loss weights stay bounded: nothing to act on


def test_a_recorder_write_error_never_stops_the_run(model_dir, tmp_path, monkeypatch):
    from kldiag.record.recorder import Recorder

    def broken(self, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(Recorder, "record", broken)
    trainer = trl_grpo.make_trainer(model_dir, tmp_path / "out", steps=3, bias_correction=True)
    guard = _guard()
    with pytest.warns(UserWarning, match="recording failed"):
        attach(trainer, tmp_path / "run", guard=guard)
        trainer.train()
    assert int(trainer.state.global_step) == 3 and not guard.should_stop and guard.failed is None
    assert sorted(guard.steps) == [1, 2, 3]  # the guard still saw every step


def test_a_sampled_run_gets_its_last_steps_whole_when_the_guard_stops_it(model_dir, tmp_path):
    """every_n_steps=3 with flight_steps=4: the run keeps a third of its steps, and the guard's blow-up
    publishes the last 4 steps, every row, as a bundle that analyses like any run."""
    import json

    trainer = trl_grpo.make_trainer(model_dir, tmp_path / "out", steps=30, bias_correction=False)
    guard = _guard()
    attach(trainer, tmp_path / "run", guard=guard, every_n_steps=3, flight_steps=4)
    trainer.train()
    stop = int(trainer.state.global_step)
    assert guard.should_stop and "flight" in guard.actions and len(guard.flights) == 1
    bundle = kldiag.analyze(guard.flights[0])
    held = bundle.steps.column("step").to_pylist()
    assert held == list(range(stop - 3, stop + 1))  # the 4 steps up to the onset, each of them
    w = bundle.steps.column("weight_k3_abs_max").to_numpy(zero_copy_only=False).astype(float)
    assert w[-1] > LIMIT
    summary = json.loads((tmp_path / "run" / "flight" / f"{stop:09d}-blowup" / "flight.json").read_text())
    assert summary["trigger"]["start"] == stop and summary["worst_tokens"][0]["step"] == stop
    assert all(s % 3 == 0 for s in kldiag.analyze(tmp_path / "run").steps.column("step").to_pylist())
