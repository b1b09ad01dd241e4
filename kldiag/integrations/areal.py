"""Record every PPO micro-batch of an AReaL run, on each data-parallel head.

    # one line in your AReaL script: kldiag's PPOTrainer instead of AReaL's (same arguments)
    from kldiag.integrations.areal import PPOTrainer      # was: from areal import PPOTrainer
    # and KLDIAG_RUN=/ckpt/kldiag_run in the environment of the train workers

Read at areal 1.0.4 (PyPI wheel). AReaL has no callback or loss registry: users build `PPOTrainer` in their own
script. kldiag's `PPOTrainer` overrides `_create_train_engine` (`areal/trainer/rl_trainer.py` l. 951) so the actor
(not the reference, built by the same method) is a `RecordingFSDPPPOActor` / `RecordingMegatronPPOActor`; the
workers import that class by its module path (`infra/controller/train_controller.py` l. 310-318), so kldiag must be
installed on every train worker. The subclass:

- `compute_advantages(data)`: keeps the engine's log-probs mu (rolled to the next-token layout) as an extra
  key before `PPOActor._compute_advantages` overwrites them with the recomputed pi_old when
  `recompute_logprob` is on without `use_decoupled_loss` (`areal/trainer/ppo/actor.py` l. 178-190); the key
  travels through AReaL's mini- and micro-batch splits like every [B, T] tensor;
- `train_batch(input_, loss_fn, loss_weight_fn)` (`engine/fsdp_engine.py` l. 760): wraps `loss_fn` (the
  `functools.partial(grpo_loss_fn, ...)` of `_ppo_update`, actor.py l. 338) so each micro-batch's packed
  tensors (1-D, `cu_seqlens`) are recorded after AReaL's loss returns: logp = pi_theta (the loss's `logprobs`),
  logp_old = `prox_logp` (pi_prox: the recomputed pi_old with the decoupled loss, else AReaL's "old"),
  logp_sampler = mu, logp_ref = `ref_logp` (with `actor.kl_ctl > 0` and a reference model), advantages,
  mask = `loss_mask` (already rolled), token_ids = `input_ids` shifted by one (column t scores token t+1,
  `fsdp_engine.py` l. 1989-1992), entropy.

step = the partial's `current_version` = `engine.get_version()` = the trainer's `global_step`, the step its
stats are committed at (rl_trainer.py l. 768-772, 1275): `kldiag audit` aligns at offset 0. micro = the loss
call within the step; iteration 0 (AReaL trains each sample once per step). Ids: AReaL keeps none per sample
(`versions` per token; rows are permuted by the mini- and micro-batch splits), so seq = a hash of the sample's
tokens and mu, group = a hash of its prompt tokens (kldiag.integrations.common.ids). policy_version (format v1.3) = the
batch's per-token `versions` (the engine version that generated each token, `workflow/rlvr.py` l. 168; AReaL's
staleness is current_version - versions, `_log_version_staleness_stats`), rolled like the log-probs: a sequence
its interruptible generation continued across weight updates keeps each token's version. rank = the data-parallel rank;
only data-parallel heads write (`is_data_parallel_head`), as AReaL's controller keeps only their results.
Recording failures warn once and never reach training (KLDIAG_STRICT=1 raises them).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

from kldiag.errors import IntegrationError
from kldiag.frameworks import sampling as sampling_settings
from kldiag.frameworks.areal import ESTIMATOR_OF, SUPPORTED
from kldiag.integrations.common.failures import recording_failed
from kldiag.integrations.common.ids import sequence_ids
from kldiag.integrations.common.versions import check_release
from kldiag.record.recorder import Recorder

ENV_RUN = "KLDIAG_RUN"
SAMPLER_KEY = "kldiag_logp_sampler"
ACTOR_KEYS = ("kl_ctl", "kl_estimator", "eps_clip", "eps_clip_higher", "c_clip", "recompute_logprob",
              "use_decoupled_loss", "prox_logp_method", "importance_sampling_level", "m2_threshold",
              "ppo_n_minibatches", "temperature", "use_sapo_loss", "adv_norm", "reward_norm")
NULL_REASONS = {"seq_ids": "AReaL keeps no sample id (only per-token versions): kldiag hashes each sample's "
                           "tokens and engine log-probs",
                "logp_ref": "AReaL computes reference log-probs only with actor.kl_ctl > 0 and a ref model"}


def check_version(version: str | None = None) -> str:
    """areal's version, or IntegrationError naming SUPPORTED and the fix."""
    return check_release("areal", SUPPORTED, version)


def settings(actor: Any, gconfig: Any = None) -> dict[str, Any]:
    """The manifest `config` of an AReaL run: `actor.*` (PPOActorConfig) and the engine's `gconfig` sampling."""
    import dataclasses

    g = sampling_settings._get
    out: dict[str, Any] = {k: g(actor, k) for k in ACTOR_KEYS}
    for k in ("adv_norm", "reward_norm"):  # NormConfig dataclasses: their fields, for run.json
        if dataclasses.is_dataclass(out[k]):
            out[k] = dataclasses.asdict(out[k])
    rs = g(actor, "rejection_sampling")
    for k in ("level", "action", "metric", "agg", "upper", "lower"):
        out[f"rs_{k}"] = g(rs, k) if rs is not None else None
    out.update(areal_version=SUPPORTED.lstrip("="), estimator=ESTIMATOR_OF.get(str(out["kl_estimator"])),
               kl_clamp=True, kl_in_reward=True,
               null_reasons={k: v for k, v in NULL_REASONS.items() if k == "seq_ids" or not (out["kl_ctl"] or 0) > 0})
    if gconfig is None:  # the train workers get actor.* only; the engine's gconfig stays with the controller
        out["null_reasons"]["engine_sampling"] = ("AReaL's train workers see actor.* only, not the engine's gconfig "
                                                  f"(actor.temperature, the trainer's, is {out.get('temperature')})")
    else:
        out["engine_sampling"] = sampling_settings.settings(
            g(gconfig, "temperature"), g(gconfig, "top_k"), g(gconfig, "top_p"), None, None, [], None,
            {n: f"gconfig.{n}" for n in ("temperature", "top_k", "top_p")})
    return {k: v for k, v in out.items() if k in ("rs_level", "null_reasons") or v is not None}


@dataclass
class _State:
    recorder: Any = None
    step: int = -1
    calls: int = 0
    failures: int = 0


STATE = _State()


def _recorder(engine: Any) -> Any:
    if STATE.recorder is None:
        run = os.environ.get(ENV_RUN)
        if not run:
            raise IntegrationError(f"set {ENV_RUN} on the train workers to the kldiag run the AReaL hook records into")
        cfg = getattr(engine, "kldiag_config", None) or settings(engine.config)
        rank = int(getattr(engine, "data_parallel_rank", 0) or 0)
        world = int(getattr(engine, "data_parallel_world_size", 1) or 1)
        low, high = cfg.get("eps_clip"), cfg.get("eps_clip_higher") or cfg.get("eps_clip")
        STATE.recorder = Recorder(run, rank=rank, world_size=world, trainer="areal",
                                  trainer_version=cfg["areal_version"],
                                  estimator=cfg.get("estimator"), beta=cfg.get("kl_ctl"),
                                  clip_range=(low, high) if low is not None else None, config=cfg)
    return STATE.recorder


def _unpack(x: Any, cu: Any, width: int) -> Any:
    """[B, width] right-padded rows of a packed 1-D tensor (cu_seqlens [B + 1])."""
    import torch

    lengths = (cu[1:] - cu[:-1]).long()
    b = lengths.shape[0]
    col = torch.arange(width, device=x.device)[None, :]
    keep = col < lengths[:, None]
    out = torch.zeros((b, width), dtype=x.dtype, device=x.device)
    out[keep] = x[: int(cu[-1])]
    return out, keep


def record_micro_batch(engine: Any, logprobs: Any, entropy: Any, data: dict, step: int) -> None:
    """Record one packed micro-batch of grpo_loss_fn (module doc)."""
    import torch

    if not getattr(engine, "is_data_parallel_head", lambda: True)():
        return
    rec = _recorder(engine)
    if step != STATE.step:
        STATE.step, STATE.calls = step, 0
    cu = data["cu_seqlens"]
    width = int((cu[1:] - cu[:-1]).max())
    with torch.no_grad():
        rows = {}
        for name, x in (("logp", logprobs.detach()), ("entropy", entropy), ("mask", data["loss_mask"]),
                        ("logp_old", data.get("prox_logp")), ("logp_ref", data.get("ref_logp")),
                        ("advantages", data["advantages"]), ("input_ids", data["input_ids"]),
                        ("logp_sampler", data.get(SAMPLER_KEY))):
            if x is not None:
                rows[name], keep = _unpack(x.detach(), cu, width)
        ids = rows.pop("input_ids")
        tokens = torch.roll(ids, -1, dims=-1)  # column t scores token t + 1 of the sequence
        if data.get("versions") is not None:  # per token, -1 on the prompt (workflow/rlvr.py l. 168)
            nxt = keep & torch.roll(keep, -1, dims=-1)  # columns whose next token is the sequence's (not padding)
            versions = token_versions(torch.roll(_unpack(data["versions"].detach(), cu, width)[0], -1, dims=-1), nxt)
            if versions is not None:
                rows["policy_version"] = versions
        mask = rows.pop("mask").bool() & keep
        prompt_end = torch.where(mask.any(-1), mask.float().argmax(-1), keep.sum(-1) - 1)  # last prompt column
        seq = sequence_ids(ids, keep, rows.get("logp_sampler", rows["logp"]), mask)
        group = sequence_ids(ids, torch.arange(width, device=ids.device)[None, :] <= prompt_end[:, None],
                             torch.zeros_like(rows["logp"][:, :1]), torch.zeros_like(mask[:, :1]))
    rec.record(step=step, micro=STATE.calls, iteration=0, mask=mask, completion_mask=keep, token_ids=tokens,
               seq_ids=seq, group_ids=group, **rows)
    STATE.calls += 1


def token_versions(versions: Any, keep: Any) -> Any:
    """[B, T] int64 policy_version from AReaL's per-token `versions` (rolled like the log-probs): the version that
    generated each token, so a sequence generated across weight updates (interruptible generation) keeps its
    versions per token; where `keep` is false or the version is the prompt's -1, the row's first generated
    token's version. None
    when a row has no generated token with a version (left out, as a run without versions)."""
    import torch

    v = versions.long()
    valid = (v >= 0) & keep
    if not bool(valid.any(-1).all()):
        return None
    first = torch.gather(v, 1, valid.float().argmax(-1, keepdim=True))
    return torch.where(valid, v, first)


def _warn(e: BaseException) -> None:
    recording_failed(STATE, e, "an AReaL micro-batch")


def recording_loss(engine: Any, loss_fn: Any) -> Any:
    """`loss_fn` (grpo_loss_fn's partial) unchanged, recording the micro-batch it saw after it returns."""
    step = (getattr(loss_fn, "keywords", None) or {}).get("current_version")

    @functools.wraps(loss_fn)
    def loss(logprobs: Any, entropy: Any, input_data: dict, *args: Any, **kwargs: Any) -> Any:
        out = loss_fn(logprobs, entropy, input_data, *args, **kwargs)
        try:
            record_micro_batch(engine, logprobs, entropy, input_data,
                               int(step if step is not None else engine.get_version()))
        except Exception as e:  # noqa: BLE001 - never into training unless asked
            _warn(e)
        return out
    return loss


class RecordingActor:
    """Mixin over an AReaL PPO actor engine (FSDPPPOActor, MegatronPPOActor): see the module doc."""

    def compute_advantages(self, data: Any, *args: Any, **kwargs: Any) -> Any:
        import torch

        for d in data if isinstance(data, list) else [data]:
            if isinstance(d, dict) and "logprobs" in d and SAMPLER_KEY not in d:
                d[SAMPLER_KEY] = torch.roll(d["logprobs"], shifts=-1, dims=-1)
        return super().compute_advantages(data, *args, **kwargs)

    def train_batch(self, input_: Any, loss_fn: Any, loss_weight_fn: Any) -> Any:
        if getattr(getattr(loss_fn, "func", None), "__name__", "") == "grpo_loss_fn":
            loss_fn = recording_loss(self, loss_fn)
        return super().train_batch(input_, loss_fn, loss_weight_fn)


@functools.lru_cache(maxsize=None)
def recording_class(base: type) -> type:
    """The recording subclass of an AReaL actor engine class, importable by its module path."""
    cls = type(f"Recording{base.__name__}", (RecordingActor, base), {"__module__": __name__})
    globals()[cls.__name__] = cls  # the workers import it as kldiag.integrations.areal.<name>
    return cls


def __getattr__(name: str) -> Any:
    """kldiag.integrations.areal.RecordingFSDPPPOActor / RecordingMegatronPPOActor on a worker that imports them."""
    if name == "PPOTrainer":
        return _trainer_class()
    if name.startswith("Recording") and name.endswith("PPOActor"):
        check_version()
        import areal.engine as engines

        return recording_class(getattr(engines, name.removeprefix("Recording")))
    raise AttributeError(name)


@functools.lru_cache(maxsize=None)
def _trainer_class() -> type:
    check_version()
    from areal import PPOTrainer as Base

    class PPOTrainer(Base):
        """AReaL's PPOTrainer whose actor records every micro-batch into $KLDIAG_RUN (module doc)."""

        def _create_train_engine(self, actor_config: Any, alloc: Any) -> Any:
            if actor_config is not getattr(getattr(self, "config", None), "actor", None):
                return super()._create_train_engine(actor_config, alloc)  # the reference model: not recorded
            import areal.trainer.rl_trainer as rl

            backend = {"fsdp": "FSDPPPOActor", "megatron": "MegatronPPOActor"}.get(alloc.backend)
            if backend is None:
                raise IntegrationError(f"kldiag records AReaL's fsdp and megatron actors, not {alloc.backend!r}")
            import areal.engine as engines

            cls = recording_class(getattr(engines, backend))
            actor = cls.as_controller(actor_config, self.scheduler) if rl.is_single_controller() else cls(
                config=actor_config)
            actor.create_process_group(parallel_strategy=alloc.parallel)
            return actor

    PPOTrainer.__module__ = __name__
    return PPOTrainer


def close() -> None:
    if STATE.recorder is not None:
        STATE.recorder.close()
    STATE.__init__()
