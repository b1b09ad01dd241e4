"""Live TensorBoard histograms from the TRL hook: binning equals the analysis' histograms, and a
real GRPOTrainer with report_to="tensorboard" gets kldiag/<name> histograms at every logged
step beside TRL's own scalars (read back with TensorBoard's EventAccumulator)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from kldiag import estimators as E  # noqa: E402
from kldiag.analysis.types import HIST_EDGES  # noqa: E402
from kldiag.integrations.trl.histograms import LiveHistograms, token_counts  # noqa: E402

NAMES = ("d", "weight_k3_abs", "weight_k3_is_abs", "rho")


def _acc(logdir) -> EventAccumulator:
    acc = EventAccumulator(str(logdir), size_guidance={"histograms": 0, "scalars": 0})
    acc.Reload()
    return acc


def _batch(seed: int):
    rng = np.random.default_rng(seed)
    logp = -rng.exponential(1.0, (3, 7))
    logp_ref = logp + rng.normal(0, 1.0, logp.shape)
    logp_old = logp + rng.normal(0, 0.1, logp.shape)
    mask = rng.random(logp.shape) > 0.2
    return logp, logp_ref, logp_old, mask


def test_token_counts_equal_searchsorted_on_the_shared_edges():
    logp, logp_ref, logp_old, mask = _batch(0)
    got = token_counts(logp, logp_ref, logp_old, mask)
    s, r, o = logp[mask], logp_ref[mask], logp_old[mask]
    want = {"d": E.log_ratio(s, r), "weight_k3_abs": np.abs(E.weight_k3(s, r)),
            "weight_k3_is_abs": np.abs(E.weight_k3_is(s, r, o)), "rho": E.rho(s, o)}
    for name, v in want.items():
        idx = np.searchsorted(HIST_EDGES[name], v, side="right")
        np.testing.assert_array_equal(got[name], np.bincount(idx, minlength=len(HIST_EDGES[name]) + 1))
    assert set(token_counts(logp, None, None, mask)) == {"rho"}  # no reference: only rho


def test_counts_between_logs_become_one_histogram_per_step(tmp_path):
    trainer = SimpleNamespace(state=SimpleNamespace(global_step=0), accelerator=SimpleNamespace(is_main_process=True),
                              args=SimpleNamespace(output_dir=str(tmp_path)))
    live = LiveHistograms(tmp_path / "tb")
    for step in (1, 2):
        trainer.state.global_step = step
        for seed in range(3):  # three micro-batches between two logs
            live.observe(*_batch(10 * step + seed))
        assert live.flush(trainer) == 4
    assert live.flush(trainer) == 0  # nothing observed since
    live.close()
    acc = _acc(tmp_path / "tb")
    for name in NAMES:
        events = acc.Histograms(f"kldiag/{name}")
        assert [e.step for e in events] == [1, 2]
    n = sum(int(_batch(s)[3].sum()) for s in (10, 11, 12))
    assert acc.Histograms("kldiag/d")[0].histogram_value.num == n


@pytest.mark.slow
def test_real_trainer_logs_histograms_beside_trl_scalars(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_integrations_trl import build_tiny_model, make_trainer

    from kldiag.integrations import trl as kt

    model = build_tiny_model(tmp_path / "model", seed=0)
    trainer = make_trainer(model, tmp_path / "out", report_to=["tensorboard"], max_steps=3)
    kt.attach(trainer, tmp_path / "run", histograms=True)
    trainer.train()
    logdirs = {p.parent for p in (tmp_path / "out").rglob("events.out.tfevents.*")}
    assert len(logdirs) == 1  # the trainer's own TensorBoard directory
    acc = _acc(logdirs.pop())
    assert "train/kl" in acc.Tags()["scalars"]
    for name in NAMES:
        assert [e.step for e in acc.Histograms(f"kldiag/{name}")] == [1, 2, 3]
