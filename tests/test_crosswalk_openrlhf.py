"""kldiag's OpenRLHF crosswalk equals OpenRLHF's own `PolicyLoss` (openrlhf 0.11.2, the PyPI wheel that
`make setup` downloads to .venv/wheels), run unmodified on the same tokens: `openrlhf/models/loss.py` and
`openrlhf/models/utils.py` are loaded from the wheel as they are; only `deepspeed`, which a CPU machine
lacks and `PolicyLoss` never calls, is stubbed."""

from __future__ import annotations

import importlib.util
import sys
import types
import zipfile
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kldiag.crosswalk import openrlhf as OX  # noqa: E402
from kldiag.crosswalk.batch import StepBatch  # noqa: E402

WHEELS = Path(__file__).resolve().parent.parent / ".venv" / "wheels"


def unpack_wheel(tmp_path_factory, names) -> Path:
    """The openrlhf 0.11.2 wheel's files `names` (paths inside the package tree), unmodified, under a new
    folder (skip without the wheel that make setup downloads)."""
    wheels = sorted(WHEELS.glob("openrlhf-0.11.2-*.whl"))
    if not wheels:
        pytest.skip("no openrlhf 0.11.2 wheel: run make setup (pip download openrlhf==0.11.2 --no-deps)")
    root = tmp_path_factory.mktemp("openrlhf")
    with zipfile.ZipFile(wheels[0]) as z:
        for name in names:
            member = next(n for n in z.namelist() if n.endswith(name))
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_bytes(z.read(member))
    return root


@pytest.fixture(scope="module")
def policy_loss(tmp_path_factory):
    root = unpack_wheel(tmp_path_factory, ("openrlhf/models/loss.py", "openrlhf/models/utils.py"))
    saved = {k: sys.modules.get(k) for k in ("deepspeed", "openrlhf", "openrlhf.models")}
    sys.modules["deepspeed"] = types.ModuleType("deepspeed")
    for pkg in ("openrlhf", "openrlhf.models"):
        sys.modules[pkg] = types.ModuleType(pkg)
        sys.modules[pkg].__path__ = [str(root / pkg.replace(".", "/"))]
    mods = {}
    for name in ("utils", "loss"):
        path = root / "openrlhf" / "models" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(f"openrlhf.models.{name}", path)
        mods[name] = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mods[name]
        spec.loader.exec_module(mods[name])
    yield mods["loss"].PolicyLoss
    for k, v in saved.items():
        if v is None:
            sys.modules.pop(k, None)
        else:
            sys.modules[k] = v
    for k in ("openrlhf.models.utils", "openrlhf.models.loss"):
        sys.modules.pop(k, None)


def tokens(dtype, seed: int = 0):
    """[B, T] log-probs with right padding, one sequence with no token in the loss, ratios on both
    sides of the bands (some extreme), and a sequence whose ratios are exactly 1 (the edge of a band at 1)."""
    rng = np.random.default_rng(seed)
    b, t = 7, 9
    mask = np.arange(t)[None, :] < rng.integers(2, t + 1, b)[:, None]
    mask[3] = False  # a sequence with no trained token: its sequence statistic is NaN
    old = -rng.exponential(1.0, (b, t))
    rollout = old + rng.normal(0, 0.6, (b, t))
    rollout[0, 1] = old[0, 1] - 6.0
    rollout[:, :] = np.minimum(rollout, -1e-6)
    rollout[5, :] = old[5, :]  # ratio exactly 1.0 (statistic 0 for binary_kl and tv): on a band's edge
    old, rollout = np.where(mask, old, 0.0), np.where(mask, rollout, 0.0)
    return [np.asarray(x).astype(dtype) for x in (old, rollout)] + [mask]


CONFIGS = [(level, mode, gating, thr) for level in ("token", "seq") for mode, gating, thr in (
    ("mask", "ratio", (0.5, 5.0)), ("mask", "ratio", (0.8, 1.25)), ("clip", "ratio", (0.8, 1.25)),
    ("mask", "binary_kl", (0.0, 0.01)), ("mask", "tv", (0.0, 0.05)),
    ("mask", "ratio", (1.0, 5.0)), ("mask", "ratio", (0.5, 1.0)), ("clip", "ratio", (1.0, 2.0)))
    if not (mode == "clip" and level == "seq")]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("level, mode, gating, threshold", CONFIGS)
def test_is_filter_ratio_and_vllm_kl_equal_openrlhfs(policy_loss, level, mode, gating, threshold, dtype):
    old, rollout, mask = tokens(dtype)
    loss = policy_loss(is_correction_level=level, is_correction_mode=mode, is_correction_gating=gating,
                       is_correction_threshold=list(threshold))
    t = {k: torch.from_numpy(v) for k, v in (("old", old), ("rollout", rollout))}
    m = torch.from_numpy(mask).to(t["old"].dtype)
    _, _, _, vllm_kl, ratio = loss(t["old"], t["old"], torch.ones_like(t["old"]), m, rollout_log_probs=t["rollout"])
    n = len(mask)
    b = StepBatch(0, np.arange(n), mask, old.astype(float), old.astype(float), np.full(old.shape, np.nan),
                  rollout.astype(float), np.ones(n), np.zeros(n, np.int64), np.zeros(n, np.int64))
    mine, why = OX.step_metrics(b, OX.Settings(level, mode, gating, threshold))
    tol = 1e-12 if dtype == np.float64 else 2e-6
    assert mine["vllm_kl"] == pytest.approx(float(vllm_kl), rel=tol, abs=tol)
    # OpenRLHF takes the filtered share with .float(): float32 whatever the inputs
    assert mine["is_filter_ratio"] == pytest.approx(float(ratio), rel=2e-7, abs=1e-12)
    assert set(why) == set(OX.KL_NAMES)  # kl_use_loss is off by default: only the KL loss's figures are null


@pytest.mark.parametrize("kw, reason", [
    ({"is_correction_gating": "tv"}, "upper bound only"),  # tv with the default band (0.5, 5.0)
    ({"is_correction_mode": "clip", "is_correction_level": "seq"}, "requires is_correction_level=token"),
    ({"is_correction_level": "tokens"}, "off/token/seq"),
])
def test_configurations_openrlhf_refuses_are_refused_with_its_reason(policy_loss, kw, reason):
    with pytest.raises(ValueError, match=reason):
        policy_loss(**{"is_correction_level": "token", **kw})
    with pytest.raises(ValueError, match=reason):
        OX.Settings(**kw)


def test_threshold_takes_high_alone_or_low_high():
    assert OX.Settings(is_correction_gating="tv", is_correction_threshold="0.05").is_correction_threshold == (0.0, 0.05)
    assert OX.Settings(is_correction_threshold="0.5 2").is_correction_threshold == (0.5, 2.0)
    assert OX.Settings(is_correction_threshold=[0.9, 1.1]).is_correction_threshold == (0.9, 1.1)


# ---- the step's figure: OpenRLHF's own ppo_train over several micro-batches and epochs ----

PPO_TRAIN_FILES = ("openrlhf/models/loss.py", "openrlhf/models/utils.py", "openrlhf/utils/loss_utils.py",
                   "openrlhf/trainer/ppo_utils/experience.py", "openrlhf/trainer/ray/ppo_actor.py")
# what ppo_actor.py imports but ppo_train / training_step never call on one CPU rank (DeepSpeed, Ray, vLLM,
# the HF actor, tokenizer and replay-buffer classes): empty stand-ins
PPO_STUBS = {"deepspeed": {}, "ray": {"remote": lambda **kw: (lambda cls: cls)},
             "openrlhf.utils": {"get_tokenizer": None},
             "openrlhf.utils.utils": {"zero_pad_sequences": None},
             "openrlhf.utils.deepspeed": {"DeepspeedStrategy": None},
             "openrlhf.utils.deepspeed.deepspeed_utils": {"offload_deepspeed_states": None,
                                                          "reload_deepspeed_states": None},
             "openrlhf.utils.distributed_util": {"stateless_init_process_group": None,
                                                 "torch_dist_barrier_and_cuda_sync": None},
             "openrlhf.utils.logging_utils": {"init_logger": __import__("logging").getLogger},
             "openrlhf.utils.vlm_utils": {"merge_mm_train_inputs": None},
             "openrlhf.trainer.ray.launcher": {"BaseModelActor": object},
             "openrlhf.trainer.ray.utils": {"get_physical_gpu_id": None}}


@pytest.fixture(scope="module")
def ppo_actor(tmp_path_factory):
    """openrlhf 0.11.2's `openrlhf/trainer/ray/ppo_actor.py` module, loaded unmodified from the wheel."""
    root = unpack_wheel(tmp_path_factory, PPO_TRAIN_FILES)
    names = [*PPO_STUBS, "openrlhf", "openrlhf.models", "openrlhf.trainer", "openrlhf.trainer.ppo_utils",
             "openrlhf.trainer.ray", "openrlhf.models.utils", "openrlhf.models.loss", "openrlhf.utils.loss_utils",
             "openrlhf.trainer.ppo_utils.experience", "openrlhf.trainer.ray.ppo_actor"]
    saved = {k: sys.modules.get(k) for k in names}

    def load(name):
        spec = importlib.util.spec_from_file_location(name, root / (name.replace(".", "/") + ".py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        return mod

    for name, attrs in PPO_STUBS.items():
        sys.modules[name] = types.ModuleType(name)
        sys.modules[name].__dict__.update(attrs)
    for pkg in ("openrlhf", "openrlhf.models", "openrlhf.trainer", "openrlhf.trainer.ppo_utils",
                "openrlhf.trainer.ray"):
        sys.modules[pkg] = types.ModuleType(pkg)
        sys.modules[pkg].__path__ = [str(root / pkg.replace(".", "/"))]
    load("openrlhf.models.utils")
    loss = load("openrlhf.models.loss")
    sys.modules["openrlhf.models"].__dict__.update(Actor=None, PolicyLoss=loss.PolicyLoss,
                                                   aggregate_loss=loss.aggregate_loss)
    load("openrlhf.utils.loss_utils")
    exp = load("openrlhf.trainer.ppo_utils.experience")
    sys.modules["openrlhf.trainer.ppo_utils"].__dict__.update(Experience=exp.Experience, NaiveReplayBuffer=None)
    yield load("openrlhf.trainer.ray.ppo_actor"), exp.Experience
    for k, v in saved.items():
        if v is None:
            sys.modules.pop(k, None)
        else:
            sys.modules[k] = v


def ppo_train_step(ppo_actor, tmp_path, settings, micro_size=3, epochs=2, seed=1):
    """Run OpenRLHF's ActorPPOTrainer.ppo_train (shuffled micro-batches, `epochs` epochs) on one rollout
    batch of `tokens(float32)`, recording every micro-batch it trains into a kldiag run as a trainer hook
    would (micro = its index in the epoch, iteration = the epoch); (OpenRLHF's status_mean, the run)."""
    from types import SimpleNamespace as NS

    from kldiag.record.recorder import Recorder

    mod, experience_cls = ppo_actor
    old, rollout, mask = tokens(np.float32, seed)
    n = len(mask)
    rec = Recorder(tmp_path, trainer="openrlhf")
    seen = {"epoch": 0, "micro": 0}

    def collate(idx):
        idx = torch.tensor(idx)
        t = {k: torch.from_numpy(v)[idx] for k, v in (("old", old), ("rollout", rollout), ("mask", mask))}
        e = experience_cls(sequences=torch.zeros(len(idx), 1, dtype=torch.long), action_mask=t["mask"],
                           attention_mask=torch.ones(len(idx), 1), action_log_probs=t["old"],
                           rollout_log_probs=t["rollout"], advantages=torch.ones_like(t["old"]), index=idx.tolist())
        return e

    class Buffer(list):
        sample_batch_size = micro_size
        collate_fn = staticmethod(collate)

    class Actor:  # the model forward: pi_theta = pi_old (first update), recorded as a kldiag hook would
        def train(self):
            pass

        def __call__(self, sequences, action_mask, **kw):
            e = seen["experience"]
            rec.record(step=0, logp=e.action_log_probs.numpy(), logp_old=e.action_log_probs.numpy(),
                       logp_sampler=e.rollout_log_probs.numpy(), mask=e.action_mask.numpy(),
                       completion_mask=np.ones(e.action_mask.shape, bool),  # keeps the sequence with no action token
                       seq_ids=np.array(e.index), micro=seen["micro"], iteration=seen["epoch"])
            return e.action_log_probs, NS(entropy=None)

    strategy = NS(ring_attn_group=None, accumulated_gradient=2, is_rank_0=lambda: False,
                  backward=lambda *a: None, optimizer_step=lambda *a, **k: None, get_grad_norm=lambda a: 0.0,
                  all_reduce=lambda d: d)  # one rank: op="mean" over a world of 1
    args = NS(train=NS(dynamic_batch_enable=False), ds=NS(tensor_parallel_size=1),
              actor=NS(entropy_coef=None), algo=NS(kl=NS(use_loss=False)))
    trainer = object.__new__(mod.ActorPPOTrainer)
    trainer.__dict__.update(args=args, strategy=strategy, replay_buffer=Buffer(range(n)), max_epochs=epochs,
                            dataloader_pin_memory=False, actor=Actor(), ema_model=None, aux_loss=False,
                            actor_optim=None, actor_scheduler=NS(get_last_lr=lambda: [0.0]),
                            actor_loss_fn=mod.PolicyLoss(**{f"is_correction_{k}": v for k, v in settings.items()}))
    step = trainer.training_step

    def training_step(experience, *a):
        seen["experience"] = experience
        out = step(experience, *a)
        seen["micro"] += 1
        if seen["micro"] == n // micro_size:
            seen.update(epoch=seen["epoch"] + 1, micro=0)
        return out

    trainer.training_step = training_step
    torch.manual_seed(seed)
    cuda_device = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        status = trainer.ppo_train(kl_ctl=0.0)
    finally:
        torch.cuda.current_device = cuda_device
        rec.close()
    return status, tmp_path


STEP_CONFIGS = [{"level": "seq", "mode": "mask", "gating": "ratio", "threshold": [0.8, 1.25]},
                {"level": "seq", "mode": "mask", "gating": "tv", "threshold": [0.0, 0.05]},
                {"level": "token", "mode": "mask", "gating": "ratio", "threshold": [0.8, 1.25]},
                {"level": "token", "mode": "clip", "gating": "ratio", "threshold": [0.5, 5.0]}]


@pytest.mark.parametrize("cfg", STEP_CONFIGS)
def test_step_figures_equal_openrlhfs_ppo_train_over_micro_batches_and_epochs(ppo_actor, tmp_path, cfg):
    """ppo_train weights each micro-batch's 0-d vllm_kl / is_filter_ratio by its action tokens; with 7
    sequences in shuffled micro-batches of 3 (one dropped per epoch, drop_last) over 2 epochs."""
    import kldiag.crosswalk as X

    status, run = ppo_train_step(ppo_actor, tmp_path, cfg)
    table = X.crosswalk(run, "openrlhf", **{f"is_correction_{k}": v for k, v in cfg.items()})
    mine = table.to_pylist()[0]
    assert mine["vllm_kl"] == pytest.approx(status["vllm_kl"], rel=1e-6)
    assert mine["is_filter_ratio"] == pytest.approx(status["is_filter_ratio"], rel=1e-6, abs=1e-9)


def test_seq_filter_ratio_depends_on_the_micro_batches(ppo_actor, tmp_path):
    """The whole step as one batch is a different figure: the micro column is what makes it exact."""
    import kldiag.crosswalk as X

    cfg = STEP_CONFIGS[0]
    status, run = ppo_train_step(ppo_actor, tmp_path, cfg, micro_size=2, epochs=1, seed=3)
    old, rollout, mask = tokens(np.float32, 3)
    one = StepBatch(0, np.arange(len(mask)), mask, old.astype(float), old.astype(float), np.full(old.shape, np.nan),
                    rollout.astype(float), np.ones(len(mask)), np.zeros(len(mask), np.int64),
                    np.zeros(len(mask), np.int64))
    whole, _ = OX.step_metrics(one, OX.Settings(**{f"is_correction_{k}": v for k, v in cfg.items()}))
    got = X.crosswalk(run, "openrlhf", **{f"is_correction_{k}": v for k, v in cfg.items()}).to_pylist()[0]
    assert got["is_filter_ratio"] == pytest.approx(status["is_filter_ratio"], rel=1e-6)
    assert abs(whole["is_filter_ratio"] - status["is_filter_ratio"]) > 1e-3


@pytest.mark.parametrize("level", ["token", "seq"])
def test_a_nan_rollout_token_filters_as_openrlhf_and_vllm_kl_is_null_with_why(policy_loss, level):
    """OpenRLHF's mask mode counts a NaN statistic as filtered (it fails stat >= low): is_filter_ratio stays a
    number, equal to OpenRLHF's; vllm_kl is NaN there, so kldiag gives null with the reason."""
    old, rollout, mask = tokens(np.float64)
    rollout[1, 1] = np.nan
    loss = policy_loss(is_correction_level=level, is_correction_mode="mask", is_correction_threshold=[0.8, 1.25])
    t = {k: torch.from_numpy(v) for k, v in (("old", old), ("rollout", rollout))}
    _, _, _, vllm_kl, ratio = loss(t["old"], t["old"], torch.ones_like(t["old"]), torch.from_numpy(mask).double(),
                                   rollout_log_probs=t["rollout"])
    n = len(mask)
    b = StepBatch(0, np.arange(n), mask, old, old, np.full(old.shape, np.nan), np.where(mask, rollout, np.nan),
                  np.ones(n), np.zeros(n, np.int64), np.zeros(n, np.int64))
    mine, why = OX.step_metrics(b, OX.Settings(level, "mask", "ratio", (0.8, 1.25)))
    assert torch.isnan(vllm_kl) and "vllm_kl" not in mine and "NaN" in why["vllm_kl"]
    assert mine["is_filter_ratio"] == pytest.approx(float(ratio), rel=2e-7)
