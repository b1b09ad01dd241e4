"""The fixes of the rollout causes in each framework's words, added to the framework modules' FIXES on import.

    mixed_version_rollout  a sequence generated across a weight update (partial / interruptible rollouts)
    engine_wrong_weights   the engine serves the reference (or base) model instead of the policy
    engine_low_precision   a low-precision (FP8, INT8, FP4) rollout whose mismatch moves with each weight sync

Sources: slime #1695 (fixed by #2380: `MegatronTrainRayActor` init loaded `--ref-load` into the one model instance
last and never switched back to the actor snapshot, so the first weight sync after a resume pushed the reference
to SGLang); Miles #2835 (the weight version resets after a resume); vLLM #34186 / #34591 (a LoRA adapter silently
not applied); verl 0.9.1 `_generated_ppo_trainer.yaml`: `actor_rollout_ref.model.lora_rank`,
`actor_rollout_ref.rollout.quantization` (null or "fp8"), `trainer.resume_mode`; verl #7519 (FP8 tensorwise rollouts
against MXFP8); xtuner #2044; AReaL 1.0.4 `areal/api/cli_args.py` `rollout.max_head_offpolicyness`; prime-rl
`orchestrator.max_off_policy_steps` (masks tokens stamped more than that many versions behind, prime-rl #2957);
TRL 1.16 `AsyncGRPOConfig.max_staleness`.
"""

from __future__ import annotations

from kldiag.frameworks import areal, plain, slime, trl, verl

PLAIN = {
    "mixed_version_rollout": (
        "Sequences straddle a weight update: the tokens after it come from new weights over the old weights' KV "
        "cache. Finish (or restart) in-flight sequences before loading new weights, recompute the KV cache after a "
        "sync, or mask the tokens generated across the update (per-token versions: drop those more than one version "
        "behind); record policy_version per token to keep measuring it."),
    "engine_wrong_weights": (
        "The engine samples from the reference (or base) model, not the policy: after a resume, check that the "
        "weights pushed to the engine are the loaded policy's (compare a prompt's log-probs from the engine with the "
        "trainer's right after the first sync); with LoRA, check the adapter is applied in the engine after each "
        "sync. Every importance weight and KL term of the steps since the onset is against the wrong model: discard "
        "them or restart from the last checkpoint before the onset."),
    "engine_low_precision": (
        "The low-precision rollout's error changes with each weight sync: re-quantise with fresh scales at each sync "
        "(per-block or MXFP8 scales instead of per-tensor), keep the sensitive layers (lm_head, router, norms) in "
        "bf16, or roll out in bf16; correct the remaining mismatch with truncated importance sampling."),
}
FIXES = {
    "plain": PLAIN,
    "trl": {
        "mixed_version_rollout": (
            "Sequences straddle a weight update: sync the vLLM weights between generations, never during one, and "
            "bound the versions a sample may span (max_staleness in TRL's async GRPO config); record "
            "policy_version per token ([B, T]) to keep measuring it."),
        "engine_wrong_weights": (
            "vLLM samples another model than the policy: with a PEFT/LoRA policy, check that the merged or adapter "
            "weights reach vLLM after each sync (vLLM #34186, #34591: an adapter silently not applied, the base "
            "model sampled); after `resume_from_checkpoint`, check that the first sync pushes the loaded weights "
            "(compare a prompt's log-probs from vLLM with the trainer's). The steps since the onset trained on "
            "samples of another model: restart from the last checkpoint before it."),
        "engine_low_precision": PLAIN["engine_low_precision"],
    },
    "verl": {
        "mixed_version_rollout": (
            "Partial rollouts span weight updates: lower async_training.staleness_threshold (the fully-async recipe) "
            "or `trainer.v1.sampler.max_off_policy_threshold`, and reject what remains per token with "
            "`algorithm.rollout_correction.rollout_rs` and `algorithm.rollout_correction.rollout_rs_threshold`."),
        "engine_wrong_weights": (
            "The rollout samples another model than the actor: with `actor_rollout_ref.model.lora_rank` > 0, check "
            "that vLLM applies the adapter after each sync (vLLM #34186, #34591: an adapter silently not applied, "
            "the base model sampled); after a resume (`trainer.resume_mode`), check that the rollout workers receive "
            "the loaded actor weights, not the initial `actor_rollout_ref.model.path`."),
        "engine_low_precision": (
            "`actor_rollout_ref.rollout.quantization=fp8` with per-tensor scales grows the mismatch sync after sync "
            "(verl #7519: rollout_corr/kl 3.1x over a run, MXFP8 flat): use block-wise or MXFP8 quantisation, or "
            "unset `actor_rollout_ref.rollout.quantization`; keep `algorithm.rollout_correction` on for what remains."),
    },
    "slime": {
        "mixed_version_rollout": (
            "Partial rollouts (`--partial-rollout`) continue sequences across a weight update: mask their off-policy "
            "tokens (`--mask-offpolicy-in-partial-rollout`); in Miles, record response_weight_version_segments "
            "(--sglang-enable-response-weight-version-segments) and bound the versions (--max-weight-staleness)."),
        "engine_wrong_weights": (
            "After a resume (--load) with `--ref-load`, slime's Megatron actor loaded the reference snapshot last and "
            "the first weight sync pushed it to SGLang (slime #1695, fixed by #2380: switch back to the actor snapshot "
            "after loading `ref`): upgrade slime, then check the first rollout's log-probs against the actor's. In "
            "Miles, the weight version resets after a resume (Miles #2835): check the version the engine reports."),
        "engine_low_precision": (
            "FP8 rollouts in SGLang re-quantise the weights at each `update_weights`: use block-wise FP8 scales, keep "
            "lm_head and the router in bf16, or roll out in bf16; keep TIS/MIS on for what remains."),
    },
    "areal": {
        "mixed_version_rollout": (
            "AReaL's interruptible generation continues sequences across weight updates (per-token `versions`): lower "
            "`rollout.max_head_offpolicyness`, keep `actor.use_decoupled_loss=true` with "
            "`actor.recompute_logprob=true`, "
            "and mask tokens with `actor.rejection_sampling.level=token`."),
        "engine_wrong_weights": PLAIN["engine_wrong_weights"],
        "engine_low_precision": PLAIN["engine_low_precision"],
    },
}
MODULES = {"plain": plain, "trl": trl, "verl": verl, "slime": slime, "areal": areal}
for _family, _fixes in FIXES.items():
    MODULES[_family].FIXES.update(_fixes)
