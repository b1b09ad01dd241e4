"""kldiag.integrations.verl against verl 0.9.1's own code on CPU.

What runs for real: verl's `ppo_loss` (workers/utils/losses.py) with its `kl_penalty`, `agg_loss`,
`get_policy_loss_fn("vanilla")`, `no_padding_2_padding`, `left_right_2_no_padding`,
`response_to_nested`, `tensordict_utils` (get_tensordict, make_iterator with shuffle over PPO
epochs, chunk_tensordict, assign_non_tensor), `logprobs_from_logits` / `entropy_from_logits`, verl's
`ActorConfig`, and its metric reduction (`Metric.aggregate_dp`, `reduce_metrics`), on a tiny Llama
built from a config. The worker/engine layers (FSDP/Megatron engines, Ray worker groups,
TransferQueue, the V1 trainer) need GPUs and a Ray cluster: the test replays train_mini_batch's loop
(verl/workers/engine_workers.py l. 243-330) by hand.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
verl = pytest.importorskip("verl")
pytest.importorskip("transformers")

from tensordict.tensorclass import NonTensorData  # noqa: E402
from verl.trainer.ppo.core_algos import kl_penalty  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.metric import Metric, reduce_metrics  # noqa: E402
from verl.utils.torch_functional import entropy_from_logits, logprobs_from_logits  # noqa: E402
from verl.workers.config import ActorConfig  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding, response_to_nested  # noqa: E402

import kldiag  # noqa: E402
from kldiag.analysis.core import verl_kl  # noqa: E402
from kldiag.errors import IntegrationError  # noqa: E402
from kldiag.integrations import verl as hook  # noqa: E402

VOCAB = 61


@pytest.fixture(autouse=True)
def _fresh_state():
    hook.STATE.__init__()
    yield
    hook.close()


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


def nested(rows):
    return torch.nested.as_nested_tensor(list(rows), layout=torch.jagged)


def make_batch(n: int, group: int, seed: int, ref_shift: float = 0.0):
    """A V1-trainer-style batch (nested fields as in the TransferQueue), `group` samples per uid."""
    g = torch.Generator().manual_seed(seed)
    p_len = torch.randint(2, 6, (n,), generator=g)
    r_len = torch.randint(1, 9, (n,), generator=g)
    prompts = [torch.randint(0, VOCAB, (int(p),), generator=g) for p in p_len]
    for i in range(n):  # GRPO: the samples of a group share the prompt
        prompts[i] = prompts[i - i % group][: int(p_len[i - i % group])]
    responses = [torch.randint(0, VOCAB, (int(r),), generator=g) for r in r_len]
    mask = [(torch.rand(int(r), generator=g) > 0.15).long() for r in r_len]
    old = [-torch.rand(int(r), generator=g) * 3 for r in r_len]
    ref = [o - ref_shift + torch.randn(int(o.numel()), generator=g) * 2 for o in old]
    roll = [o + torch.randn(int(o.numel()), generator=g) * 0.05 for o in old]
    adv = [torch.full((int(r),), float(torch.randn(1, generator=g))) for r in r_len]
    td = tu.get_tensordict({
        "prompts": nested(prompts), "responses": nested(responses),
        "input_ids": nested(torch.cat([p, r]) for p, r in zip(prompts, responses, strict=True)),
        "response_mask": nested(mask), "old_log_probs": nested(old), "ref_log_prob": nested(ref),
        "rollout_log_probs": nested(roll), "advantages": nested(adv)})
    tu.assign_non_tensor_stack(td, "uid", [f"prompt-{seed}-{i // group}" for i in range(n)])
    return td


def forward(model, micro):
    """The engine's model_output: nested log_probs / entropy over prompt+response (labels rolled by one)."""
    ids = micro["input_ids"]
    logits = torch.cat([model(row[None]).logits[0] for row in ids.unbind()])
    labels = torch.roll(ids.values(), -1)
    lp = logprobs_from_logits(logits, labels)
    ent = entropy_from_logits(logits)
    offsets = ids.offsets()
    return {"log_probs": torch.nested.nested_tensor_from_jagged(lp, offsets=offsets),
            "entropy": torch.nested.nested_tensor_from_jagged(ent, offsets=offsets)}


def actor(**kw):
    base = dict(strategy="fsdp", use_kl_loss=True, kl_loss_type="low_var_kl", kl_loss_coef=0.1, rollout_n=1,
                ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2)
    return ActorConfig(**{**base, **kw})


def replay_update(model, data, cfg, loss, *, mini: int, micro: int, epochs: int, dp_size: int = 1,
                  dp_tokens: int | None = None, dp_seqs: int | None = None, step: int | None = None):
    """train_mini_batch + the engine's micro-batch loop for one DP rank; returns per-mini Metric lists."""
    out = []
    for mb in tu.make_iterator(data, mini_batch_size=mini, epochs=epochs, seed=42,
                               dataloader_kwargs={"shuffle": True}):
        tokens = int(mb["response_mask"].values().sum())
        lengths = mb["input_ids"].offsets().diff().tolist() * dp_size  # all-gathered over DP in verl
        tu.assign_non_tensor(mb, global_token_num=NonTensorData(lengths),
                             update_lr_scheduler=False, dp_size=dp_size,
                             batch_num_tokens=dp_tokens if dp_tokens is not None else tokens,
                             global_batch_size=dp_seqs if dp_seqs is not None else mini)
        if step is not None:
            tu.assign_non_tensor(mb, kldiag_step=step)
        metrics = Metric(aggregation="sum")
        for mu in tu.chunk_tensordict(mb, mini // micro):
            with torch.enable_grad():  # an update pass (no backward needed here)
                _, m = loss(model_output=forward(model, mu), data=mu, dp_group=None)  # as the engine calls it
            metrics.append(m["kl_loss"])
        out.append(metrics)
    return out


MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"]


@pytest.mark.parametrize(("mode", "kl_type"), [(m, "low_var_kl") for m in MODES] +
                         [("token-mean", k) for k in ("k1", "mse", "abs", "k3+")])
def test_loss_and_gradients_bit_identical_with_recording(tmp_path, model, mode, kl_type):
    data = make_batch(4, 2, seed=1, ref_shift=2.0)
    cfg = actor(loss_agg_mode=mode, kl_loss_type=kl_type, entropy_coeff=0.01)
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=int(data["response_mask"].values().sum()),
                         global_batch_size=4)
    results = []
    for fn in (ppo_loss, hook.loss_fn(cfg, tmp_path / "run")):
        model.zero_grad(set_to_none=True)
        loss, metrics = fn(config=cfg, model_output=forward(model, data), data=data) if fn is not ppo_loss \
            else fn(cfg, forward(model, data), data)
        loss.backward()
        results.append((loss.detach(), {k: Metric.aggregate_dp([v]) if isinstance(v, Metric) else v
                                        for k, v in metrics.items()},
                        [p.grad.clone() for p in model.parameters()]))
    (l0, m0, g0), (l1, m1, g1) = results
    assert torch.equal(l0, l1) and m0 == m1
    assert all(torch.equal(a, b) for a, b in zip(g0, g1, strict=True))
    hook.close()
    assert kldiag.open_run(tmp_path / "run").read(columns=["seq"]).num_rows == int(data["responses"].values().numel())


@pytest.mark.parametrize("mode", MODES)
def test_reproduced_kl_loss_equals_verls_logged_value(tmp_path, model, mode):
    """Two steps, each 2 mini-batches x 2 micro-batches x 2 PPO epochs (shuffled): kldiag's actor/kl_loss
    from the recorded rows equals verl's own reduction of the values its ppo_loss returned."""
    cfg = actor(loss_agg_mode=mode)
    loss = hook.loss_fn(cfg, tmp_path / "run", hook.settings(cfg, version=verl.__version__))
    logged = {}
    for step in range(2):
        data = make_batch(8, 4, seed=10 + step, ref_shift=2.5)
        per_mini = replay_update(model, data, cfg, loss, mini=4, micro=2, epochs=2, step=step)
        logged[step] = reduce_metrics({"kl_loss": [Metric.aggregate_dp([m]) for m in per_mini]})["kl_loss"]
    hook.close()
    got = verl_kl.kl_loss_by_step(tmp_path / "run")
    assert sorted(got) == [0, 1]
    for step in got:
        assert got[step] == pytest.approx(logged[step], rel=2e-6, abs=1e-7), (step, got[step], logged[step])
    if mode == "token-mean":  # the same numbers through kldiag.analyze's trainer-compatible table
        table = kldiag.analyze(tmp_path / "run", kldiag.AnalysisConfig(trainer_compatible=True)).trainer_kl
        assert table.column("kl").to_pylist() == pytest.approx([logged[0], logged[1]], rel=2e-6)
        assert all(0 < v < 1 for v in table.column("clamp_dead_token_share").to_pylist())


def test_two_dp_ranks_reproduce_verls_dp_mean(tmp_path, model):
    """dp_size 2: each rank normalises by the global token count; verl means the ranks' sums."""
    cfg = actor(loss_agg_mode="token-mean")
    loss = hook.loss_fn(cfg, tmp_path / "run")
    shards = [make_batch(4, 2, seed=20 + r, ref_shift=2.0) for r in range(2)]
    tokens = sum(int(s["response_mask"].values().sum()) for s in shards)
    per_rank = []
    for r, shard in enumerate(shards):
        hook.close()
        hook.STATE.recorder = kldiag.Recorder(tmp_path / "run", rank=r, world_size=2, trainer="verl",
                                              config=hook.settings(cfg, version=verl.__version__))
        per_rank.append(replay_update(model, shard, cfg, loss, mini=4, micro=2, epochs=1, dp_size=2,
                                      dp_tokens=tokens, dp_seqs=8, step=0))
    hook.close()
    logged = Metric.aggregate_dp([per_rank[0][0], per_rank[1][0]])
    assert verl_kl.kl_loss_by_step(tmp_path / "run")[0] == pytest.approx(logged, rel=2e-6)


def test_recorded_columns_ids_and_manifest(tmp_path, model):
    cfg = actor(loss_agg_mode="seq-mean-token-mean", clip_ratio_high=0.28)
    loss = hook.loss_fn(cfg, tmp_path / "run", hook.settings(cfg, {"rollout_is": "token",
                                                                   "rollout_is_threshold": 2.0}, verl.__version__))
    data = make_batch(8, 4, seed=3)
    replay_update(model, data, cfg, loss, mini=4, micro=2, epochs=2)  # no kldiag_step: counted by the hook
    hook.close()
    run = kldiag.open_run(tmp_path / "run")
    man = run.manifest
    assert man.trainer == {"name": "verl", "version": verl.__version__}
    for key in ("use_kl_loss", "kl_loss_type", "kl_loss_coef", "loss_agg_mode", "clip_ratio_low",
                "clip_ratio_high", "policy_loss.loss_mode", "rollout_correction"):
        assert key in man.config, key
    assert man.config["clip_ratio_high"] == 0.28 and man.config["rollout_correction"]["rollout_is"] == "token"
    assert man.config["estimator"] == "k3_clamped" and man.config["beta"] == 0.1
    t = run.read().to_pandas()
    assert len(t) == 2 * int(data["responses"].values().numel())  # every response token, twice (2 epochs)
    assert set(t.iteration) == {0, 1} and set(t.step) == {0}
    assert sorted(set(t.micro)) == [0, 1, 1024, 1025, 2048, 2049, 3072, 3073]
    # the same sample keeps its seq id over epochs and shuffles; groups follow uid
    per_seq = t.groupby(["seq", "iteration"]).size().unstack()
    assert len(per_seq) == 8 and (per_seq[0] == per_seq[1]).all()
    assert t.groupby("group").seq.nunique().tolist() == [4, 4]
    # columns are what ppo_loss saw
    first = t[(t.iteration == 0)].sort_values(["seq", "pos"])
    old = np.concatenate([x.numpy() for x in data["old_log_probs"].unbind()])
    assert sorted(first.logp_old.to_numpy()) == sorted(old.astype(np.float32))
    roll = np.concatenate([x.numpy() for x in data["rollout_log_probs"].unbind()])
    assert sorted(first.logp_sampler.to_numpy()) == sorted(roll.astype(np.float32))
    assert first["mask"].sum() == int(data["response_mask"].values().sum())
    assert first.entropy.notna().all() and (first.logp <= 0).all()


def test_padded_batch_from_left_right_padding(tmp_path, model):
    """The padded (non-nested) path: verl's left_right_2_no_padding output goes through the hook."""
    b, p, r = 3, 4, 5
    attn = torch.ones(b, p + r, dtype=torch.long)
    attn[0, :2] = 0  # left-padded prompt
    attn[1, p + 3:] = 0  # right-padded response
    resp_mask = attn[:, p:].clone()
    data = tu.get_tensordict({
        "input_ids": torch.randint(0, VOCAB, (b, p + r)), "attention_mask": attn,
        "position_ids": (attn.cumsum(-1) - 1).clamp(min=0), "prompts": torch.randint(0, VOCAB, (b, p)),
        "responses": torch.randint(0, VOCAB, (b, r)), "response_mask": resp_mask,
        "old_log_probs": -torch.rand(b, r), "ref_log_prob": -torch.rand(b, r) - 1, "advantages": torch.randn(b, r)})
    data = left_right_2_no_padding(data)
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=int(resp_mask.sum()), global_batch_size=b)
    cfg = actor()
    want, _ = ppo_loss(cfg, forward(model, data), data)
    got, _ = hook.ppo_loss(cfg, forward(model, data), data, run=str(tmp_path / "run"))
    assert torch.equal(want, got)
    hook.close()
    t = kldiag.open_run(tmp_path / "run").read().to_pandas()
    assert len(t) == b * r and t["mask"].sum() == int(resp_mask.sum())


def test_response_to_nested_fields_match(tmp_path, model):
    """Fields nested with verl's response_to_nested (as the V1 trainer stores them) record the same rows."""
    data = make_batch(4, 2, seed=5)
    padded = data.select("response_mask", "old_log_probs").to_padded_tensor()
    data["old_log_probs"] = response_to_nested(padded["old_log_probs"], data["response_mask"])
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=int(data["response_mask"].values().sum()),
                         global_batch_size=4)
    hook.ppo_loss(actor(), forward(model, data), data, run=str(tmp_path / "run"))
    hook.close()
    t = kldiag.open_run(tmp_path / "run").read().to_pandas()
    assert len(t) == int(data["responses"].values().numel())


def test_forward_only_passes_are_not_recorded(tmp_path, model):
    """verl's infer_batch can call the loss under no_grad (compute_loss): that is no update."""
    data = make_batch(2, 2, seed=6)
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=int(data["response_mask"].values().sum()),
                         global_batch_size=2)
    with torch.no_grad():
        hook.ppo_loss(actor(), forward(model, data), data, run=str(tmp_path / "run"))
    assert hook.STATE.recorder is None and not (tmp_path / "run").exists()


def test_dead_zone_is_where_verls_low_var_kl_gradient_vanishes():
    s = torch.linspace(-40, 0, 4001, dtype=torch.float64, requires_grad=True)
    r = torch.full_like(s, -3.0)
    kl_penalty(s, r, "low_var_kl").sum().backward()
    dead = verl_kl.dead_zone(s.detach().numpy(), r.numpy())
    assert dead.any() and (~dead).any()
    live = (s.detach() != r).numpy()  # at pi_theta == pi_ref K3's gradient is 0 by its shape, not a clamp
    np.testing.assert_array_equal(dead[live], (s.grad == 0).numpy()[live])


def test_clamp_share_by_step(tmp_path):
    d = np.array([[0.0, 1.0, 3.0, 5.0], [-12.0, 0.5, 2.0, 25.0]])  # log(pi_ref / pi_theta)
    logp = np.full(d.shape, -6.0, np.float32)
    with kldiag.Recorder(tmp_path / "run") as rec:
        rec.record(step=0, logp=logp, logp_ref=(logp + d).astype(np.float32), mask=np.ones(d.shape, bool))
    share = verl_kl.clamp_share_by_step(tmp_path / "run")[0]
    dead = verl_kl.dead_zone(logp, (logp + d).astype(np.float32))
    assert dead.sum() == 4 and share["dead_tokens"] == 4 and share["token_share"] == 0.5
    w = np.abs(1 - np.exp(d.astype(np.float32).astype(np.float64)))
    assert share["weight_share"] == pytest.approx(w[dead].sum() / w.sum())


def test_unsupported_version_fails_at_attach(tmp_path):
    with pytest.raises(IntegrationError, match=r">=0.9,<0.10.*0.8.5"):
        hook.check_version("0.8.5")
    assert hook.check_version("0.9.1") == "0.9.1"

    class Trainer:  # not initialised yet: no worker group
        config = None

    with pytest.raises(IntegrationError, match="after trainer.init"):
        hook.attach(Trainer(), tmp_path / "run")


def test_min_global_steps_is_the_policy_version(tmp_path, model):
    """A batch whose rows carry verl's min_global_steps (the agent loop's per-row extra field): staleness =
    step - policy_version is verl's trajectory_staleness_worst, (global_steps - 1) - min_global_steps."""
    cfg = actor(loss_agg_mode="token-mean")
    loss = hook.loss_fn(cfg, tmp_path / "run", hook.settings(cfg, None, verl.__version__))
    data = make_batch(8, 4, seed=5)
    versions = [7, 7, 7, 7, 5, 5, 5, 5]  # two groups: one fresh at global step 8, one 2 versions older
    tu.assign_non_tensor_stack(data, "min_global_steps", versions)
    replay_update(model, data, cfg, loss, mini=4, micro=2, epochs=1, step=8)
    hook.close()
    t = kldiag.open_run(tmp_path / "run").read(columns=["step", "seq", "group", "policy_version"]).to_pandas()
    assert t["policy_version"].notna().all()
    stale = (t["step"] - t["policy_version"]).groupby(t["group"]).unique()
    assert sorted(int(v[0]) for v in stale) == [0, 2]


@pytest.mark.parametrize("mode", ["R2", "R3"])
def test_routed_experts_go_to_the_side_the_replay_mode_says(tmp_path, model, mode):
    """verl's `routed_experts` through its own ppo_loss: under R2 it is the trainer's old-log-prob record (written
    as the trainer's routes: route_layers counted, no comparison), under R3 the engine's (no trainer side: nothing
    but the manifest's config["routes"] says so)."""
    cfg = actor()
    rollout = {"enable_rollout_routing_replay": mode == "R3"}
    settings = hook.settings({**cfg.__dict__, "megatron": {"router_replay": {"mode": mode}}}, None, verl.__version__,
                             rollout)
    loss = hook.loss_fn(cfg, tmp_path / "run", settings)
    data = make_batch(4, 2, seed=5)
    layers, k = 3, 2
    width = int(data["input_ids"].offsets().diff().max()) + int(data["responses"].offsets().diff().max())
    data["routed_experts"] = torch.randint(0, 8, (4, width, layers, k), dtype=torch.int16)
    replay_update(model, data, cfg, loss, mini=4, micro=4, epochs=1)
    hook.close()
    run = kldiag.open_run(tmp_path / "run")
    t = run.read(["route_layers", "route_differ", "mask"]).to_pandas()
    routes = run.manifest.config["routes"]
    if mode == "R2":
        assert routes["captured"] == "trainer" and (t.route_layers == layers).all() and t.route_differ.isna().all()
    else:
        assert routes["captured"] == "engine" and "trainer" in routes["missing"] and t.route_layers.isna().all()


def test_rollout_dtype_from_the_rollout_config():
    """engine_low_precision's input: `rollout.quantization` when set, else `rollout.dtype` (verl 0.9.1 keys)."""
    from kldiag.integrations import verl as kv

    assert kv.rollout_dtype({"quantization": "fp8", "dtype": "bfloat16"}) == "fp8"
    assert kv.rollout_dtype({"quantization": None, "dtype": "bfloat16"}) == "bfloat16"
    assert kv.rollout_dtype(None) is None and kv.rollout_dtype({}) is None
