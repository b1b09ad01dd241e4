"""Record every SkyRL training step from the driver, with SkyRL's own callback API.

    # one line, on the trainer you build (RayPPOTrainer or a subclass), before trainer.train():
    kldiag.integrations.skyrl.attach(trainer, "/ckpt/kldiag_run")
    # or: RayPPOTrainer(..., callbacks=[kldiag.integrations.skyrl.KldiagCallback("/ckpt/kldiag_run")])

Read at skyrl 0.4.0 (PyPI wheel). `TrainingCallback.on_step_end` fires on the driver after the step's training
with `batch` = the step's `training_input` (`skyrl/train/trainer.py` l. 447) and `global_step` = the step its
metrics are logged at (l. 534), so `kldiag audit` aligns at offset 0. One writer, no rank of its own.
Recorded per row of that batch, over SkyRL's whole padded response block [B, R] (padding: mask False, kept so the
crosswalk sees the width SkyRL's per-micro-batch metrics run over): logp_old = `action_log_probs` (the trainer's
forward pass before the update, `fwd_logprobs_values_reward` l. 1390-1409), logp_ref = `base_action_log_probs`
(with a reference model), logp_sampler = `rollout_logprobs` (vLLM's, `generator.sampling_params.logprobs`),
advantages (as the callback sees them: SkyRL's `_normalize_advantages` rescales them in place per mini-batch,
l. 1499-1530), mask = `loss_mask`, token_ids = the last R columns of `sequences`.
What SkyRL drops, and what kldiag does: pi_theta of each mini-batch stays on the workers (`forward_backward`
returns only metrics), so logp = the pre-update forward, which is pi_theta for the first mini-batch of the first
epoch only (the manifest's null_reasons say so); the prompt uids are popped before the callback (l. 429), so
`convert_to_training_input` is wrapped to keep them: group = a hash of the uid; seq = a hash of the sample's
tokens and log-probs (kldiag.integrations.common.ids).
rank and micro are SkyRL's worker micro-batches: each mini-batch (`metadata["policy_mini_batch_boundaries"]`) is
cut into `dp_size` contiguous chunks (`MeshDispatch.stage_chunks`, distributed/dispatch.py l. 126-163), each
chunk into micro-batches of `trainer.micro_train_batch_size_per_gpu` (worker.py l. 1011); micro =
(mini-batch * RANK_SLOTS + the chunk's DP rank) * MICRO_SLOTS + micro-batch (the driver is the one writer,
rank 0). With `trainer.max_tokens_per_microbatch` SkyRL packs by tokens
instead: the manifest says the micro-batches are then not SkyRL's. Recording failures warn once and never reach
training (KLDIAG_STRICT=1 raises them).
"""

from __future__ import annotations

import os
from typing import Any

from kldiag.errors import IntegrationError
from kldiag.frameworks import sampling as sampling_settings
from kldiag.frameworks.skyrl import ESTIMATOR_OF, SUPPORTED
from kldiag.integrations.common.failures import recording_failed
from kldiag.integrations.common.ids import sequence_ids, text_ids
from kldiag.integrations.common.versions import check_release
from kldiag.record.recorder import Recorder

ENV_RUN = "KLDIAG_RUN"
MICRO_SLOTS = 256  # micro-batches per DP chunk of a mini-batch
RANK_SLOTS = 256  # DP ranks (micro is an int32 column: mini-batches < 32768)
ALGO_KEYS = ("kl_estimator_type", "use_kl_loss", "use_kl_in_reward", "kl_loss_coef", "eps_clip_low", "eps_clip_high",
             "policy_loss_type", "loss_reduction", "advantage_estimator", "temperature", "use_entropy_loss",
             "entropy_loss_coef", "use_tis", "tis_imp_ratio_cap")
OPC_KEYS = ("tis_ratio_type", "sequence_mask_metric", "outlier_token_is_threshold_low",
            "outlier_token_is_threshold_high", "token_mask_is_threshold_low", "token_mask_is_threshold_high",
            "token_tis_ratio_clip_high", "sequence_tis_ratio_clip_high")
TRAINER_KEYS = ("update_epochs_per_batch", "policy_mini_batch_size", "micro_train_batch_size_per_gpu",
                "max_tokens_per_microbatch", "train_batch_size")
LOGP = ("logp is SkyRL's pre-update forward pass (action_log_probs): pi_theta for the first mini-batch of the first "
        "epoch only; later mini-batches' pi_theta stay on the workers")


def check_version(version: str | None = None) -> str:
    """skyrl's version, or IntegrationError naming SUPPORTED and the fix."""
    return check_release("skyrl", SUPPORTED, version, " (its TrainingCallback API)")


def settings(cfg: Any) -> dict[str, Any]:
    """The manifest `config` of a SkyRL run from its config (SkyRLTrainConfig or DictConfig)."""
    g = sampling_settings._get
    trainer, algo = g(cfg, "trainer"), g(g(cfg, "trainer"), "algorithm")
    opc = g(algo, "off_policy_correction")
    out: dict[str, Any] = {k: g(algo, k) for k in ALGO_KEYS}
    out.update({k: g(trainer, k) for k in TRAINER_KEYS})
    out["off_policy_correction_keys"] = {k: g(opc, k) for k in OPC_KEYS}
    on = [g(opc, "tis_ratio_type"), g(opc, "sequence_mask_metric"), g(opc, "outlier_token_is_threshold_low"),
          g(opc, "outlier_token_is_threshold_high")]
    token_mask = all(g(opc, k) is not None for k in ("token_mask_is_threshold_low", "token_mask_is_threshold_high"))
    out["off_policy_correction"] = any(v is not None for v in on) or token_mask
    sp = g(g(cfg, "generator"), "sampling_params")
    out["engine_sampling"] = sampling_settings.settings(
        g(sp, "temperature"), g(sp, "top_k"), g(sp, "top_p"), g(sp, "min_p"), None, [], "vllm",
        {n: f"generator.sampling_params.{n}" for n in ("temperature", "top_k", "top_p", "min_p")})
    out.update(skyrl_version=SUPPORTED.lstrip("="), estimator=ESTIMATOR_OF.get(str(out["kl_estimator_type"])),
               kl_clamp=out["kl_estimator_type"] == "k3", skyrl_micro_slots=[RANK_SLOTS, MICRO_SLOTS],
               null_reasons={"logp": LOGP, "seq_ids": "SkyRL has no sample id: kldiag hashes each sample's tokens "
                                                      "and log-probs (group: SkyRL's prompt uid)"})
    if out["max_tokens_per_microbatch"]:
        out["null_reasons"]["micro"] = ("trainer.max_tokens_per_microbatch packs micro-batches by tokens on the "
                                        "workers: kldiag's micro column is not SkyRL's micro-batches")
    return out


def micro_batches(boundaries: list, dp_size: int, micro_size: int, n: int) -> list[int]:
    """The micro code of each of the n rows (module doc)."""
    micro = [0] * n
    for i, (start, end) in enumerate(boundaries or [(0, n)]):
        chunk = -(-(end - start) // dp_size)  # stage_chunks pads the mini-batch up to a multiple of dp_size
        for row in range(start, min(end, n)):
            j = row - start
            micro[row] = (i * RANK_SLOTS + j // chunk) * MICRO_SLOTS + (j % chunk) // max(micro_size, 1)
    return micro


def record_step(recorder: Any, batch: Any, step: int, cfg: dict, dp_size: int, uids: list | None) -> None:
    """Record the step's training_input, one recorder call per SkyRL micro-batch (module doc)."""
    import numpy as np
    import torch

    mask = batch["loss_mask"].bool()
    n, r = mask.shape
    old = batch["action_log_probs"]
    mu = batch.get("rollout_logprobs") if hasattr(batch, "get") else None
    ref = batch.get("base_action_log_probs") if hasattr(batch, "get") else None
    tokens = batch["sequences"][:, -r:]
    keep = batch["attention_mask"].bool() if batch.get("attention_mask") is not None else torch.ones_like(
        batch["sequences"], dtype=torch.bool)
    seq = sequence_ids(batch["sequences"], keep, mu if mu is not None else old, mask)
    group = text_ids(uids) if uids is not None and len(uids) == n else None
    micro = np.array(micro_batches(batch.metadata.get("policy_mini_batch_boundaries"), dp_size,
                                   int(cfg.get("micro_train_batch_size_per_gpu") or 1), n))
    for code in np.unique(micro):
        rows = torch.from_numpy(np.flatnonzero(micro == code))

        def pick(x: Any) -> Any:
            return None if x is None else x[rows]
        recorder.record(step=step, micro=int(code), logp=old[rows], logp_old=old[rows], logp_ref=pick(ref),
                        logp_sampler=pick(mu), advantages=pick(batch.get("advantages")), mask=mask[rows],
                        completion_mask=torch.ones_like(mask[rows]), token_ids=tokens[rows],
                        seq_ids=seq[rows.numpy()], group_ids=None if group is None else group[rows.numpy()])


class _Callback:
    """The recording TrainingCallback (built on SkyRL's class by KldiagCallback)."""

    def __init__(self, run: str | os.PathLike | None = None):
        self.run = run if run is not None else os.environ.get(ENV_RUN)
        if not self.run:
            raise IntegrationError(f"pass run= or set {ENV_RUN} to the kldiag run directory (or URI) to record into")
        self.recorder, self.uids, self.failures, self.config = None, None, 0, None

    def on_train_start(self, trainer: Any, callback_input: Any, control: Any) -> None:
        _keep_uids(trainer, self)

    def on_step_end(self, trainer: Any, callback_input: Any, control: Any) -> None:
        try:
            if self.recorder is None:
                self.config = settings(trainer.cfg)
                coef = self.config["kl_loss_coef"] if self.config["use_kl_loss"] else None
                low, high = self.config["eps_clip_low"], self.config["eps_clip_high"]
                self.recorder = Recorder(self.run, trainer="skyrl", trainer_version=self.config["skyrl_version"],
                                         beta=coef, estimator=self.config["estimator"],
                                         clip_range=(low, high) if low is not None else None, config=self.config)
            dispatch = getattr(trainer, "dispatch", None)
            dp = int(dispatch.dp_size("policy")) if dispatch is not None and hasattr(dispatch, "dp_size") else 1
            record_step(self.recorder, callback_input.batch, int(callback_input.global_step), self.config, dp,
                        self.uids)
        except Exception as e:  # noqa: BLE001 - never into training unless asked
            recording_failed(self, e, "a SkyRL step", stacklevel=2)

    def on_train_end(self, trainer: Any, callback_input: Any, control: Any) -> None:
        self.close()

    def close(self) -> None:
        if self.recorder is not None:
            self.recorder.close()
            self.recorder = None


def _keep_uids(trainer: Any, callback: Any) -> None:
    """Wrap trainer.convert_to_training_input (an instance attribute) so the step's uids reach the callback."""
    inner = trainer.convert_to_training_input
    if getattr(inner, "kldiag", False):
        return

    def convert_to_training_input(generator_output: Any, uids: list) -> Any:
        callback.uids = list(uids)
        return inner(generator_output, uids)
    convert_to_training_input.kldiag = True
    trainer.convert_to_training_input = convert_to_training_input


def KldiagCallback(run: str | os.PathLike | None = None) -> Any:  # noqa: N802 - a class factory, used as a class
    """A SkyRL TrainingCallback recording into `run` (default $KLDIAG_RUN)."""
    check_version()
    from skyrl.train.utils.callbacks import TrainingCallback

    cls = type("KldiagCallback", (_Callback, TrainingCallback), {"__module__": __name__})
    return cls(run)


def attach(trainer: Any, run: str | os.PathLike | None = None) -> Any:
    """Add the recording callback to a SkyRL RayPPOTrainer (before train()); returns it."""
    callback = KldiagCallback(run)
    _keep_uids(trainer, callback)
    trainer.add_callback(callback)
    return callback
