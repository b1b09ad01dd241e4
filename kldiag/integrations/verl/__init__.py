"""Record every PPO/GRPO update of a verl run: a drop-in for verl's actor loss.

    # one line of verl config (the V1 trainer; kldiag's "verl.plugins" entry point registers the mode):
    python -m verl.trainer.main_ppo ... trainer.v1.trainer_mode=kldiag_sync +kldiag.run=/ckpt/kldiag_run
    # or, on a trainer you drive yourself, after trainer.init():
    kldiag.integrations.verl.attach(trainer, "/ckpt/kldiag_run")

Read at verl 0.9.1 (PyPI wheel). The actor worker calls its loss once per micro-batch as
`loss_fn(model_output=..., data=micro_batch, dp_group=...)` (workers/engine/fsdp/transformer_impl.py
l. 1576, megatron/transformer_impl.py l. 1447); the driver may replace that loss with
`actor_rollout_wg.set_loss_fn(fn)` (workers/engine_workers.py l. 530, the extension point the V1
trainer itself uses for the critic, trainer_base.py l. 324). `ppo_loss` below calls verl's own
`verl.workers.utils.losses.ppo_loss` (l. 57) first and returns its loss and metrics untouched, then
records detached copies of what that loss saw: per micro-batch, [B, T] response tokens of
log_probs (pi_theta) and entropy from the model output, old_log_probs, ref_log_prob,
rollout_log_probs (logp_sampler), advantages, response_mask, responses (token ids).

Ids: seq = a hash of the sample's prompt+response token ids and its old_log_probs bits (the
same sample keeps its id across PPO epochs, shuffles and mini-batches; hashed on the device, then
one [B] int64 copy to the host, where verl's engine syncs anyway for `loss.item()`); group = a
hash of verl's `uid` (the GRPO prompt group), else of the prompt tokens.
micro = mini_batch * MICRO_SLOTS + micro-batch within it (mini-batches counted per step, across
epochs); iteration = how many times this rank already recorded the sequence in this step (the
PPO epoch). kldiag rank = data-parallel rank; only the rank that owns the data records
(Ulysses sequence-parallel rank 0; Megatron tensor- and context-parallel rank 0).
Tracker metrics: the first loss call of each step returns, besides verl's own metrics, the
previous step's `kldiag_partials/...` (computed in the recorder's writer thread, never waited
for); the kldiag trainer subclass turns them into `kldiag/k3_mean`, `kldiag/weight_k3_abs_max`, ...
and `kldiag/step` in the metrics verl logs (kldiag.integrations.verl.metrics).
`rollout_is_weights` is not a column of run format v1.1: with logp_old, logp_sampler and the
manifest's `rollout_correction` block, kldiag.crosswalk recomputes them.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from kldiag.errors import IntegrationError
from kldiag.frameworks import sampling as sampling_settings
from kldiag.frameworks.verl import ESTIMATOR_OF, MICRO_SLOTS, SUPPORTED
from kldiag.integrations.common.failures import recording_failed
from kldiag.integrations.common.step_metrics import StepWindow
from kldiag.integrations.verl import metrics as verl_metrics
from kldiag.integrations.verl.batch import engine_routes, non_tensor, policy_versions, sequence_ids
from kldiag.integrations.verl.trainer import ENV_RUN, config_get, make_trainer
from kldiag.record.recorder import Recorder

ACTOR_KEYS = ("use_kl_loss", "kl_loss_type", "kl_loss_coef", "loss_agg_mode", "loss_scale_factor", "clip_ratio",
              "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "entropy_coeff", "ppo_epochs",
              "ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu", "use_dynamic_bsz", "shuffle")
FIELDS = {"response_mask": "mask", "old_log_probs": "logp_old", "ref_log_prob": "logp_ref",
          "rollout_log_probs": "logp_sampler", "advantages": "advantages", "responses": "token_ids"}


def check_version(version: str | None = None) -> str:
    """verl's version, or IntegrationError naming SUPPORTED and the fix."""
    from packaging.version import Version

    if version is None:
        try:
            import verl
        except ImportError as e:
            raise IntegrationError(f"kldiag.integrations.verl needs verl{SUPPORTED}: "
                                   f"pip install 'kldiag[verl]' && pip install --no-deps verl==0.9.1 ({e})") from e
        version = verl.__version__
    v = Version(version)
    if not Version("0.9") <= v < Version("0.10"):
        raise IntegrationError(f"kldiag.integrations.verl supports verl{SUPPORTED}, found verl {version}; "
                               "install a supported version (pip install --no-deps verl==0.9.1), or record with "
                               "kldiag.Recorder by hand")
    return version


def _plain(x: Any) -> Any:
    """A JSON-able copy of a config value (DictConfig, dataclass, enum, numpy scalar)."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(x, (DictConfig, ListConfig)):
            return OmegaConf.to_container(x, resolve=True)
    except ImportError:
        pass
    if hasattr(x, "__dataclass_fields__"):
        return {k: _plain(getattr(x, k)) for k in x.__dataclass_fields__ if not k.startswith("_")}
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x if isinstance(x, (str, int, float, bool, type(None))) else str(x)


def settings(actor: Any, rollout_correction: Any = None, version: str | None = None,
             rollout: Any = None) -> dict[str, Any]:
    """The manifest `config` of a verl run: the actor settings that decide the maths.

    actor: `actor_rollout_ref.actor` (DictConfig or verl's ActorConfig); rollout_correction:
    `algorithm.rollout_correction` (None: the actor's policy_loss.rollout_correction, if any); rollout:
    `actor_rollout_ref.rollout`, whose sampling settings go to config["engine_sampling"] (kldiag.frameworks.sampling).
    """
    out: dict[str, Any] = {k: _plain(config_get(actor, k)) for k in ACTOR_KEYS if config_get(actor, k) is not None}
    policy_loss = config_get(actor, "policy_loss")
    out["policy_loss.loss_mode"] = config_get(policy_loss, "loss_mode", "vanilla")
    rc = rollout_correction if rollout_correction is not None else config_get(policy_loss, "rollout_correction")
    if rc is not None:
        out["rollout_correction"] = _plain(rc)
    out.update(kl_semantics="verl", verl_micro_slots=MICRO_SLOTS, verl_version=version)
    if rollout is not None:
        out["engine_sampling"] = _plain(sampling_settings.from_verl(rollout))
    replay = routing_replay(actor, rollout)
    if replay is not None:  # the routing causes read it (kldiag/diagnosis/routing.py)
        out["routing_replay"] = replay
    out["routes"] = routes_sides(replay)
    dtype = rollout_dtype(rollout)
    if dtype is not None:  # engine_low_precision reads it (kldiag/diagnosis/low_precision.py)
        out["rollout_dtype"] = dtype
    return out


# verl 0.9.1 puts one side of the routes in the update's batch, under one key, `routed_experts`
# (trainer/ppo/ray_trainer.py l. 1308-1320, 1602; workers/engine/megatron/transformer_impl.py l. 955-1019).
UPDATE_ROUTES_MISSING = ("verl 0.9.1 returns no routes from the update's forward: Megatron's RouterReplay applies the "
                         "replayed ids inside the router (utils/megatron/router_replay_patch.py get_replay_topk) and "
                         "keeps no copy of what it used")


def routes_sides(replay: str | None) -> dict[str, Any]:
    """Manifest config["routes"]: which side of the MoE routes the verl hook records, and why not the other.

    R2: `routed_experts` is the trainer's own record of the old-log-prob pass (RECORD), which the update
    replays: the trainer's side; the engine's routes are never returned with R2 (R2 with
    enable_rollout_routing_replay raises). R3: `routed_experts` is the engine's (the rollout's
    routed experts): the engine's side; the trainer's update routes are not returned. Off: none."""
    mode = str(replay or "").upper()
    if mode == "R2":
        return {"captured": "trainer", "source": "routed_experts recorded by verl's R2 old-log-prob pass",
                "missing": {"engine": "verl returns no engine routes under R2 (R2 with "
                                      "rollout.enable_rollout_routing_replay raises in ray_trainer.py)"}}
    if mode == "R3":
        return {"captured": "engine", "source": "routed_experts returned by the rollout (R3)",
                "missing": {"trainer": UPDATE_ROUTES_MISSING}}
    return {"captured": "none", "missing": {
        "engine": "routing replay is off: the rollout returns no routed_experts "
                  "(rollout.enable_rollout_routing_replay)",
        "trainer": UPDATE_ROUTES_MISSING}}


def rollout_dtype(rollout: Any) -> str | None:
    """The engine's weight dtype: `rollout.quantization` (e.g. "fp8") when set, else `rollout.dtype` (verl 0.9.1
    `_generated_ppo_trainer.yaml`: `quantization: null`, `dtype: bfloat16`); None without a rollout config."""
    if rollout is None:
        return None
    quant = config_get(rollout, "quantization")
    if quant:
        return str(quant)
    dtype = config_get(rollout, "dtype")
    return str(dtype) if dtype else None


def routing_replay(actor: Any, rollout: Any = None) -> str | None:
    """The run's routing replay mode: `actor.megatron.router_replay.mode` (or VeOmni's, or the legacy
    `actor.router_replay.mode`) when not "disabled", R3 only with `rollout.enable_rollout_routing_replay`
    (verl-project/verl@1dda039b `EngineRouterReplayConfig`, ray_trainer.py); None when replay is off."""
    for path in ("megatron.router_replay", "veomni.router_replay", "router_replay"):
        node = actor
        for part in path.split("."):
            node = config_get(node, part)
        mode = config_get(node, "mode") if node is not None else None
        if mode and str(mode).lower() != "disabled":
            if str(mode).upper() == "R3" and not config_get(rollout, "enable_rollout_routing_replay", False):
                return None  # R3 without the rollout's routes replays nothing from the engine
            return str(mode)
    return None


@dataclass
class _State:
    """This process's recording state (one per worker process; the loss runs on one thread)."""

    recorder: Any = None
    step: int = -1
    mini: int = -1  # mini-batch index within the step
    micro: int = 0  # micro-batch index within the mini-batch
    left_in_mini: int = 0  # sequences of the current mini-batch this rank has not seen yet
    last_mini_ends_step: bool = False
    seen: dict[int, int] = field(default_factory=dict)  # seq id -> times recorded this step
    failures: int = 0
    window: Any = None  # step_metrics.StepWindow: the kldiag/* figures of each step, from the writer thread
    world: int = 1  # data-parallel ranks (verl averages the loss metrics over them)
    route_side: str = "experts_sampler"  # what `routed_experts` holds: the engine's (R3), the trainer's (R2)


STATE = _State()


def ppo_loss(config: Any, model_output: dict[str, Any], data: Any, dp_group: Any = None, *, run: str | None = None,
             manifest_config: dict[str, Any] | None = None, inner: Any = None) -> tuple[Any, dict[str, Any]]:
    """verl's `ppo_loss` (or `inner`), unchanged, plus recording the micro-batch it saw.

    Install with `partial(ppo_loss, config=actor_config, run=RUN)` (what `loss_fn` returns). Only
    passes with gradients enabled are recorded (updates, not forward-only log-prob passes).
    Recording failures warn once and never reach training (KLDIAG_STRICT=1 raises them).
    """
    if inner is None:
        from verl.workers.utils.losses import ppo_loss as inner
    loss, metrics = inner(config, model_output, data, dp_group)
    if not _training_pass():  # verl's infer_batch may call the loss without gradients: not an update
        return loss, metrics
    try:
        reported = record_micro_batch(config, model_output, data, dp_group, run=run, manifest_config=manifest_config)
        if reported:  # the previous step's kldiag/* partials, carried to the driver with verl's own metrics
            metrics = {**metrics, **reported}
    except Exception as e:  # noqa: BLE001 - never into training unless asked
        recording_failed(STATE, e, "a verl micro-batch", stacklevel=2)
    return loss, metrics


def _training_pass() -> bool:
    import torch

    return torch.is_grad_enabled()


def loss_fn(actor_config: Any, run: str | os.PathLike, manifest_config: dict[str, Any] | None = None) -> partial:
    """The picklable loss to hand to `actor_rollout_wg.set_loss_fn` (it runs in the workers)."""
    return partial(ppo_loss, config=actor_config, run=str(run), manifest_config=manifest_config)


def attach(trainer: Any, run: str | os.PathLike | None = None) -> partial:
    """Replace the actor loss of an initialised verl V1 trainer by the recording one.

    Call after `trainer.init()` (it creates `trainer.actor_rollout_wg`). run defaults to $KLDIAG_RUN.
    A trainer of a plain verl mode becomes an instance of its kldiag subclass, so that each actor
    update carries the trainer's global step (verl_trainer.make_trainer).
    """
    version = check_version()
    run = run if run is not None else os.environ.get(ENV_RUN)
    if not run:
        raise IntegrationError(f"pass run= or set {ENV_RUN} to the kldiag run directory (or URI) to record into")
    wg = getattr(trainer, "actor_rollout_wg", None)
    if wg is None:
        raise IntegrationError("the trainer has no actor_rollout_wg yet: call kldiag.integrations.verl.attach(trainer, "
                               "run) after trainer.init()")
    from verl.utils.config import omega_conf_to_dataclass

    actor_cfg = trainer.config.actor_rollout_ref.actor
    algorithm = config_get(trainer.config, "algorithm")
    distillation = config_get(trainer.config, "distillation")
    if distillation is not None and config_get(distillation, "enabled", False):
        raise IntegrationError("verl distillation replaces ppo_loss by distillation_ppo_loss; kldiag records "
                               "ppo_loss only: turn distillation off or record with kldiag.Recorder by hand")
    fn = loss_fn(omega_conf_to_dataclass(actor_cfg), run,
                 settings(actor_cfg, config_get(algorithm, "rollout_correction"), version,
                          config_get(trainer.config.actor_rollout_ref, "rollout")))
    wg.set_loss_fn(fn)
    if not getattr(trainer, "kldiag_tags_steps", False):  # a plain verl trainer: the kldiag subclass of its class
        trainer.__class__ = make_trainer(type(trainer))  # adds only the step tag of _update_actor (_setup is done)
    return fn


# ---- the worker side ----------------------------------------------------------------------


def owns_data() -> bool:
    """True on the rank that writes for its data-parallel rank (SP / TP / CP rank 0)."""
    try:
        from verl.utils.ulysses import get_ulysses_sequence_parallel_rank

        if get_ulysses_sequence_parallel_rank() != 0:
            return False
    except ImportError:
        pass
    mpu = getattr(sys.modules.get("megatron.core"), "mpu", None)
    if mpu is not None and mpu.model_parallel_is_initialized():
        return mpu.get_tensor_model_parallel_rank() == 0 and mpu.get_context_parallel_rank() == 0
    return True


def _recorder(config: Any, dp_group: Any, run: str | None, manifest_config: dict[str, Any] | None) -> Any:
    if STATE.recorder is None:
        import torch

        run = run or os.environ.get(ENV_RUN)
        if not run:
            raise IntegrationError(f"set {ENV_RUN} (or pass run=) to the kldiag run the verl hook records into")
        rank, world = 0, 1
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            group = dp_group if dp_group is not None else torch.distributed.group.WORLD
            rank, world = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
        version = check_version()
        cfg = manifest_config or settings(config, None, version)
        coef = cfg.get("kl_loss_coef") if cfg.get("use_kl_loss") else None
        clip = (cfg["clip_ratio_low"], cfg["clip_ratio_high"]) if "clip_ratio_low" in cfg else None
        STATE.recorder = Recorder(run, rank=rank, world_size=world, trainer="verl", trainer_version=version,
                                  beta=coef, estimator=ESTIMATOR_OF.get(str(cfg.get("kl_loss_type"))),
                                  clip_range=clip, config=cfg)
        STATE.window = StepWindow(STATE.recorder)
        STATE.world = world
        STATE.route_side = "experts" if str(cfg.get("routing_replay") or "").upper() == "R2" else "experts_sampler"
    return STATE.recorder


def _advance(data: Any, batch: int) -> tuple[int, int]:
    """(step, micro code) of this micro-batch; starts a new mini-batch (and maybe step) when due."""
    explicit = non_tensor(data, "kldiag_step")
    if STATE.left_in_mini <= 0:  # a new mini-batch
        tokens = non_tensor(data, "global_token_num")
        dp = int(non_tensor(data, "dp_size") or 1)
        new_step = STATE.step < 0 or STATE.last_mini_ends_step if explicit is None else int(explicit) != STATE.step
        if new_step:
            STATE.step = int(explicit) if explicit is not None else STATE.step + 1
            STATE.mini, STATE.seen = -1, {}
        STATE.mini, STATE.micro = STATE.mini + 1, 0
        STATE.left_in_mini = len(tokens) // dp if tokens is not None else batch
        STATE.last_mini_ends_step = bool(non_tensor(data, "update_lr_scheduler"))
    else:
        STATE.micro += 1
    STATE.left_in_mini -= batch
    return STATE.step, STATE.mini * MICRO_SLOTS + STATE.micro


def record_micro_batch(config: Any, model_output: dict[str, Any], data: Any, dp_group: Any = None, *,
                       run: str | None = None, manifest_config: dict[str, Any] | None = None) -> dict[str, float]:
    """Record one micro-batch exactly as verl's ppo_loss padded it (see the module doc).

    Returns the loss metrics to add: at the first micro-batch of a step, the previous step's
    `kldiag_partials/...` (verl_metrics.report), else nothing.
    """
    import torch
    from verl.workers.utils.padding import no_padding_2_padding

    if not owns_data():
        return {}
    rec = _recorder(config, dp_group, run, manifest_config)
    with torch.no_grad():
        logp = no_padding_2_padding(model_output["log_probs"].detach(), data)
        entropy = model_output.get("entropy")
        entropy = no_padding_2_padding(entropy.detach(), data) if entropy is not None else None
        names = [k for k in FIELDS if k in data.keys()]
        padded = data.select(*names).to_padded_tensor()
        resp = data["response_mask"]
        lengths = resp.offsets().diff() if resp.is_nested else torch.full((logp.shape[0],), logp.shape[1],
                                                                          device=logp.device)
        t = logp.shape[1]
        completion = torch.arange(t, device=logp.device)[None, :] < lengths.to(logp.device)[:, None]
        cols = {FIELDS[k]: padded[k][:, :t] for k in names}
        cols["mask"] = cols["mask"].bool() & completion
        seq, group = sequence_ids(data, lengths)
        routes = data["routed_experts"] if "routed_experts" in data.keys() else None
        if routes is not None and not routes.is_nested and routes.dim() == 4:  # format v1.3: one side (routes_sides)
            cols[STATE.route_side] = engine_routes(routes, t)
    previous = STATE.step
    step, micro = _advance(data, logp.shape[0])
    # Before this batch is recorded: the writer's window then holds the previous step only.
    new_step = step != previous and previous >= 0
    reported = verl_metrics.report(STATE.window, previous, STATE.world) if new_step else {}
    seq_host = seq.cpu().numpy()  # one small [B] copy: the epoch count needs it on the host
    iteration = max((STATE.seen.get(int(s), 0) for s in seq_host), default=0)
    for s in seq_host:
        STATE.seen[int(s)] = iteration + 1
    rec.record(step=step, micro=micro, iteration=iteration, logp=logp, entropy=entropy, completion_mask=completion,
               seq_ids=seq, group_ids=group, policy_version=policy_versions(data, logp.shape[0]), **cols)
    return reported


def close() -> None:
    """Publish and close this process's recorder (atexit does it too); the next micro-batch opens a new one."""
    if STATE.recorder is not None:
        STATE.recorder.close()
    STATE.__init__()
