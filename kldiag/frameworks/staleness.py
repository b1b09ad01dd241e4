"""Where each framework bounds the staleness of asynchronous samples, and what it records as a version.

Read from each framework's code (the snapshot named per entry); `async_staleness`'s fix names the key.
    trl      1.16.0: `trl/experimental/async_grpo` `AsyncGRPOConfig.max_staleness` (default 4; samples whose
             `RolloutSample.model_version` is older are dropped). Synchronous `GRPOTrainer` reuses one
             generation over `steps_per_generation` x `num_iterations` optimizer steps (grpo_trainer.py
             `_prepare_inputs`: a new generation when `_step % (steps_per_generation * num_iterations) == 0`).
    verl     1dda039: V1 trainer `trainer.v1.sampler.max_off_policy_threshold` (default 8, with
             `max_off_policy_strategy` drop | wait), versions `min_global_steps`/`max_global_steps`;
             experimental fully-async `async_training.staleness_threshold` (0.1).
    slime    624b824: `Sample.weight_versions` (per generate call); no max-staleness key.
    miles    31f1ca9: `--max-weight-staleness` (fully-async; default None), versions `weight_versions`.
    nemo_rl  7ea279a: `grpo.async_grpo.max_trajectory_age_steps` (default 1).
    skyrl    a956457: `trainer.fully_async.max_staleness_steps` (default 4).
    areal    cbff54d: `rollout.max_head_offpolicyness` (default 0), per-token `versions`.
    prime_rl 559b447: `orchestrator.max_off_policy_steps` (default 8).
"""

from __future__ import annotations

from typing import Any

from kldiag.frameworks import trainer_name

# trainer name prefix -> (the staleness bound's key, its default, how to lower it; "": the framework module's fix)
BOUNDS: dict[str, tuple[str, str, str]] = {
    "trl": ("max_staleness", "4", ""),  # the fix: kldiag.frameworks.trl's
    "verl": ("trainer.v1.sampler.max_off_policy_threshold", "8",
             "Lower `trainer.v1.sampler.max_off_policy_threshold` (default 8; `max_off_policy_strategy=drop` evicts "
             "older samples), or `async_training.staleness_threshold` in the fully-async recipe."),
    "slime": ("", "",
              "slime has no max-staleness key (`weight_versions` is recorded, not enforced): update weights more "
              "often (`--update-weights-interval 1`) or train synchronously (train.py instead of train_async.py)."),
    "miles": ("--max-weight-staleness", "None",
              "Set `--max-weight-staleness` (default None: unbounded) to the staleness the correction absorbs."),
    "nemo": ("grpo.async_grpo.max_trajectory_age_steps", "1",
             "Lower `grpo.async_grpo.max_trajectory_age_steps` (default 1)."),
    "skyrl": ("trainer.fully_async.max_staleness_steps", "4",
              "Lower `trainer.fully_async.max_staleness_steps` (default 4)."),
    "areal": ("rollout.max_head_offpolicyness", "0", "Lower `rollout.max_head_offpolicyness` (default 0)."),
    "prime": ("orchestrator.max_off_policy_steps", "8", "Lower `orchestrator.max_off_policy_steps` (default 8)."),
}
PLAIN = ("", "", "")  # no known bound: kldiag.frameworks.plain's fix


def bound_for(manifest: Any) -> tuple[str, str, str]:
    """(key, default, fix) for the run's trainer (PLAIN when the trainer is unknown); fix "" defers to
    kldiag.frameworks.fix_for("async_staleness", manifest)."""
    name = trainer_name(manifest)
    for prefix, entry in BOUNDS.items():
        if name.startswith(prefix):
            return entry
    return PLAIN
