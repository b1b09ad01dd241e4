"""Record a slime job live: hooks slime loads by dotted path, writing to $KLDIAG_RUN.

    KLDIAG_RUN=/ckpt/kldiag_run python train.py ... \\
        --rollout-data-postprocess-path kldiag.integrations.slime.postprocess \\
        [--loss-type custom_loss --custom-loss-function-path kldiag.integrations.slime.policy_loss]

Read at THUDM/slime@624b824a (2026-08-21). slime resolves both paths with
`slime.utils.misc.load_function` ("module.function", misc.py l. 39-47).

`postprocess(args, rollout_id, rollout_data)` runs on every Megatron actor rank after ref/old
log-probs and advantages are computed, before training (backends/megatron_utils/actor.py
l. 505-506). It records the rollout's samples (logp = log_probs, slime's pi_old recompute)
from the ranks that own the data, as slime's own dump does (observability/train_data_utils.py
l. 198-215): the last pipeline stage, tensor-parallel rank 0, context-parallel rank 0 after
every CP rank restored the CP-sharded fields; one kldiag rank per data-parallel rank.

`policy_loss(args, batch, logits, sum_of_sample_mean)` delegates to slime's
`policy_loss_function` (loss.py l. 934) and records the log-probs that function computes
with `get_log_probs_and_entropy` (l. 970-978; taken from that call, no second forward or
log-softmax): logp = pi_theta during the update, logp_old = the batch's log_probs
(rollout_log_probs with --use-rollout-logprobs, l. 965), logp_ref, logp_sampler, advantages,
loss mask, entropy. With it, `postprocess` records nothing itself (it only notes the rollout
id): rows come from the update. Sequence ids are rollout_id * 2**32 + the sample's rollout
position when slime puts `partition` in the batch (with --save-debug-train-data, model.py
l. 601), as `kldiag import slime` assigns them.

With `policy_loss`, slime's logged train-step metrics also get `kldiag/k3_mean`,
`kldiag/weight_k3_abs_max`, ... and `kldiag/step` (the previous rollout's figures, computed in the
recorder's writer thread, carried through slime's own loss-log reduction: kldiag.integrations.slime.metrics).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from kldiag.frameworks import sampling as sampling_settings
from kldiag.frameworks import slime as slime_frameworks
from kldiag.importers import slime as dump
from kldiag.importers.sink import Sequence, pack
from kldiag.integrations.common.step_metrics import StepWindow
from kldiag.integrations.slime import metrics as slime_metrics
from kldiag.record.recorder import Recorder
from kldiag.integrations.common.failures import recording_failed

ENV_RUN = "KLDIAG_RUN"
LOSS_PATH = "kldiag.integrations.slime.policy_loss"
CONFIG_ARGS = ("use_kl_loss", "kl_loss_coef", "kl_loss_type", "use_unbiased_kl", "kl_coef", "eps_clip",
               "eps_clip_high", "use_rollout_logprobs", "use_tis", "advantage_estimator", "n_samples_per_prompt",
               "calculate_per_token_loss", "opsm_delta", "use_opsm")


class _State:
    recorder: Any = None
    rollout_id: int = -1
    micro: int = 0
    seen: set[int] = set()
    window: Any = None  # step_metrics.StepWindow: the kldiag/* figures per rollout, from the writer thread
    reported: int = -1  # the rollout whose first loss call reported the previous one
    log_hook: bool | None = None  # slime's logging_utils.log wrapped (False: this slime has none: no report)
    last_step: int = -1  # the step of the rows this process recorded last
    failures: int = 0  # recordings that failed (kldiag.integrations.common.failures: warned once, raised when strict)


STATE = _State()


def _mpu() -> Any:
    from megatron.core import mpu

    return mpu


def owns_data(mpu: Any) -> bool:
    """The ranks slime's own dump writes from: last PP stage and TP rank 0."""
    return bool(mpu.is_pipeline_last_stage(ignore_virtual=True)) and mpu.get_tensor_model_parallel_rank() == 0


def recorder(args: Any, mpu: Any) -> Any:
    """This process's Recorder (kldiag rank = DP rank), opened at the first call."""
    if STATE.recorder is None:
        run = os.environ.get(ENV_RUN)
        if not run:
            raise ValueError(f"set {ENV_RUN} to the kldiag run directory (or URI) the slime hooks record into")
        config = {k: getattr(args, k) for k in CONFIG_ARGS if getattr(args, k, None) is not None}
        config["kl_semantics"] = "slime"
        config["engine_sampling"] = sampling_settings.from_slime(args)  # --rollout-temperature/-top-k/-top-p
        if getattr(args, "use_kl_loss", False):
            config["estimator"] = slime_frameworks.estimator_name(getattr(args, "kl_loss_type", "k1"),
                                                          getattr(args, "use_unbiased_kl", False))
            config["beta"] = getattr(args, "kl_loss_coef", None)
        if getattr(args, "use_rollout_routing_replay", False):  # R3: the engine's routes replayed (routing causes)
            config["routing_replay"] = "R3"
        config["routes"] = routes_sides(args)
        if getattr(args, "true_on_policy_mode", False):  # slime/Miles --true-on-policy-mode: the parity contract
            config["true_on_policy"] = True  # (kldiag/diagnosis/contract.py)
        if getattr(args, "eps_clip", None) is not None:
            config["clip_range"] = [args.eps_clip, getattr(args, "eps_clip_high", None) or args.eps_clip]
        STATE.recorder = Recorder(run, rank=mpu.get_data_parallel_rank(with_context_parallel=False),
                                  world_size=mpu.get_data_parallel_world_size(with_context_parallel=False),
                                  trainer="slime", config=config)
        STATE.window = StepWindow(STATE.recorder)
    return STATE.recorder


# THUDM/slime@624b824a: the trainer's routes live in RoutingReplay (slime/utils/routing_replay.py, recorded at
# the old-log-prob pass with --use-routing-replay, filled from the engine's with R3) and reach no hook; with
# R3, MegatronTrainRayActor.fill_routing_replay (backends/megatron_utils/actor.py l. 308-352, called at
# l. 430-431) deletes rollout_data["rollout_routed_experts"] before the postprocess hook runs (l. 505-506).
TRAINER_ROUTES_MISSING = ("slime keeps the trainer's routes inside RoutingReplay (slime/utils/routing_replay.py "
                          "RoutingReplay.top_indices_list) and hands none to the loss or the postprocess hook")
ENGINE_ROUTES_DELETED = ("with --use-rollout-routing-replay, slime's fill_routing_replay deletes "
                         "rollout_data['rollout_routed_experts'] before the postprocess hook "
                         "(backends/megatron_utils/actor.py, THUDM/slime@624b824a)")


def routes_sides(args: Any) -> dict[str, Any]:
    """Manifest config["routes"]: which side of the MoE routes the slime hooks record, and why not the other.

    The engine's routes (`rollout_routed_experts`) are recorded by `postprocess` when they reach it, which
    slime's R3 prevents (ENGINE_ROUTES_DELETED); the trainer's never do (TRAINER_ROUTES_MISSING)."""
    missing = {"trainer": TRAINER_ROUTES_MISSING}
    if getattr(args, "use_rollout_routing_replay", False):
        missing["engine"] = ENGINE_ROUTES_DELETED
    elif _loss_wrapped(args):
        missing["engine"] = "the loss hook records the update's batches, which carry no rollout_routed_experts"
    else:
        return {"captured": "engine", "source": "rollout_routed_experts in the postprocess hook's rollout data, "
                "when the engine returned them", "missing": missing}
    return {"captured": "none", "missing": missing}


def _loss_wrapped(args: Any) -> bool:
    return getattr(args, "loss_type", None) == "custom_loss" and \
        getattr(args, "custom_loss_function_path", None) == LOSS_PATH


def postprocess(args: Any, rollout_id: int, rollout_data: dict[str, Any]) -> None:
    """--rollout-data-postprocess-path hook: records the rollout's samples (see module doc). A failure of
    any call it makes (slime's, Megatron's, the recorder's) follows the hooks' failure policy
    (kldiag.integrations.common.failures): counted, warned once, raised only with KLDIAG_STRICT=1."""
    STATE.rollout_id, STATE.micro, STATE.seen = int(rollout_id), 0, set()
    if _loss_wrapped(args):
        return
    try:
        _postprocess(args, rollout_id, rollout_data)
    except Exception as e:  # noqa: BLE001 - the policy decides: training goes on unless strict
        recording_failed(STATE, e, f"slime rollout {rollout_id}")


def _postprocess(args: Any, rollout_id: int, rollout_data: dict[str, Any]) -> None:
    mpu = _mpu()
    if not owns_data(mpu):
        return
    if mpu.get_context_parallel_world_size() > 1:  # every CP rank must enter the collectives
        from slime.backends.megatron_utils.cp_utils import all_gather_with_cp
        from slime.observability.train_data_utils import restore_context_parallel_fields_to_cpu

        cp_rank = mpu.get_context_parallel_rank()
        rollout_data = restore_context_parallel_fields_to_cpu(rollout_data, all_gather_with_cp,
                                                              keep_restored=cp_rank == 0)
        if cp_rank != 0:
            return
    rec = recorder(args, mpu)
    dp_rank = rec.rank
    n = len(rollout_data["response_lengths"])
    positions = rollout_data.get("partition")
    indices = rollout_data.get("sample_indices")
    per_sample = [k for k, v in rollout_data.items() if isinstance(v, (list, tuple)) and len(v) == n]
    group_size = getattr(args, "n_samples_per_prompt", None)
    seqs = []
    for i in range(n):
        sample = {k: rollout_data[k][i] for k in per_sample}
        sample["data_parallel_rank"] = dp_rank
        sample["rollout_position"] = positions[i] if positions is not None else None
        sample["sample_index"] = indices[i] if indices is not None else None
        seqs.append(dump.to_sequence(sample, int(rollout_id), i, None, group_size))
    _record(rec, seqs)


def _record(rec: Any, seqs: list[Sequence]) -> None:
    """One Recorder.record of packed sequences; without rollout positions the Recorder numbers them."""
    if not seqs:
        return
    args = pack(seqs)
    if any(q.seq < 0 for q in seqs):
        args.pop("seq_ids")
    args = {("advantages" if k == "advantage" else k): v for k, v in args.items()}
    rec.record(step=seqs[0].step, micro=seqs[0].micro, **args)


def policy_loss(args: Any, batch: dict[str, Any], logits: Any, sum_of_sample_mean: Any) -> Any:
    """--custom-loss-function-path hook: slime's policy_loss_function, recording pi_theta."""
    from slime.backends.megatron_utils import loss as slime_loss

    captured: dict[str, Any] = {}
    original = getattr(slime_loss, "get_log_probs_and_entropy", None)

    def capture(*a: Any, **kw: Any) -> Any:
        out = original(*a, **kw)  # slime's own call: what it raises is slime's
        try:
            captured.update(out[1])
        except Exception as e:  # noqa: BLE001 - another return shape: nothing recorded, slime's loss goes on
            recording_failed(STATE, e, "pi_theta of a slime loss call")
        return out

    if original is None:  # a slime without it: its loss runs unwrapped, nothing is recorded
        recording_failed(STATE, AttributeError("slime.backends.megatron_utils.loss has no "
                                               "get_log_probs_and_entropy"), "pi_theta of a slime loss call")
    else:
        slime_loss.get_log_probs_and_entropy = capture
    try:
        loss, log = slime_loss.policy_loss_function(args, batch, logits, sum_of_sample_mean)
    finally:
        if original is not None:
            slime_loss.get_log_probs_and_entropy = original
    reported: dict[str, Any] = {}
    try:
        reported = _report(logits.device)  # before this micro-batch is recorded: the window is the last rollout
        if "log_probs" in captured:
            record_loss_batch(args, batch, captured)
    except Exception as e:  # noqa: BLE001 - the policy decides: training goes on unless strict
        recording_failed(STATE, e, "a slime loss micro-batch")
    return loss, {**log, **reported}


def _report(device: Any) -> dict[str, Any]:
    """The `kldiag_partials/...` loss-log entries of this call (slime_metrics; zeros but at a rollout's first)."""
    import torch

    if STATE.log_hook is None:
        try:
            slime_metrics.install_log_hook()
            STATE.log_hook = True
        except ImportError:  # no slime.observability: the partials would be logged raw, so none are sent
            STATE.log_hook = False
        except Exception:  # a slime whose logging_utils has no `log` (or another shape): no report, counted
            STATE.log_hook = False
            raise
    if not STATE.log_hook:
        return {}
    mpu = _mpu()
    first = STATE.reported != STATE.rollout_id
    STATE.reported = STATE.rollout_id
    window = STATE.window if first and STATE.last_step >= 0 else None
    values = slime_metrics.report(window, STATE.last_step, mpu.get_data_parallel_rank(with_context_parallel=False),
                                  mpu.get_data_parallel_world_size(with_context_parallel=False))
    return {k: torch.tensor(v, dtype=torch.float32, device=device) for k, v in values.items()}


def record_loss_batch(args: Any, batch: dict[str, Any], captured: dict[str, Any]) -> None:
    """Record one micro-batch of the update from the ranks that own it (CP fields gathered)."""
    mpu = _mpu()
    if mpu.get_tensor_model_parallel_rank() != 0:
        return
    fields = {"logp": captured["log_probs"], "entropy": captured.get("entropy"),
              "logp_old": batch.get("rollout_log_probs") if getattr(args, "use_rollout_logprobs", False)
              else batch.get("log_probs"),
              "logp_ref": batch.get("ref_log_probs"), "logp_sampler": batch.get("rollout_log_probs"),
              "advantage": batch.get("advantages")}
    fields = {k: v for k, v in fields.items() if v is not None and len(v)}
    if mpu.get_context_parallel_world_size() > 1:  # every CP rank calls the loss: all enter the gather
        from slime.backends.megatron_utils.cp_utils import all_gather_with_cp

        sizes = list(zip(batch["total_lengths"], batch["response_lengths"], strict=True))
        fields = {k: [all_gather_with_cp(x.detach(), int(t), int(n)) for x, (t, n) in zip(v, sizes, strict=True)]
                  for k, v in fields.items()}
        if mpu.get_context_parallel_rank() != 0:
            return
    rec = recorder(args, mpu)
    seqs = loss_sequences(batch, fields, rec.rank, getattr(args, "n_samples_per_prompt", None))
    STATE.micro += 1
    _record(rec, seqs)
    if seqs:
        STATE.last_step = seqs[0].step


def loss_sequences(batch: dict[str, Any], fields: dict[str, list[Any]], rank: int,
                   group_size: int | None) -> list[Sequence]:
    """The micro-batch's samples not recorded yet in this rollout (seq -1: no rollout position)."""
    positions = batch.get("partition")
    seqs = []
    for i in range(len(batch["response_lengths"])):
        pos = int(positions[i]) if positions is not None else None
        if pos is not None and pos in STATE.seen:  # --recompute-loss-function calls the loss again
            continue
        seq = (STATE.rollout_id << dump.SEQ_STEP_SHIFT) + pos if pos is not None else -1
        group = pos // group_size if pos is not None and group_size else None
        mask = _np(batch["loss_masks"][i]) != 0
        seqs.append(Sequence(step=max(STATE.rollout_id, 0), rank=rank, micro=STATE.micro, seq=seq, group=group,
                             mask=mask, **{k: _np(v[i]) for k, v in fields.items()},
                             policy_version=_versions(batch, i, len(mask), mask)))
        if pos is not None:
            STATE.seen.add(pos)
    return seqs


def _versions(batch: dict[str, Any], i: int, n: int, mask: np.ndarray) -> int | np.ndarray | None:
    """Sample i's policy_version: per token from Miles' `response_weight_version_segments`, else one from
    `weight_versions` (Miles' train data has them; slime's does not)."""
    segments, versions = batch.get("response_weight_version_segments"), batch.get("weight_versions")
    per_token = dump.segment_versions(segments[i], n, mask) if segments is not None else None
    if per_token is not None:
        return per_token
    return dump.slime_policy_version(versions[i]) if versions is not None else None


def _np(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().float().cpu() if x.is_floating_point() else x.detach().cpu()
        return x.numpy()
    return np.asarray(x)


def close() -> None:
    """Publish what is recorded (slime exits normally: the recorder also closes at exit)."""
    if STATE.recorder is not None:
        STATE.recorder.close()
        STATE.recorder = None
