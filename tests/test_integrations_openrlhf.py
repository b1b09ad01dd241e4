"""kldiag.integrations.openrlhf on OpenRLHF 0.11.2's own code (the installed package, unmodified): the real
`ActorPPOTrainer.ppo_train` / `training_step` / `PolicyLoss` / `compute_approx_kl` / `aggregate_loss` run two
trainer steps on tiny tensors on this CPU, patched by kldiag's Ray setup hook (`install`) exactly as in a Ray
worker. Stubbed, because a CPU machine lacks them and the hook's path never calls them: deepspeed, ray, vLLM
and the HF actor (its forward is replaced by a given pi_theta), the tokenizer and the replay buffer class.
The run's crosswalk equals the metrics OpenRLHF's own ppo_train returned for the same micro-batches, and
`kldiag audit` of the run against those logged metrics agrees at step offset 0."""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
import types
from pathlib import Path
from types import SimpleNamespace as NS

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("openrlhf") is None:
    pytest.skip("openrlhf 0.11.2 is not installed (make setup)", allow_module_level=True)

from test_crosswalk_openrlhf import PPO_STUBS  # noqa: E402 - the same stand-ins as the crosswalk's ppo_train test

import kldiag.crosswalk as X  # noqa: E402
from kldiag.crosswalk.audit import audit  # noqa: E402
from kldiag.errors import IntegrationError  # noqa: E402
from kldiag.format import open_run  # noqa: E402
from kldiag.integrations import openrlhf as H  # noqa: E402

ROOT = Path(importlib.util.find_spec("openrlhf").submodule_search_locations[0]).parent
PACKAGES = ("openrlhf", "openrlhf.models", "openrlhf.trainer", "openrlhf.trainer.ppo_utils", "openrlhf.trainer.ray")


@pytest.fixture(scope="module")
def ppo_actor():
    """openrlhf's ppo_actor module imported through kldiag's setup hook (install), with the stubs above."""
    names = [*PPO_STUBS, *PACKAGES, "openrlhf.models.utils", "openrlhf.models.loss", "openrlhf.utils.loss_utils",
             "openrlhf.trainer.ppo_utils.experience", H.MODULE]
    saved = {k: sys.modules.get(k) for k in names}
    meta_path = list(sys.meta_path)

    def load(name):
        spec = importlib.util.spec_from_file_location(name, ROOT / (name.replace(".", "/") + ".py"))
        mod = sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    for name, attrs in PPO_STUBS.items():
        sys.modules[name] = types.ModuleType(name)
        sys.modules[name].__dict__.update(attrs)
    for pkg in PACKAGES:
        sys.modules[pkg] = types.ModuleType(pkg)
        sys.modules[pkg].__path__ = [str(ROOT / pkg.replace(".", "/"))]
    load("openrlhf.models.utils")
    loss = load("openrlhf.models.loss")
    sys.modules["openrlhf.models"].__dict__.update(Actor=None, PolicyLoss=loss.PolicyLoss,
                                                   aggregate_loss=loss.aggregate_loss)
    load("openrlhf.utils.loss_utils")
    exp = load("openrlhf.trainer.ppo_utils.experience")
    sys.modules["openrlhf.trainer.ppo_utils"].__dict__.update(Experience=exp.Experience, NaiveReplayBuffer=None)
    H.install()  # what Ray's worker_process_setup_hook runs: the patch lands when ppo_actor is imported
    mod = importlib.import_module(H.MODULE)
    yield mod, exp.Experience
    sys.meta_path[:] = meta_path
    for k, v in saved.items():
        if v is None:
            sys.modules.pop(k, None)
        else:
            sys.modules[k] = v


def rollout(seed: int, n: int = 8, t: int = 10, a: int = 6):
    """One rollout batch: sequences [n, t] (prompt + response), the last `a` columns the actions."""
    rng = np.random.default_rng(seed)
    mask = np.arange(a)[None, :] < rng.integers(1, a + 1, n)[:, None]
    old = np.where(mask, -rng.exponential(1.0, (n, a)), 0.0).astype(np.float32)
    ref = np.where(mask, old + rng.normal(0, 0.7, (n, a)), 0.0).astype(np.float32)
    ref[0, 0] = old[0, 0] + 12.0  # k3's log ratio below -10 and a value past the +-10 clamp
    sampler = np.where(mask, np.minimum(old + rng.normal(0, 0.3, (n, a)), -1e-3), 0.0).astype(np.float32)
    theta = np.where(mask, old + rng.normal(0, 0.05, (n, a)), 0.0).astype(np.float32)
    seqs = rng.integers(3, 50, (n, t))
    return dict(old=old, ref=ref, sampler=sampler, theta=theta, mask=mask, seqs=seqs,
                adv=rng.normal(0, 1, (n, a)).astype(np.float32), prompts=[f"p{i // 4}" for i in range(n)])


def make_trainer(mod, experience_cls, cfg, micro_size, epochs, gas):
    data = {}

    def collate(idx):
        d, i = data["batch"], torch.tensor(idx)
        t = {k: torch.from_numpy(np.asarray(d[k]))[i] for k in ("old", "ref", "sampler", "mask", "seqs", "adv")}
        e = experience_cls(sequences=t["seqs"], action_mask=t["mask"], attention_mask=torch.ones_like(t["seqs"]),
                           action_log_probs=t["old"], base_action_log_probs=t["ref"], rollout_log_probs=t["sampler"],
                           advantages=t["adv"], index=list(idx), prompts=[d["prompts"][j] for j in idx])
        e.theta = torch.from_numpy(d["theta"])[i]
        return e

    class Buffer(list):
        sample_batch_size = micro_size
        collate_fn = staticmethod(collate)

    class Actor:  # the HF model's forward: a given pi_theta for the micro-batch's rows
        def train(self):
            pass

        def __call__(self, sequences, action_mask, **kw):
            e = data["experience"]
            return e.theta, NS(entropy=None)

    strategy = NS(ring_attn_group=None, accumulated_gradient=gas, is_rank_0=lambda: False,
                  backward=lambda *a: None, optimizer_step=lambda *a, **k: None, get_grad_norm=lambda a: 0.0,
                  all_reduce=lambda d: d)  # one rank
    kl = NS(use_loss=True, init_coef=cfg["init_coef"], estimator=cfg["estimator"],
            unbiased_gradient=cfg["unbiased_gradient"], target=None, horizon=10000)
    adv = NS(is_correction_level=cfg["level"], is_correction_mode="mask", is_correction_gating="ratio",
             is_correction_threshold=[0.8, 1.25], estimator="group_norm")
    args = NS(train=NS(dynamic_batch_enable=False, max_epochs=epochs, micro_batch_size=micro_size, batch_size=8),
              ds=NS(tensor_parallel_size=1), critic=NS(freezing_steps=-1),
              actor=NS(entropy_coef=None, eps_clip_low_high=(0.2, 0.28), dual_clip=None), algo=NS(kl=kl, advantage=adv),
              rollout=NS(temperature=0.9, top_p=1.0, n_samples_per_prompt=4))
    trainer = object.__new__(mod.ActorPPOTrainer)
    trainer.__dict__.update(args=args, strategy=strategy, replay_buffer=Buffer(), max_epochs=epochs,
                            dataloader_pin_memory=False, actor=Actor(), ema_model=None, aux_loss=False,
                            actor_optim=None, actor_scheduler=NS(get_last_lr=lambda: [0.0]),
                            actor_loss_fn=mod.PolicyLoss(is_correction_level=cfg["level"],
                                                         is_correction_threshold=[0.8, 1.25]))
    inner = trainer.training_step

    def training_step(experience, *a):  # what the actor's forward needs to know (the stub above)
        data["experience"] = experience
        return inner(experience, *a)
    trainer.training_step = training_step  # the patched class method runs inside `inner`
    return trainer, data


def run_steps(ppo_actor, tmp_path, monkeypatch, cfg, steps=2, micro_size=3, epochs=2, gas=2):
    """Run `steps` OpenRLHF fits through the hook; (the run, {logged step: ppo_train status})."""
    mod, experience_cls = ppo_actor
    monkeypatch.setenv(H.ENV_RUN, str(tmp_path / "run"))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    H.STATE.__init__()
    trainer, data = make_trainer(mod, experience_cls, cfg, micro_size, epochs, gas)
    logged = {}
    torch.manual_seed(0)
    for global_step in range(steps):  # the driver: PPOTrainer.train_step(global_step) logs at global_step + 1
        data["batch"] = rollout(global_step)
        trainer.replay_buffer[:] = range(len(data["batch"]["mask"]))
        logged[global_step + 1] = trainer.ppo_train(kl_ctl=0.01)
    H.close()
    return tmp_path / "run", logged


CONFIGS = [{"estimator": e, "unbiased_gradient": u, "init_coef": 0.01, "level": lvl}
           for e, u, lvl in (("k3", True, "token"), ("k3", False, "seq"), ("k1", True, "token"), ("k2", False, "off"))]
CONFIGS.append({"estimator": "k3", "unbiased_gradient": True, "init_coef": 0.0, "level": "token"})


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_crosswalk_equals_openrlhfs_logged_metrics_and_audit_agrees(ppo_actor, tmp_path, monkeypatch, cfg):
    path, logged = run_steps(ppo_actor, tmp_path, monkeypatch, cfg)
    run = open_run(path)
    table = X.crosswalk(run, "openrlhf").to_pylist()
    assert [r["step"] for r in table] == sorted(logged)
    names = ["kl", "logprobs_diff"] + (["vllm_kl", "is_filter_ratio"] if cfg["level"] != "off" else [])
    worst = 0.0
    for row in table:
        for name in names:
            want, got = logged[row["step"]][name], row[name]
            assert got == pytest.approx(want, rel=2e-5, abs=1e-7), (name, row["step"])
            worst = max(worst, abs(got - want) / max(abs(want), 1e-12) if want else abs(got))
    print(f"max rel diff {worst:.2e} over {names}")
    logs = tmp_path / "logs.jsonl"  # what OpenRLHF's WandbLogger.log_train writes: train/<key> at global_step
    logs.write_text("".join(json.dumps({"global_step": s, **{f"train/{k}": float(v) for k, v in st.items()}}) + "\n"
                            for s, st in logged.items()))
    result = audit(run, logs, framework="openrlhf")
    assert result.step_offset == 0
    verdicts = {m.name: m.verdict for m in result.metrics}
    assert all(verdicts[n] == "agree" for n in names), verdicts


def test_manifest_records_the_settings_and_the_null_reasons(ppo_actor, tmp_path, monkeypatch):
    path, _ = run_steps(ppo_actor, tmp_path, monkeypatch, CONFIGS[0], steps=1)
    run = open_run(path)
    m = run.manifest
    assert m.trainer["name"] == "openrlhf" and m.config["kl_unbiased_gradient"] is True
    assert m.config["estimator"] == "k3_clamped" and m.config["accumulated_gradient"] == 2
    assert m.config["engine_sampling"]["temperature"] == 0.9
    assert m.config["engine_sampling"]["logprobs_mode"] == "processed_logprobs"
    assert "no sample id" in m.config["null_reasons"]["seq_ids"]
    t = run.read(columns=["seq", "group", "iteration", "micro", "token_id"]).to_pandas()
    # 8 samples, micro-batches of 3 (drop_last: 2 per epoch), 2 epochs: micro 0-1, iteration 0-1
    assert sorted(t.micro.unique()) == [0, 1] and sorted(t.iteration.unique()) == [0, 1]
    assert t["group"].notna().all() and t.groupby("seq")["group"].nunique().max() == 1 and t["group"].nunique() == 2
    assert t.token_id.min() >= 3  # the action columns of `sequences` (rollout's token ids are 3..49)


def test_unsupported_version_fails_at_attach_time_naming_the_supported_one():
    with pytest.raises(IntegrationError, match=r"openrlhf==0.11.2, found openrlhf 0.10.0"):
        H.check_version("0.10.0")


def test_a_failing_record_never_reaches_training(ppo_actor, tmp_path, monkeypatch):
    monkeypatch.setattr(H, "record_micro_batch", lambda *a: 1 / 0)
    with pytest.warns(RuntimeWarning, match="training goes on"):
        _, logged = run_steps(ppo_actor, tmp_path, monkeypatch, CONFIGS[0], steps=1)
    assert np.isfinite(logged[1]["kl"])


def test_the_launcher_starts_openrlhfs_own_entry_point_with_the_setup_hook(monkeypatch, tmp_path):
    import runpy

    seen = {}
    monkeypatch.setitem(sys.modules, "ray", types.SimpleNamespace(init=lambda **kw: seen.update(kw)))
    monkeypatch.setattr(runpy, "run_module", lambda name, **kw: seen.update(module=name, argv=list(sys.argv)))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setenv(H.ENV_RUN, str(tmp_path / "run"))
    H.main(["--pretrain", "tiny", "--algo.kl.use_loss"])
    assert seen["module"] == "openrlhf.cli.train_ppo_ray" and seen["argv"][1:] == ["--pretrain", "tiny",
                                                                                    "--algo.kl.use_loss"]
    env = seen["runtime_env"]
    assert env["worker_process_setup_hook"] == H.HOOK and env["env_vars"][H.ENV_RUN] == str(tmp_path / "run")
    assert set(env["env_vars"]) >= {"TOKENIZERS_PARALLELISM", "NCCL_DEBUG", "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS"}
    monkeypatch.delenv(H.ENV_RUN)
    with pytest.raises(IntegrationError, match=H.ENV_RUN):
        H.main([])


@pytest.mark.parametrize("resume, freezing, fits, logged", [(0, -1, 1, 1), (0, -1, 3, 3), (0, 2, 1, 4), (10, 2, 1, 11)])
def test_the_step_is_the_drivers_logged_global_step(resume, freezing, fits, logged):
    """PPOTrainer.train_step(g) runs the actor fit only once g > freezing_steps and logs at g + 1
    (trainer/ppo_trainer.py); resuming starts g at the checkpoint's global_step."""
    H.STATE.__init__()
    H.STATE.resume_step, H.STATE.fits = resume, fits
    assert H.step_of(NS(args=NS(critic=NS(freezing_steps=freezing)))) == logged
    H.STATE.__init__()
