"""kldiag.integrations.areal on AReaL 1.0.4's own code (the installed package, unmodified): the real
`PPOActor._compute_advantages`, `PPOActor._ppo_update`, `grpo_loss_fn`, `ppo_actor_loss_fn`,
`apply_rejection_sampling`, AReaL's micro-batch split and packing and its `stats_tracker` run two trainer steps on
tiny tensors on this CPU, through kldiag's recording actor mixin. Stubbed: the FSDP engine's model forward and
optimizer (the engine below splits, packs and hands a given pi_theta to the loss, as `FSDPEngine.train_batch`
does), and the tracker libraries AReaL imports for logging (wandb, swanlab, trackio, tensorboardX), which the
hook's path never calls. The run's crosswalk equals what AReaL's stats_tracker exported for the same
micro-batches, and `kldiag audit` of the run against those logs agrees at step offset 0."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import sys
import types

import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("areal") is None:
    pytest.skip("areal 1.0.4 is not installed (make setup)", allow_module_level=True)

import kldiag.crosswalk as X  # noqa: E402
from kldiag.crosswalk.audit import audit  # noqa: E402
from kldiag.errors import IntegrationError  # noqa: E402
from kldiag.format import open_run  # noqa: E402
from kldiag.integrations import areal as H  # noqa: E402

TRACKERS = {"swanlab": {}, "trackio": {}, "wandb": {}, "tensorboardX": {"SummaryWriter": None}}


@pytest.fixture(scope="module")
def areal():
    saved = {k: sys.modules.get(k) for k in TRACKERS}
    for name, attrs in TRACKERS.items():
        if importlib.util.find_spec(name) is None:
            mod = sys.modules[name] = types.ModuleType(name)
            mod.__spec__ = importlib.machinery.ModuleSpec(name, None)
            mod.__dict__.update(attrs)
    from areal.api.cli_args import MicroBatchSpec, PPOActorConfig, RejectionSamplingConfig
    from areal.trainer.ppo.actor import PPOActor
    from areal.utils import stats_tracker
    from areal.utils.data import pack_tensor_dict, split_padded_tensor_dict_into_mb_list

    yield types.SimpleNamespace(PPOActor=PPOActor, PPOActorConfig=PPOActorConfig, RS=RejectionSamplingConfig,
                                MicroBatchSpec=MicroBatchSpec, stats=stats_tracker, pack=pack_tensor_dict,
                                split=split_padded_tensor_dict_into_mb_list)
    for k, v in saved.items():
        if v is None:
            sys.modules.pop(k, None)
        else:
            sys.modules[k] = v


def engine_class(a):
    class Engine:
        """FSDPPPOActor's shape: `self.actor = PPOActor(config, self)`; train_batch splits into 2 micro-batches,
        packs them and calls the loss with pi_theta (a given function of the packed tokens)."""

        data_parallel_rank, data_parallel_world_size = 0, 1

        def __init__(self, config):
            self.config, self.version = config, 0
            self.actor = a.PPOActor(config, self)

        def train(self, mode=True):
            pass

        def get_version(self):
            return self.version

        def is_data_parallel_head(self):
            return True

        def compute_advantages(self, data):
            return self.actor.compute_advantages(data)

        def ppo_update(self, data):
            self.actor.ppo_update(data)

        def train_batch(self, input_, loss_fn, loss_weight_fn):
            for mb in a.split(input_, a.MicroBatchSpec(n_mbs=2)).mbs:
                packed = a.pack(mb)
                base = packed["prox_logp"] if packed.get("prox_logp") is not None else packed["logprobs"]
                theta = base + 0.05 * torch.cos(packed["input_ids"].float() * 1.3)
                loss_fn(theta, torch.ones_like(theta), packed)
            return {}
    return type("RecordingEngine", (H.RecordingActor, Engine), {})


def trajectory(seed: int, recompute: bool, b: int = 8, t: int = 9):
    """What AReaL's rollout gives the trainer, plus the trainer's recomputed prox_logp (next-token layout)."""
    g = torch.Generator().manual_seed(seed)
    group = torch.arange(b) // 4  # two prompt groups of 4 samples: the same prompt tokens
    prompt = 2 + group
    length = prompt + torch.randint(1, t - 3, (b,), generator=g)
    col = torch.arange(t)[None, :]
    attn = col < length[:, None]
    loss_mask = (col >= prompt[:, None]) & attn
    ids = torch.randint(5, 60, (b, t), generator=g) * attn
    ids = torch.where(col < prompt[:, None], group[:, None] * 7 + col + 1, ids)
    mu = torch.where(loss_mask, -torch.rand(b, t, generator=g) * 2 - 0.01, 0.0)
    versions = torch.where(loss_mask, torch.full((b, t), seed), torch.full((b, t), -1))
    d = {"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask.int(), "logprobs": mu.float(),
         "rewards": torch.randn(b, generator=g), "versions": versions}
    if recompute:
        mu_next = torch.roll(mu, -1, -1)
        d["prox_logp"] = torch.where(torch.roll(loss_mask, -1, -1), mu_next + 0.3 * torch.randn(b, t, generator=g), 0.0)
    return d


CONFIGS = {
    "defaults": {},
    "decoupled-token-mask-ratio": dict(recompute_logprob=True, use_decoupled_loss=True,
                                       rs=dict(level="token", action="mask", metric="ratio", upper=1.3, lower=0.8)),
    "decoupled-seq-clamp-ratio-max": dict(recompute_logprob=True, use_decoupled_loss=True,
                                          rs=dict(level="sequence", action="clamp", metric="ratio", agg="max",
                                                  upper=1.2)),
    "decoupled-seq-mask-k3-max": dict(recompute_logprob=True, use_decoupled_loss=True,
                                      rs=dict(level="sequence", action="mask", metric="kl_k3", agg="max", upper=0.05)),
    "decoupled-token-clamp-ratio": dict(recompute_logprob=True, use_decoupled_loss=True,
                                        rs=dict(level="token", action="clamp", metric="ratio", upper=1.2, lower=0.9)),
    "recompute-seq-mask-ratio-mean": dict(recompute_logprob=True, use_decoupled_loss=False,
                                          rs=dict(level="sequence", action="mask", metric="ratio", agg="mean",
                                                  upper=1.1)),
    "decoupled-seq-mask-k1-sum": dict(recompute_logprob=True, use_decoupled_loss=True,
                                      rs=dict(level="sequence", action="mask", metric="kl_k1", agg="sum", upper=0.2,
                                              lower=-0.2)),
}


def run_steps(a, tmp_path, monkeypatch, cfg, steps=2):
    monkeypatch.setenv(H.ENV_RUN, str(tmp_path / "run"))
    H.STATE.__init__()
    kw = {k: v for k, v in cfg.items() if k != "rs"}
    config = a.PPOActorConfig(ppo_n_minibatches=2, kl_ctl=0.0, **kw,
                              rejection_sampling=a.RS(**cfg["rs"]) if "rs" in cfg else None)
    engine = engine_class(a)(config)
    logged = {}
    a.stats.export_all()  # start from an empty tracker
    for step in range(steps):  # PPOTrainer.train: compute_advantages, ppo_update, stats committed at global_step
        engine.version = step
        traj = trajectory(step, bool(cfg.get("recompute_logprob")))
        rows = [{k: v[i:i + 1] for k, v in traj.items()} for i in range(len(traj["rewards"]))]
        data = engine.compute_advantages(rows)
        engine.ppo_update(data)
        logged[step] = a.stats.export_all()
    H.close()
    return tmp_path / "run", logged


@pytest.mark.parametrize("name", CONFIGS)
def test_crosswalk_equals_areals_stats_tracker_and_audit_agrees(areal, tmp_path, monkeypatch, name):
    path, logged = run_steps(areal, tmp_path, monkeypatch, CONFIGS[name])
    table = X.crosswalk(open_run(path), "areal").to_pylist()
    assert [r["step"] for r in table] == sorted(logged)
    compared, worst = set(), 0.0
    for row in table:
        theirs = logged[row["step"]]
        for k, v in row.items():
            if k == "step" or v is None:
                continue
            assert k in theirs, k
            assert v == pytest.approx(theirs[k], rel=1e-5, abs=1e-6), (k, row["step"])
            if abs(theirs[k]) > 1e-4:  # near 0 the absolute tolerance (float32 sums) decides
                worst = max(worst, abs(v - theirs[k]) / abs(theirs[k]))
            compared.add(k)
    kl_div = ("kl_div_direct", "kl_div_taylor", "kl_div_dual")
    assert {f"ppo_actor/update/compute_logp/{k}/avg" for k in kl_div} <= compared
    if "rs" in CONFIGS[name]:
        assert {"ppo_actor/update/behave_imp_weight/avg", "ppo_actor/update/behave_approx_kl/max",
                "ppo_actor/update/rs_filtered_fraction"} <= compared
    print(f"{name}: {len(compared)} metrics, max rel diff {worst:.2e}")
    logs = tmp_path / "stats.jsonl"
    logs.write_text("".join(json.dumps({"step": s, **st}) + "\n" for s, st in logged.items()))
    result = audit(path, logs, framework="areal")
    assert result.step_offset == 0
    bad = {m.name: m.verdict for m in result.metrics if m.name in compared and m.verdict != "agree"}
    assert not bad and {m.name for m in result.metrics} >= compared


def test_the_engines_logprobs_survive_the_recompute_overwrite(areal, tmp_path, monkeypatch):
    """recompute_logprob without the decoupled loss overwrites `logprobs` with pi_old (actor.py): the hook keeps mu."""
    path, _ = run_steps(areal, tmp_path, monkeypatch, CONFIGS["recompute-seq-mask-ratio-mean"], steps=1)
    t = open_run(path).read(columns=["logp_old", "logp_sampler", "mask", "seq", "group", "token_id"]).to_pandas()
    t = t[t["mask"]]
    assert t.logp_sampler.notna().all() and (t.logp_old - t.logp_sampler).abs().max() > 0.05
    assert t["group"].nunique() == 2 and t.groupby("seq")["group"].nunique().max() == 1


def test_manifest_and_version_check(areal, tmp_path, monkeypatch):
    path, _ = run_steps(areal, tmp_path, monkeypatch, CONFIGS["decoupled-token-mask-ratio"], steps=1)
    m = open_run(path).manifest
    assert m.trainer["name"] == "areal" and m.config["rs_level"] == "token" and m.config["use_decoupled_loss"]
    assert "gconfig" in m.config["null_reasons"]["engine_sampling"]
    with pytest.raises(IntegrationError, match=r"areal==1.0.4, found areal 0.5.0"):
        H.check_version("0.5.0")


def test_the_trainer_swap_builds_the_recording_actor_the_workers_can_import(areal, monkeypatch):
    """kldiag's PPOTrainer._create_train_engine (AReaL's own method for the reference model) hands AReaL's
    controller the recording engine class, which a worker imports back by its module path."""
    import importlib

    import areal.trainer.ppo.actor as actor_mod
    import areal.trainer.rl_trainer as rl

    made = []
    monkeypatch.setattr(rl, "is_single_controller", lambda: True)
    monkeypatch.setattr(actor_mod, "PPOActorController", lambda train_engine, config, scheduler: made.append(
        train_engine) or types.SimpleNamespace(create_process_group=lambda parallel_strategy: None))
    trainer = object.__new__(H.PPOTrainer)
    trainer.config, trainer.scheduler = types.SimpleNamespace(actor=areal.PPOActorConfig()), None
    alloc = types.SimpleNamespace(backend="fsdp", parallel=None)
    trainer._create_train_engine(trainer.config.actor, alloc)
    trainer._create_train_engine(areal.PPOActorConfig(), alloc)  # the reference model: AReaL's own engine
    recording, plain = made
    assert recording.__name__ == "RecordingFSDPPPOActor" and plain.__name__ == "FSDPPPOActor"
    assert getattr(importlib.import_module(recording.__module__), recording.__name__) is recording
    assert issubclass(recording, plain)


def test_per_token_versions_are_recorded(areal, tmp_path, monkeypatch):
    """AReaL's per-token `versions` (the step's own on every generated token here, -1 on the prompt) reach
    policy_version on every recorded token: the prompt's -1 takes the first generated token's version."""
    run, _ = run_steps(areal, tmp_path, monkeypatch, CONFIGS["defaults"])
    t = open_run(run).read(columns=["step", "mask", "policy_version"]).to_pandas()
    assert len(t) and t.policy_version.notna().all() and (t.policy_version == t.step).all()


def test_token_versions_keep_a_straddling_sequence():
    """A sequence whose generation crossed a weight update (interruptible generation) keeps each token's version;
    the prompt and padding take its first generated token's; a row without a version leaves them all out."""
    v = torch.tensor([[-1, -1, 3, 3, 4, 4, 0], [-1, 5, 5, 5, 5, -1, -1]])
    keep = torch.tensor([[1, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    assert H.token_versions(v, keep).tolist() == [[3, 3, 3, 3, 4, 4, 3], [5, 5, 5, 5, 5, 5, 5]]
    assert H.token_versions(torch.full((1, 3), -1), torch.ones(1, 3, dtype=torch.bool)) is None
