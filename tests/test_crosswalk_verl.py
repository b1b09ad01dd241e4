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


REFUSED = [
    {"rollout_is": "tokens"},
    {"rollout_is": "token", "rollout_is_threshold": "2_0.5"},
    {"rollout_is": "token", "rollout_is_threshold": -1.0},
    {"rollout_is": "sequence", "rollout_is_threshold": "a_b"},
    {"rollout_rs": "token_k9", "rollout_rs_threshold": 1.0},
    {"rollout_rs": "token_k2"},
    {"rollout_rs": "token_k2", "rollout_rs_threshold": "0.5_2.0"},
    {"rollout_rs": "token_k1,seq_mean_k3", "rollout_rs_threshold": "0.5_2.0,0.1,0.2"},
    {"rollout_rs": "token_k1", "rollout_rs_threshold": "2.0_0.5"},
    {"rollout_rs": "seq_max_k3", "rollout_rs_threshold": 0.0},
]


@pytest.mark.parametrize("settings", REFUSED)
def test_configurations_verl_refuses_are_refused_at_set_with_a_fix(settings):
    """verl's own rollout_corr_helper raises on each; `--set` refuses it before reading the run."""
    lr = torch.zeros(2, 3, dtype=torch.float64)
    mask = torch.ones(2, 3, dtype=torch.float64)
    with pytest.raises((ValueError, TypeError)):
        if "rollout_is" in settings:
            helper.compute_rollout_correction_weights(lr, mask, rollout_is=settings["rollout_is"],
                                                      rollout_is_threshold=settings.get("rollout_is_threshold", 2.0))
        else:
            helper.compute_rollout_rejection_mask(lr, mask, rollout_rs=settings["rollout_rs"],
                                                  rollout_rs_threshold=settings.get("rollout_rs_threshold"))
    with pytest.raises(X.CrosswalkError, match="verl refuses this configuration"):
        X.parse_settings("verl", {k: str(v) for k, v in settings.items()})


def test_a_band_given_as_text_stays_a_band():
    """--set rollout_is_threshold=0.5_2 is verl's IcePop band, not the number 0.52."""
    assert X.parse_settings("verl", ["rollout_is=token", "rollout_is_threshold=0.5_2"]).rollout_is_threshold == "0.5_2"


def edge_batch(dtype, seed: int = 0):
    """A padded [B, T] step with a sequence with no response token, right padding, tokens where rollout ==
    old (ratio exactly 1.0: the upper edge of a "0.5_1.0" band), one far-off token, as `dtype` log-probs."""
    from kldiag.crosswalk.batch import StepBatch

    rng = np.random.default_rng(seed)
    b, t = 6, 8
    mask = np.arange(t)[None, :] < rng.integers(2, t + 1, b)[:, None]
    mask[2] = False
    old = -rng.exponential(1.0, (b, t))
    rollout = np.minimum(old + rng.normal(0, 0.5, (b, t)), -1e-6)
    rollout[0, :] = old[0, :]
    rollout[1, 1] = old[1, 1] - 6.0
    old, rollout = (np.where(mask, x, 0.0).astype(dtype).astype(np.float64) for x in (old, rollout))
    ref = np.where(mask, old + rng.normal(0, 0.3, (b, t)), 0.0).astype(dtype).astype(np.float64)
    n = len(mask)
    return StepBatch(0, np.arange(n), mask, old, old, ref, np.where(mask, rollout, np.nan), np.ones(n),
                     np.zeros(n, np.int64), np.zeros(n, np.int64))


EDGE_SETTINGS = [{"rollout_is": "token", "rollout_is_threshold": "0.5_1.0"},
                 {"rollout_is": "sequence", "rollout_is_threshold": "0.5_1.0"},
                 {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": "token_k1,seq_mean_k3",
                  "rollout_rs_threshold": "0.5_1.0,0.05"}]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("settings", EDGE_SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_rollout_corr_on_masked_padded_and_edge_tokens_equals_verls(dtype, settings):
    """verl's functions run on the batch in `dtype` (as a float32 trainer hands them); kldiag's float64 figure
    agrees to float32 rounding, and tokens on the band's edge count on the same side."""
    from kldiag.crosswalk import verl as VX

    b = edge_batch(dtype)
    tt = {np.float64: torch.float64, np.float32: torch.float32}[dtype]
    rollout = np.where(b.mask, b.logp_sampler, 0.0)
    _, _, metrics = helper.compute_rollout_correction_and_rejection_mask(
        old_log_prob=torch.tensor(b.logp_old, dtype=tt), rollout_log_prob=torch.tensor(rollout, dtype=tt),
        response_mask=torch.tensor(b.mask, dtype=tt), rollout_is=settings.get("rollout_is"),
        rollout_is_threshold=settings.get("rollout_is_threshold", 2.0),
        rollout_rs=settings.get("rollout_rs"), rollout_rs_threshold=settings.get("rollout_rs_threshold"))
    mine, _ = VX.step_metrics(b, VX.Settings(**settings))
    tol = 2e-7 if dtype == np.float64 else 2e-6  # verl takes some fractions with .float() (float32)
    for name, value in metrics.items():
        assert mine[name] == pytest.approx(float(value), rel=tol, abs=tol), name
