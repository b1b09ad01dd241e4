"""kldiag.crosswalk("verl") against verl 0.9.1's own functions on the same tokens (sample_logs/demo_k3).

verl's helpers run on CPU: rollout_corr_helper.compute_rollout_correction_and_rejection_mask,
utils/debug/metrics.calculate_debug_metrics, core_algos.kl_penalty + agg_loss. Each recorded step is
padded as verl pads a batch and handed to them as float64 tensors. Skipped when verl is not importable.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import kldiag.crosswalk as X
from kldiag.crosswalk.batch import pad
from kldiag.mismatch import tokenset as TS

verl = pytest.importorskip("verl")
torch = pytest.importorskip("torch")
helper = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")
core = pytest.importorskip("verl.trainer.ppo.core_algos")
debug = pytest.importorskip("verl.utils.debug.metrics")

RUN = "sample_logs/demo_k3"
STEPS = list(range(0, 200, 13))  # a spread of steps keeps the test fast

CORR_SETTINGS = [
    {},
    {"rollout_is": "token", "rollout_is_threshold": 2.0},
    {"rollout_is": "sequence", "rollout_is_threshold": 2.0},
    {"rollout_is": "token", "rollout_is_threshold": "0.5_2.0", "rollout_is_batch_normalize": True},
    {"rollout_is": "sequence", "rollout_is_threshold": "0.5_5.0", "rollout_is_batch_normalize": True},
    {"rollout_rs": "token_k1,seq_mean_k3,seq_max_k2,seq_sum_k1", "rollout_rs_threshold": "0.5_2.0,0.05,0.5,0.2_5.0"},
    {"rollout_is": "token", "rollout_is_threshold": 1.5, "rollout_rs": "seq_sum_k2,token_k3,seq_max_k3",
     "rollout_rs_threshold": "2.0,0.1,0.3"},
    {"rollout_rs": "token_k2", "rollout_rs_threshold": 0.01},
]


@pytest.fixture(scope="module")
def batches():
    ts = TS.load(RUN)
    steps = dict(ts.step_slices())
    return {s: pad(ts, steps[s], s) for s in STEPS}


def t64(x):
    return torch.tensor(np.ascontiguousarray(x), dtype=torch.float64)


def close(mine, theirs, name, step):
    if theirs is None or (isinstance(theirs, float) and math.isnan(theirs)):
        assert mine is None, (name, step, mine)
        return
    assert mine == pytest.approx(float(theirs), rel=1e-9, abs=1e-12), (name, step)


@pytest.mark.parametrize("settings", CORR_SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()) or "off")
def test_rollout_corr_metrics_equal_verls(batches, settings):
    table = X.crosswalk(RUN, "verl", **settings)
    rows = {r["step"]: r for r in table.to_pylist()}
    for step, b in batches.items():
        rollout = np.where(b.mask, b.logp_sampler, 0.0)
        _, _, metrics = helper.compute_rollout_correction_and_rejection_mask(
            old_log_prob=t64(b.logp_old), rollout_log_prob=t64(rollout), response_mask=t64(b.mask),
            rollout_is=settings.get("rollout_is"), rollout_is_threshold=settings.get("rollout_is_threshold", 2.0),
            rollout_is_batch_normalize=settings.get("rollout_is_batch_normalize", False),
            rollout_rs=settings.get("rollout_rs"), rollout_rs_threshold=settings.get("rollout_rs_threshold"))
        assert metrics, step
        mine = {k: v for k, v in rows[step].items() if k.startswith("rollout_corr/")}
        assert set(mine) == set(metrics), set(mine) ^ set(metrics)
        for name, value in metrics.items():
            close(mine[name], value, name, step)


def test_debug_metrics_equal_verls(batches):
    from verl.protocol import DataProto

    rows = {r["step"]: r for r in X.crosswalk(RUN, "verl").to_pylist()}
    for step, b in batches.items():
        rollout = np.where(b.mask, b.logp_sampler, 0.0)
        data = DataProto.from_dict(tensors={"rollout_log_probs": t64(rollout), "old_log_probs": t64(b.logp_old),
                                            "response_mask": torch.tensor(b.mask.astype(np.int64)),
                                            "responses": torch.zeros(b.mask.shape, dtype=torch.int64)})
        for name, value in debug.calculate_debug_metrics(data).items():
            close(rows[step][name], value, name, step)


@pytest.mark.parametrize("kl_loss_type", ["low_var_kl", "k1", "k2+", "abs", "k3+"])
@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm",
                                           "seq-mean-token-mean"])
def test_actor_kl_loss_equals_verls(batches, kl_loss_type, loss_agg_mode):
    rows = {r["step"]: r for r in X.crosswalk(RUN, "verl", kl_loss_type=kl_loss_type,
                                             loss_agg_mode=loss_agg_mode).to_pylist()}
    for step, b in batches.items():
        kld = core.kl_penalty(t64(b.logp), t64(np.where(b.mask, b.logp_ref, 0.0)), kl_loss_type)
        loss = core.agg_loss(kld, t64(b.mask), loss_agg_mode)
        close(rows[step]["actor/kl_loss"], float(loss), "actor/kl_loss", step)
