"""The slime hook's `kldiag/...` metrics in slime's logged train-step metrics.

slime is not on PyPI and needs Megatron: as in test_integrations_slime.py, the slime code the metrics
path goes through is a stand-in built here as THUDM/slime@624b824a defines it: `loss_function`'s
packing of each micro-batch's log (backends/megatron_utils/loss.py l. 1328-1380, per-rollout-mean
mode), `reduce_train_step_metrics` (observability/train_metric_utils.py: sum over micro-batches,
all-reduce over data parallel = a sum over the ranks here, divide by the step's global batch size),
and `train`'s per-step log (model.py l. 876-898) into `logging_utils.log`, whose received dicts are
what slime's tracker gets.
"""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch
from test_integrations_slime import fake_slime, make_args, rollout_data, sum_of_sample_mean_for  # noqa: F401

import kldiag
from kldiag.integrations import slime as hook
from kldiag.integrations.slime import metrics as slime_metrics

NAMES = ("k3_mean", "k3_is_mean", "weight_k3_abs_max", "weight_k3_is_abs_max", "flagged_frac", "blame_share",
         "rho_max", "nonfinite_count")
PER_SAMPLE = ("partition", "sample_indices", "tokens", "response_lengths", "total_lengths", "loss_masks", "log_probs",
              "ref_log_probs", "rollout_log_probs", "advantages")


@pytest.fixture
def logged(fake_slime, monkeypatch):
    """slime.observability.logging_utils with a `log` that keeps what it receives."""
    received = []
    obs = types.ModuleType("slime.observability")
    lu = types.ModuleType("slime.observability.logging_utils")
    lu.log = lambda args, metrics, step_key: received.append(dict(metrics))
    obs.logging_utils = lu
    monkeypatch.setitem(sys.modules, "slime.observability", obs)
    monkeypatch.setitem(sys.modules, "slime.observability.logging_utils", lu)
    return received


def loss_function(args, batch, logits):
    """loss.py l. 1328-1380 (custom_loss, per-rollout-mean): the hook's loss and its packed log."""
    loss, log = hook.policy_loss(args, batch, logits, sum_of_sample_mean_for(batch))
    return loss, torch.tensor(1), {"keys": list(log.keys()), "values": torch.tensor([0] + list(log.values()))}


def reduce_train_step_metrics(per_rank: list[list[dict]], step_global_batch_size: int) -> dict:
    """train_metric_utils.reduce_train_step_metrics; the DP all-reduce (a sum) over the ranks' sums."""
    keys = per_rank[0][0]["keys"]
    values = sum(sum(item["values"] for item in items) for items in per_rank)
    assert len(keys) + 1 == values.numel()
    return {k: v / step_global_batch_size for k, v in zip(keys, values.tolist()[1:], strict=False)}


def micro(data: dict, idx: list[int]) -> dict:
    batch = {k: [data[k][i] for i in idx] for k in PER_SAMPLE}
    return {**batch, "unconcat_tokens": batch["tokens"]}


def train(fake_slime, logged, monkeypatch, rollouts: int, between):
    """Rollouts 1..rollouts on two DP ranks (one STATE each: two processes), two micro-batches per rank."""
    rng = np.random.default_rng(5)
    args = make_args(loss_type="custom_loss", custom_loss_function_path=hook.LOSS_PATH)
    states = {0: hook._State(), 1: hook._State()}
    for rollout in range(1, rollouts + 1):
        per_rank = []
        for dp in (0, 1):
            monkeypatch.setattr(hook, "STATE", states[dp])
            fake_slime.dp = dp
            data = rollout_data(rng, [dp, dp + 2, dp + 4, dp + 6])
            hook.postprocess(args, rollout, data)
            outs = []
            for idx in ([0, 1], [2, 3]):
                batch = micro(data, idx)
                outs.append(loss_function(args, batch, torch.randn(1, sum(batch["total_lengths"]), 16))[2])
            per_rank.append(outs)
        log_dict = {f"train/{k}": v for k, v in reduce_train_step_metrics(per_rank, 8).items()}
        log_dict["train/step"] = rollout  # one train step per rollout
        sys.modules["slime.observability.logging_utils"].log(args, log_dict, step_key="train/step")
        between(states, rollout)
    for s in states.values():
        s.recorder.close()
    return logged


def converted(states, rollout):
    for s in states.values():  # the next rollout's generation runs meanwhile
        s.recorder.wait_converted(10.0)


def test_slimes_logged_step_carries_the_previous_rollouts_kldiag_figures(fake_slime, logged, monkeypatch, tmp_path):
    got = train(fake_slime, logged, monkeypatch, 3, converted)
    steps = kldiag.analyze(tmp_path / "run").steps.to_pandas().set_index("step")
    assert sorted(steps.index) == [1, 2, 3] and steps.loc[2, "tokens"] > 0
    assert not any("kldiag" in k for k in got[0])  # nothing recorded before rollout 1
    assert "train/kl_loss" in got[0]
    for at, step in ((1, 1), (2, 2)):
        m = got[at]
        assert m["kldiag/step"] == step and m["train/step"] == step + 1 and "train/kl_loss" in m
        assert not any("kldiag_partials" in k for k in m)
        for name in NAMES:
            assert m["kldiag/" + name] == pytest.approx(steps.loc[step, name], rel=2e-5, abs=1e-9), (name, step)


def test_a_late_writer_leaves_rollouts_out(fake_slime, logged, monkeypatch, tmp_path):
    def late_after_1(states, rollout):
        if rollout == 2:
            del states[1].recorder.wait_converted  # caught up: converted() below waits for it for real
        converted(states, rollout)
        if rollout == 1:  # rollout 2's first loss call finds rank 1's writer behind
            states[1].recorder.wait_converted = lambda timeout=1.0: False  # shadows the method

    got = train(fake_slime, logged, monkeypatch, 4, late_after_1)
    steps = kldiag.analyze(tmp_path / "run").steps.to_pandas().set_index("step")
    assert not any("kldiag" in k for k in got[1])  # rank 1 was late
    assert not any("kldiag" in k for k in got[2])  # its window would hold rollouts 1 and 2
    assert got[3]["kldiag/step"] == 3
    assert got[3]["kldiag/k3_mean"] == pytest.approx(steps.loc[3, "k3_mean"], rel=2e-5)


def test_every_rank_returns_the_same_keys_at_every_call():
    class Rec:
        def observe(self, fn):
            self.fn = fn

        def wait_converted(self, timeout=1.0):
            return True

    w = slime_metrics.StepWindow(Rec())
    assert list(slime_metrics.report(w, 3, 1, 4)) == list(slime_metrics.report(None, -1, 0, 4)) \
        == slime_metrics.keys(4)
