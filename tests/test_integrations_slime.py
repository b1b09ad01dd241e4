"""slime live hooks and slime's KL semantics.

slime is not on PyPI and needs Megatron, so `megatron.core.mpu` and the slime functions the
hooks call are stand-ins built here as slime@624b824a defines them: `compute_approx_kl`
(slime/utils/ppo_utils.py l. 12-51, copied without @torch.compile), the KL part of
`policy_loss_function` (backends/megatron_utils/loss.py l. 965-978, 1116-1130) and
`sum_of_sample_mean` (cp_utils.py l. 73-82), the rollout_data the actor passes to
--rollout-data-postprocess-path (actor.py l. 505; keys as slime/ray/rollout.py l. 783-808).
"""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch

import kldiag
from kldiag.analysis.core import slime_kl
from kldiag.analysis.types import AnalysisConfig
from kldiag.integrations import slime as hook

# The hooks run inside a GPU job: their tensors live on the GPU when there is one.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def compute_approx_kl(log_probs, log_probs_base, kl_loss_type, importance_ratio=None):
    """slime/utils/ppo_utils.py l. 12-51 (THUDM/slime@624b824a), without @torch.compile."""
    log_ratio = log_probs.float() - log_probs_base.float()
    if kl_loss_type == "k1":
        kl = log_ratio
    elif kl_loss_type == "k2":
        kl = log_ratio**2 / 2.0
    elif kl_loss_type in ["k3", "low_var_kl"]:
        log_ratio = -log_ratio
        kl = log_ratio.exp() - 1 - log_ratio
    else:
        raise ValueError(f"Unknown kl_loss_type: {kl_loss_type}")
    if importance_ratio is not None:
        kl = importance_ratio * kl
    if kl_loss_type == "low_var_kl":
        kl = torch.clamp(kl, min=-10, max=10)
    return kl


@pytest.mark.parametrize("kl_type", ["k1", "k2", "k3", "low_var_kl"])
@pytest.mark.parametrize("unbiased", [False, True])
def test_approx_kl_matches_slime(kl_type, unbiased):
    rng = np.random.default_rng(1)
    s = rng.normal(-2, 1.5, 400).clip(max=-1e-3)
    r = rng.normal(-2, 1.5, 400).clip(max=-1e-3)
    o = s + rng.normal(0, 1.0, 400)
    s[:3], r[:3], o[:3] = [-9.0, -0.5, -3.0], [-1.0, -8.0, -2.0], [-12.0, -0.1, -1.0]  # clamp region
    rho = torch.exp(torch.tensor(s) - torch.tensor(o)) if unbiased else None
    want = compute_approx_kl(torch.tensor(s, dtype=torch.float32), torch.tensor(r, dtype=torch.float32), kl_type,
                             rho.float() if rho is not None else None).double().numpy()
    got = slime_kl.approx_kl(s.astype(np.float32), r.astype(np.float32), kl_type,
                             slime_kl.unbiased_rho(s, o) if unbiased else None)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-5)
    if kl_type == "low_var_kl":
        assert got.max() <= 10.0
    if kl_type == "k3" and unbiased:
        assert got.max() > 10.0  # k3 is never clamped, also after the rho multiply


def test_low_var_kl_clamps_after_the_multiply():
    s, r = np.array([-1.0]), np.array([-0.5])  # k3 = 0.1065...; rho * k3 > 10 for rho = 200
    rho = np.array([200.0])
    assert slime_kl.approx_kl(s, r, "low_var_kl", rho)[0] == 10.0
    assert slime_kl.approx_kl(s, r, "k3", rho)[0] == pytest.approx(200 * (np.exp(0.5) - 1.5))


# ---- stand-ins for Megatron's mpu and slime's loss module ---------------------------------

class FakeMpu(types.SimpleNamespace):
    def is_pipeline_last_stage(self, ignore_virtual=False):
        return self.last

    def get_tensor_model_parallel_rank(self):
        return self.tp

    def get_context_parallel_world_size(self):
        return 1

    def get_context_parallel_rank(self):
        return 0

    def get_data_parallel_rank(self, with_context_parallel=False):
        return self.dp

    def get_data_parallel_world_size(self, with_context_parallel=False):
        return self.dp_size


def get_log_probs_and_entropy(logits, *, args, unconcat_tokens, total_lengths, response_lengths, with_entropy=False,
                              **kw):
    """Per-sample response log-probs from packed logits [1, T, V], as slime's (loss.py l. 513)."""
    logp_all = torch.log_softmax(logits[0].float(), -1)
    out, ent, start = [], [], 0
    for tokens, total, resp in zip(unconcat_tokens, total_lengths, response_lengths, strict=True):
        rows = logp_all[start + total - resp - 1: start + total - 1]
        out.append(rows.gather(-1, tokens[-resp:, None])[:, 0])
        ent.append(-(rows.exp() * rows).sum(-1))
        start += total
    return None, {"log_probs": out, "entropy": ent}


def policy_loss_function(args, batch, logits, sum_of_sample_mean):
    """The KL part of slime's policy_loss_function (loss.py l. 965-978, 1116-1130)."""
    old = batch["rollout_log_probs"] if args.use_rollout_logprobs else batch.get("log_probs")
    _, lpe = sys.modules["slime.backends.megatron_utils.loss"].get_log_probs_and_entropy(
        logits, args=args, unconcat_tokens=batch["unconcat_tokens"], total_lengths=batch["total_lengths"],
        response_lengths=batch["response_lengths"], with_entropy=True)
    log_probs = torch.cat(lpe["log_probs"], 0)
    old_log_probs = torch.cat(old, 0)
    ratio = torch.exp(log_probs - old_log_probs) if args.use_unbiased_kl else None
    kl = compute_approx_kl(log_probs, torch.cat(batch["ref_log_probs"], 0), args.kl_loss_type, ratio)
    kl_loss = sum_of_sample_mean(kl)
    return args.kl_loss_coef * kl_loss, {"kl_loss": kl_loss.detach()}


def sum_of_sample_mean_for(batch):
    """cp_utils.get_sum_of_sample_mean, CP = 1, denominators = each sample's mask sum (l. 73-82)."""
    def f(x):
        return sum((xi * m).sum() / torch.clamp_min(m.sum(), 1)
                   for xi, m in zip(x.split(batch["response_lengths"], 0), batch["loss_masks"], strict=True))
    return f


@pytest.fixture
def fake_slime(monkeypatch, tmp_path):
    mpu = FakeMpu(last=True, tp=0, dp=0, dp_size=2)
    core = types.ModuleType("megatron.core")
    core.mpu = mpu
    loss = types.ModuleType("slime.backends.megatron_utils.loss")
    loss.get_log_probs_and_entropy = get_log_probs_and_entropy
    loss.policy_loss_function = policy_loss_function
    for name, mod in {"megatron": types.ModuleType("megatron"), "megatron.core": core,
                      "slime": types.ModuleType("slime"), "slime.backends": types.ModuleType("slime.backends"),
                      "slime.backends.megatron_utils": types.ModuleType("slime.backends.megatron_utils"),
                      "slime.backends.megatron_utils.loss": loss}.items():
        monkeypatch.setitem(sys.modules, name, mod)
    sys.modules["slime.backends.megatron_utils"].loss = loss
    monkeypatch.setenv(hook.ENV_RUN, str(tmp_path / "run"))
    monkeypatch.setattr(hook, "STATE", hook._State())
    yield mpu
    hook.close()


def make_args(**kw):
    base = dict(loss_type="policy_loss", custom_loss_function_path=None, kl_loss_type="low_var_kl",
                use_unbiased_kl=True, use_kl_loss=True, kl_loss_coef=0.01, use_rollout_logprobs=False,
                n_samples_per_prompt=2)
    return types.SimpleNamespace(**{**base, **kw})


def rollout_data(rng, positions, device="cpu"):
    """A DP rank's rollout_data at the postprocess hook: per-sample lists of tensors (log-probs,
    advantages and masks on the training device, tokens on the host as slime ships them)."""
    n = len(positions)
    resp = [int(rng.integers(2, 6)) for _ in range(n)]
    prompt = [int(rng.integers(1, 4)) for _ in range(n)]
    lp = [torch.tensor(rng.normal(-1, 0.5, k).clip(max=-1e-3), dtype=torch.float32, device=device) for k in resp]
    return {"partition": list(positions), "sample_indices": [10 + p for p in positions],
            "tokens": [torch.tensor(rng.integers(0, 16, p + k)) for p, k in zip(prompt, resp, strict=True)],
            "response_lengths": resp, "total_lengths": [p + k for p, k in zip(prompt, resp, strict=True)],
            "loss_masks": [torch.tensor((rng.random(k) > 0.2).astype(np.int32), device=device) for k in resp],
            "log_probs": lp, "ref_log_probs": [x + torch.randn(len(x), device=device) * 0.5 for x in lp],
            "rollout_log_probs": [x + 0.05 for x in lp],
            "advantages": [torch.full((k,), 0.5, device=device) for k in resp],
            "raw_reward": [0.0] * 8, "global_batch_sizes": [n], "num_microbatches": [1]}


@pytest.mark.parametrize("device", DEVICES)
def test_postprocess_records_from_data_owning_ranks(fake_slime, tmp_path, device):
    rng = np.random.default_rng(0)
    args = make_args()
    data = {0: rollout_data(rng, [0, 2, 4], device), 1: rollout_data(rng, [1, 3, 5], device)}
    for dp in (0, 1):
        fake_slime.dp = dp
        hook.postprocess(args, 7, data[dp])
        hook.close()
        fake_slime.tp = 1  # the other TP rank holds the same values: it records nothing
        hook.postprocess(args, 7, data[dp])
        assert hook.STATE.recorder is None
        fake_slime.tp = 0
    fake_slime.last = False
    hook.postprocess(args, 7, data[0])
    assert hook.STATE.recorder is None
    run = kldiag.open_run(tmp_path / "run")
    t = run.read().to_pandas()
    assert sorted(t["rank"].unique()) == [0, 1] and set(t["step"]) == {7}
    assert sorted(t["seq"].unique() - (7 << 32)) == [0, 1, 2, 3, 4, 5]
    assert dict(zip(t["seq"] - (7 << 32), t["group"], strict=True))[5] == 2
    assert run.manifest.config["kl_semantics"] == "slime" and run.manifest.config["kl_loss_type"] == "low_var_kl"
    assert run.manifest.config["estimator"] == "k3_is" and run.manifest.config["beta"] == 0.01
    masks = [m for dp in (0, 1) for m in data[dp]["loss_masks"]]
    assert t["mask"].sum() == sum(int(m.sum()) for m in masks)


@pytest.mark.parametrize("device", DEVICES)
def test_policy_loss_wrapper_records_pi_theta_and_slime_kl(fake_slime, tmp_path, device):
    rng = np.random.default_rng(3)
    args = make_args(loss_type="custom_loss", custom_loss_function_path=hook.LOSS_PATH)
    data = rollout_data(rng, [0, 1, 2, 3], device)
    hook.postprocess(args, 4, data)  # notes the rollout id; rows come from the loss
    assert hook.STATE.recorder is None
    batch = {**data, "unconcat_tokens": [x.to(device) for x in data["tokens"]]}  # get_batch moves them
    logits = torch.randn(1, sum(data["total_lengths"]), 16, device=device)
    loss, log = hook.policy_loss(args, batch, logits, sum_of_sample_mean_for(batch))
    want_loss, want_log = policy_loss_function(args, batch, logits, sum_of_sample_mean_for(batch))
    assert torch.equal(loss, want_loss)  # the wrapper does not change slime's loss
    hook.policy_loss(args, batch, logits, sum_of_sample_mean_for(batch))  # --recompute-loss-function
    hook.close()
    run = tmp_path / "run"
    t = kldiag.open_run(run).read().to_pandas().sort_values(["seq", "pos"])
    _, lpe = get_log_probs_and_entropy(logits, args=args, unconcat_tokens=batch["unconcat_tokens"],
                                       total_lengths=batch["total_lengths"],
                                       response_lengths=batch["response_lengths"])
    np.testing.assert_allclose(t["logp"], torch.cat(lpe["log_probs"]).cpu().numpy(), rtol=1e-6)
    np.testing.assert_allclose(t["logp_old"], torch.cat(data["log_probs"]).cpu().numpy())
    a = kldiag.analyze(run, AnalysisConfig(trainer_compatible=True))
    kl = a.trainer_kl.to_pylist()
    # slime logs sum_of_sample_mean(kl) summed over micro-batches / the step's samples
    assert len(kl) == 1 and kl[0]["step"] == 4
    assert kl[0]["kl"] == pytest.approx(float(want_log["kl_loss"]) / 4, rel=1e-5)


def test_policy_loss_without_rollout_positions(fake_slime, tmp_path):
    """Without --save-debug-train-data slime's batch has no `partition`: the Recorder numbers the rows."""
    rng = np.random.default_rng(4)
    args = make_args(loss_type="custom_loss", custom_loss_function_path=hook.LOSS_PATH, use_unbiased_kl=False,
                     kl_loss_type="k3")
    data = rollout_data(rng, [0, 1])
    del data["partition"]
    hook.postprocess(args, 2, data)
    batch = {**data, "unconcat_tokens": data["tokens"]}
    hook.policy_loss(args, batch, torch.randn(1, sum(data["total_lengths"]), 16), sum_of_sample_mean_for(batch))
    hook.close()
    t = kldiag.open_run(tmp_path / "run").read().to_pandas()
    assert t["seq"].nunique() == 2 and t["group"].isna().all() and set(t["step"]) == {2}
    assert len(t) == sum(data["response_lengths"])


def test_true_on_policy_mode_declares_the_parity_contract(fake_slime, tmp_path):
    """slime/Miles' --true-on-policy-mode (args.true_on_policy_mode) becomes the manifest's true_on_policy, which
    kldiag.diagnosis.contract reads."""
    rng = np.random.default_rng(1)
    hook.postprocess(make_args(true_on_policy_mode=True), 3, rollout_data(rng, [0, 1]))
    hook.close()
    assert kldiag.open_run(tmp_path / "run").manifest.config["true_on_policy"] is True


def test_every_framework_call_of_the_hook_follows_the_failure_policy(fake_slime, tmp_path, monkeypatch):
    """A slime whose logging_utils lacks `log` (a stand-in, a renamed function) and a Megatron mpu that lacks a
    call: counted, warned once, training goes on; raised with KLDIAG_STRICT=1."""
    import warnings

    obs = types.ModuleType("slime.observability")
    obs.logging_utils = types.ModuleType("slime.observability.logging_utils")  # no `log`
    monkeypatch.setitem(sys.modules, "slime.observability", obs)
    monkeypatch.setitem(sys.modules, "slime.observability.logging_utils", obs.logging_utils)
    monkeypatch.delenv("KLDIAG_STRICT", raising=False)
    rng = np.random.default_rng(5)
    args = make_args(loss_type="custom_loss", custom_loss_function_path=hook.LOSS_PATH)
    data = rollout_data(rng, [0, 1])
    hook.postprocess(args, 1, data)
    batch = {**data, "unconcat_tokens": data["tokens"]}
    logits = torch.randn(1, sum(data["total_lengths"]), 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss, _ = hook.policy_loss(args, batch, logits, sum_of_sample_mean_for(batch))
        hook.policy_loss(args, batch, logits, sum_of_sample_mean_for(batch))
    want, _ = policy_loss_function(args, batch, logits, sum_of_sample_mean_for(batch))
    assert torch.equal(loss, want) and hook.STATE.failures == 1  # the hook is not retried each call
    assert len([w for w in caught if "AttributeError" in str(w.message)]) == 1
    monkeypatch.delattr(FakeMpu, "is_pipeline_last_stage")  # an mpu without a call postprocess makes
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        hook.postprocess(make_args(), 2, rollout_data(rng, [0, 1]))  # counted, not raised
    assert hook.STATE.failures == 2
    monkeypatch.setenv("KLDIAG_STRICT", "1")
    with pytest.raises(AttributeError):
        hook.postprocess(make_args(), 3, rollout_data(rng, [0, 1]))
