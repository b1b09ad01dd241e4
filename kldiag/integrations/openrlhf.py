"""Record every PPO micro-batch of an OpenRLHF run, on every actor rank.

    # one command: OpenRLHF's own launcher, started by kldiag (same arguments)
    KLDIAG_RUN=/ckpt/kldiag_run python -m kldiag.integrations.openrlhf --pretrain ... --algo.kl.use_loss ...
    # or, under `ray job submit`: --runtime-env-json '{"worker_process_setup_hook":
    #     "kldiag.integrations.openrlhf.install", "env_vars": {"KLDIAG_RUN": "/ckpt/kldiag_run"}}'

Read at openrlhf 0.11.2 (PyPI wheel). OpenRLHF has no plugin API: its actors are `@ray.remote` classes
hard-coded in `openrlhf/cli/train_ppo_ray.py`. `install` runs in every Ray worker (Ray's
`worker_process_setup_hook`) and patches `openrlhf.trainer.ray.ppo_actor.ActorPPOTrainer` when that module
is imported (never importing deepspeed or vLLM itself). The patch wraps:

- `training_step(experience, kl_ctl, step, loss_batch_info)` (ppo_actor.py l. 259): the loss proxy
  (`self.actor_loss_fn`, l. 303) keeps pi_theta (`action_log_probs`, l. 292); after the step returns,
  one micro-batch is recorded: logp = pi_theta, logp_old = `experience.action_log_probs`, logp_ref =
  `experience.base_action_log_probs` (set with `--algo.kl.use_loss` only), logp_sampler =
  `experience.rollout_log_probs` (vLLM's, with `--algo.advantage.is_correction_level` on), advantages,
  mask = `experience.action_mask`, token_ids = the last A columns of `experience.sequences` (the actor's
  log-probs are `log_probs[:, -A:]` of the shifted logits, models/actor.py l. 298);
- `ppo_train(kl_ctl)` (l. 153): one call per trainer step; the step is the driver's logged `global_step`:
  the driver calls the actor with global_step g and logs at g + 1 (trainer/ppo_trainer.py l. 213-264, 541,
  560), so the k-th fit of this process logs at max(resume, freezing_steps + 1) + k, with resume the
  actor checkpoint's `global_step` (ppo_actor.py l. 573-578) and `--critic.freezing_steps` skipping fits;
- `__init__`: reads that checkpoint's `global_step` from the `PolicyModelActor` that builds the trainer.

Ids: OpenRLHF keeps no sample id on the actor (`Experience.index` is reset when the batch is split), so
seq = a hash of the sample's tokens and old log-probs (kldiag.integrations.common.ids); group = a hash of its
prompt text (`experience.prompts`: the n_samples_per_prompt samples of a prompt share it).
micro = the training_step call within its epoch, iteration = the epoch (ppo_train runs
len(replay_buffer) // micro_batch_size calls per epoch, drop_last; with dynamic batches: micro = the call
within the step, iteration = how often this rank already recorded the sequence in this step).
rank = the DeepSpeed data-parallel rank; ring-attention and tensor-parallel
duplicates of a DP shard (`ds_device_mesh` dims sp, tp) do not write.
Recording failures warn once and never reach training (KLDIAG_STRICT=1 raises them).
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from kldiag.errors import IntegrationError
from kldiag.frameworks import sampling as sampling_settings
from kldiag.frameworks.openrlhf import ESTIMATOR_OF, SUPPORTED
from kldiag.integrations.common.failures import recording_failed
from kldiag.integrations.common.ids import sequence_ids, text_ids
from kldiag.integrations.common.versions import check_release
from kldiag.record.recorder import Recorder

ENV_RUN = "KLDIAG_RUN"
MODULE = "openrlhf.trainer.ray.ppo_actor"
HOOK = "kldiag.integrations.openrlhf.install"
NULL_REASONS = {
    "logp_ref": "OpenRLHF keeps the reference log-probs on the actor only with --algo.kl.use_loss (in reward "
                "mode the driver folds the KL into the reward and drops them, experience_maker.py)",
    "logp_sampler": "vLLM's log-probs reach the actor only with --algo.advantage.is_correction_level token|seq",
    "seq_ids": "OpenRLHF has no sample id on the actor: kldiag hashes each sample's tokens and old log-probs",
}


def check_version(version: str | None = None) -> str:
    """openrlhf's version, or IntegrationError naming SUPPORTED and the fix."""
    return check_release("openrlhf", SUPPORTED, version)


def settings(args: Any, accumulated_gradient: int | None = None) -> dict[str, Any]:
    """The manifest `config` of an OpenRLHF run from its parsed arguments (train_ppo_ray.py's namespace,
    dotted groups as attributes): KL, IS correction, PPO clip, epochs and the engine's sampling settings."""
    g = sampling_settings._get
    kl, adv = g(g(args, "algo"), "kl"), g(g(args, "algo"), "advantage")
    actor, train, rollout = g(args, "actor"), g(args, "train"), g(args, "rollout")
    out: dict[str, Any] = {f"kl_{k}": g(kl, k) for k in ("estimator", "use_loss", "init_coef", "unbiased_gradient",
                                                          "target", "horizon")}
    out.update({k: g(adv, k) for k in ("is_correction_level", "is_correction_mode", "is_correction_gating",
                                       "is_correction_threshold")})
    out["advantage_estimator"] = g(adv, "estimator")
    low_high = g(actor, "eps_clip_low_high")
    off = g(adv, "is_correction_level") in (None, "off")
    out.update({"eps_clip_low_high": list(low_high) if low_high is not None else None,
                "entropy_coef": g(actor, "entropy_coef"), "dual_clip": g(actor, "dual_clip"),
                "max_epochs": g(train, "max_epochs"), "micro_batch_size": g(train, "micro_batch_size"),
                "train_batch_size": g(train, "batch_size"), "dynamic_batch_enable": g(train, "dynamic_batch_enable"),
                "n_samples_per_prompt": g(rollout, "n_samples_per_prompt"),
                "freezing_steps": g(g(args, "critic"), "freezing_steps"),
                "accumulated_gradient": accumulated_gradient, "openrlhf_version": SUPPORTED.lstrip("="),
                "null_reasons": {k: v for k, v in NULL_REASONS.items()
                                 if k == "seq_ids" or (k == "logp_ref" and not g(kl, "use_loss"))
                                 or (k == "logp_sampler" and off)}})
    out["kl_clamp"] = True  # compute_approx_kl clamps every estimator's value to +-10 (models/utils.py l. 110)
    out["estimator"] = ESTIMATOR_OF.get(str(g(kl, "estimator")))
    out["engine_sampling"] = sampling_settings.from_openrlhf(args)
    return out


@dataclass
class _State:
    """This process's recording state (the actor's training loop runs on one thread)."""

    recorder: Any = None
    resume_step: int = 0
    fits: int = 0
    calls: int = 0  # training_step calls in this fit
    per_epoch: int = 0  # training_step calls per epoch (0: unknown, dynamic batches)
    seen: dict[int, int] = field(default_factory=dict)
    failures: int = 0


STATE = _State()


def _warn(e: BaseException) -> None:
    recording_failed(STATE, e, "an OpenRLHF micro-batch")


class _LossTap:
    """`actor_loss_fn` as OpenRLHF calls it, keeping the detached pi_theta it saw (no copy, no sync)."""

    def __init__(self, inner: Any):
        self.inner, self.logp = inner, None

    def __call__(self, log_probs: Any, *args: Any, **kwargs: Any) -> Any:
        self.logp = log_probs.detach()
        return self.inner(log_probs, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _ranks(strategy: Any) -> tuple[int, int, bool]:
    """(DP rank, DP size, whether this process writes): sp/tp duplicates of a DP shard do not."""
    import torch

    mesh = getattr(strategy, "ds_device_mesh", None)
    if mesh is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        dp = mesh["dp"].get_group()
        owner = all(mesh[d].get_local_rank() == 0 for d in ("sp", "tp") if mesh[d].size() > 1)
        return torch.distributed.get_rank(dp), torch.distributed.get_world_size(dp), owner
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), True


def _recorder(trainer: Any) -> Any:
    if STATE.recorder is None:
        run = os.environ.get(ENV_RUN)
        if not run:
            raise IntegrationError(f"set {ENV_RUN} to the kldiag run directory (or URI) the OpenRLHF hook records into")
        strategy = trainer.strategy
        rank, world, _ = _ranks(strategy)
        cfg = settings(trainer.args, getattr(strategy, "accumulated_gradient", None))
        coef = cfg["kl_init_coef"] if cfg["kl_use_loss"] else None
        low_high = cfg["eps_clip_low_high"]
        STATE.recorder = Recorder(run, rank=rank, world_size=world, trainer="openrlhf",
                                  trainer_version=cfg["openrlhf_version"], beta=coef, estimator=cfg["estimator"],
                                  clip_range=tuple(low_high) if low_high else None, config=cfg)
    return STATE.recorder


def step_of(trainer: Any) -> int:
    """The driver's logged global_step of the current fit (module doc)."""
    freezing = getattr(getattr(trainer.args, "critic", None), "freezing_steps", -1)
    return max(STATE.resume_step, int(freezing if freezing is not None else -1) + 1) + STATE.fits


def record_micro_batch(trainer: Any, experience: Any, logp: Any) -> None:
    """Record one micro-batch of ActorPPOTrainer.training_step (module doc)."""
    import torch

    if not _ranks(trainer.strategy)[2]:
        return
    rec = _recorder(trainer)
    mask = experience.action_mask
    width = mask.shape[1]
    with torch.no_grad():
        tokens = experience.sequences[:, -width:]
        keep = experience.attention_mask.bool() if experience.attention_mask is not None else None
        seq = sequence_ids(experience.sequences, keep if keep is not None else torch.ones_like(experience.sequences,
                                                                                                  dtype=torch.bool),
                           experience.action_log_probs, mask)
    if STATE.per_epoch > 0:  # ppo_train's epochs of len(replay_buffer) // micro-batch size calls (drop_last)
        iteration, micro = divmod(STATE.calls, STATE.per_epoch)
    else:
        iteration, micro = max((STATE.seen.get(int(s), 0) for s in seq), default=0), STATE.calls
        for s in seq:
            STATE.seen[int(s)] = iteration + 1
    adv = experience.advantages
    rec.record(step=step_of(trainer), micro=micro, iteration=iteration, logp=logp,
               logp_old=experience.action_log_probs, logp_ref=experience.base_action_log_probs,
               logp_sampler=experience.rollout_log_probs, advantages=adv, mask=mask, completion_mask=mask,
               token_ids=tokens, seq_ids=seq, group_ids=text_ids(experience.prompts))


def _wrap_training_step(inner: Any) -> Any:
    @functools.wraps(inner)
    def training_step(self: Any, experience: Any, *args: Any, **kwargs: Any) -> Any:
        tap = self.actor_loss_fn if isinstance(self.actor_loss_fn, _LossTap) else _LossTap(self.actor_loss_fn)
        self.actor_loss_fn, tap.logp = tap, None
        out = inner(self, experience, *args, **kwargs)
        try:
            if tap.logp is not None:
                record_micro_batch(self, experience, tap.logp)
        except Exception as e:  # noqa: BLE001 - never into training unless asked
            _warn(e)
        STATE.calls += 1
        return out
    training_step.kldiag = True
    return training_step


def _wrap_ppo_train(inner: Any) -> Any:
    @functools.wraps(inner)
    def ppo_train(self: Any, *args: Any, **kwargs: Any) -> Any:
        STATE.fits, STATE.calls, STATE.seen = STATE.fits + 1, 0, {}
        buffer, dynamic = self.replay_buffer, getattr(self.args.train, "dynamic_batch_enable", False)
        STATE.per_epoch = 0 if dynamic else len(buffer) // max(int(buffer.sample_batch_size), 1)
        return inner(self, *args, **kwargs)
    return ppo_train


def _wrap_init(inner: Any) -> Any:
    @functools.wraps(inner)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        inner(self, *args, **kwargs)
        # PolicyModelActor.init_model_from_pretrained builds the trainer right after loading the actor
        # checkpoint (ppo_actor.py l. 573-596): its global_step is where the driver's count resumes
        caller = sys._getframe(1).f_locals.get("self")
        states = getattr(caller, "checkpoint_states", None)
        if isinstance(states, dict):
            STATE.resume_step = int(states.get("global_step") or 0)
    return __init__


def patch(module: Any) -> None:
    """Patch `openrlhf.trainer.ray.ppo_actor.ActorPPOTrainer` (idempotent)."""
    cls = module.ActorPPOTrainer
    if getattr(cls.training_step, "kldiag", False):
        return
    check_version()
    cls.training_step = _wrap_training_step(cls.training_step)
    cls.ppo_train = _wrap_ppo_train(cls.ppo_train)
    cls.__init__ = _wrap_init(cls.__init__)


class _Finder:
    """A meta-path finder that patches ppo_actor right after Python executes it (no import of our own)."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != MODULE:
            return None
        import importlib.machinery

        sys.meta_path.remove(self)
        try:
            spec = importlib.machinery.PathFinder.find_spec(name, path)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module: Any) -> None:
            exec_module(module)
            patch(module)
        spec.loader.exec_module = exec_and_patch
        return spec


def install() -> None:
    """Ray's worker_process_setup_hook: patch OpenRLHF's actor trainer now or when it is imported."""
    if MODULE in sys.modules:
        patch(sys.modules[MODULE])
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def close() -> None:
    """Publish and close this process's recorder (atexit does it too)."""
    if STATE.recorder is not None:
        STATE.recorder.close()
    STATE.__init__()


def main(argv: list[str] | None = None) -> None:
    """`python -m kldiag.integrations.openrlhf ARGS`: OpenRLHF's train_ppo_ray with ARGS, every Ray worker hooked."""
    check_version()
    if not os.environ.get(ENV_RUN):
        raise IntegrationError(f"set {ENV_RUN} to the kldiag run directory (or URI) to record into")
    import runpy

    import ray

    # OpenRLHF's own ray.init (train_ppo_ray.py l. 21-32) runs only when Ray is not initialised: same env vars
    env = {"TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM", "true"),
           "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN"),
           "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": os.environ.get("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "1"),
           ENV_RUN: os.environ[ENV_RUN]}
    ray.init(runtime_env={"env_vars": env, "worker_process_setup_hook": HOOK})
    sys.argv = ["train_ppo_ray", *(sys.argv[1:] if argv is None else argv)]
    runpy.run_module("openrlhf.cli.train_ppo_ray", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    try:
        main()
    except IntegrationError as e:
        print(f"kldiag: error: {e}", file=sys.stderr)
        sys.exit(2)
