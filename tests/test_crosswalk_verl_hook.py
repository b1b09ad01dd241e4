"""The crosswalk on a run recorded by kldiag's verl hook around verl 0.9.1's own `ppo_loss` (the
replayed train_mini_batch loop of tests/test_integrations_verl.py: 2 steps x 2 mini-batches x 2
micro-batches x 2 PPO epochs): `actor/kl_loss` equals what verl's metric reduction logs, and every
`rollout_corr/*` metric equals verl's rollout_corr_helper on the original (unrecorded) batch."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
verl = pytest.importorskip("verl")
pytest.importorskip("transformers")
TIV = pytest.importorskip("test_integrations_verl")  # its batch builders and replayed update loop

from verl.trainer.ppo import rollout_corr_helper as helper  # noqa: E402
from verl.utils.metric import Metric, reduce_metrics  # noqa: E402

import kldiag.crosswalk as X  # noqa: E402
from kldiag.integrations import verl as hook  # noqa: E402

SETTINGS = {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": "seq_mean_k3,token_k1",
            "rollout_rs_threshold": "0.001,0.9_1.1"}


def padded(nt):
    return torch.nested.to_padded_tensor(nt, 0.0)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_verl_recorded_run_matches_verls_logs(tmp_path, mode):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=TIV.VOCAB, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                         max_position_embeddings=64)).eval()
    hook.STATE.__init__()
    cfg = TIV.actor(loss_agg_mode=mode)
    loss = hook.loss_fn(cfg, tmp_path / "run", hook.settings(cfg, version=verl.__version__))
    logged, batches = {}, {}
    try:
        for step in range(2):
            data = TIV.make_batch(8, 4, seed=10 + step, ref_shift=2.5)
            per_mini = TIV.replay_update(model, data, cfg, loss, mini=4, micro=2, epochs=2, step=step)
            logged[step] = reduce_metrics({"kl_loss": [Metric.aggregate_dp([m]) for m in per_mini]})["kl_loss"]
            batches[step] = data
    finally:
        hook.close()
    rows = {r["step"]: r for r in X.records(X.crosswalk(tmp_path / "run", "verl", **SETTINGS))}
    assert sorted(rows) == [0, 1]
    for step, data in batches.items():
        assert rows[step]["actor/kl_loss"] == pytest.approx(logged[step], rel=2e-6, abs=1e-7)
        mask = padded(data["response_mask"]).double()
        _, _, theirs = helper.compute_rollout_correction_and_rejection_mask(
            padded(data["old_log_probs"]).double(), padded(data["rollout_log_probs"]).double(), mask, **SETTINGS)
        mine = {k: v for k, v in rows[step].items() if k.startswith("rollout_corr/")}
        assert set(mine) == set(theirs)
        for name, value in theirs.items():
            assert mine[name] == pytest.approx(float(value), rel=1e-9, abs=1e-12), (step, name)
