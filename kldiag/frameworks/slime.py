"""slime: the options kldiag names in its fixes, and the estimator names of its KL types.

Checked in THUDM/slime@624b824a `slime/utils/arguments.py` (--use-unbiased-kl, --kl-loss-type, --use-tis,
--use-opsm/--opsm-delta, --get-mismatch-metrics, --eps-clip-high, --entropy-coef).
"""

from __future__ import annotations

CLAMPED_K3 = "k3_clamped"  # kldiag's name for low_var_kl: K3 clamped at 10 (kldiag.frameworks.CLAMPED_K3)


def estimator_name(kl_loss_type: str | None, use_unbiased_kl: bool | None) -> str | None:
    """kldiag's estimator name (manifest config["estimator"]) for slime's KL options."""
    if kl_loss_type is None:
        return None
    if use_unbiased_kl and kl_loss_type in ("k3", "low_var_kl"):
        return "k3_is"
    return {"low_var_kl": CLAMPED_K3}.get(kl_loss_type, kl_loss_type)




FIXES = {
    "k3_weight_blowup": (
        'Add `--use-unbiased-kl` (rho * K3, DeepSeek-V3.2 eq. 7); keep `--kl-loss-type k3`.'),
    "clamp_dead_zone": (
        'slime clamps only `low_var_kl`: use `--kl-loss-type k3 --use-unbiased-kl`.'),
    "offpolicy_drift": (
        'Add `--use-opsm --opsm-delta 1e-4` and `--use-tis`; fewer updates per rollout.'),
    "engine_mismatch": (
        'Add `--use-tis` (or a `--custom-tis-function-path` such as icepop) and `--get-mismatch-metrics`; check the '
        'SGLang dtype and temperature.'),
    "numerical_fault": (
        'Check fp16 overflow, -inf masking of sampled tokens, and the rollout/train temperature.'),
    "entropy_collapse": (
        'Raise `--eps-clip-high` (e.g. 0.28) or add `--entropy-coef`.'),
    "engine_temperature_mismatch": (
        'Score with the sampling temperature: the trainer must divide the logits by `--rollout-temperature` as '
        'SGLang does, and the rollout log-probs must be post-temperature.'),
    "engine_raw_logprobs": (
        'SGLang returns pre-temperature log-probs while sampling at `--rollout-temperature`: the rollout log-probs '
        'must be those of the distribution it samples from; until then do not use `--use-tis` on them.'),
    "engine_wrong_token": (
        'The rollout log-probs are off by one position against the response tokens (a custom rollout function '
        'slicing them): align them; `--get-mismatch-metrics` shows the effect, and do not use `--use-tis` until then.'),
    "engine_precision": (
        'SGLang and Megatron differ in precision: compute the rollout\'s last layer in fp32 or use the same dtype '
        'in both, and keep `--use-tis`; watch `--get-mismatch-metrics`.'),
    "engine_stale_weights": (
        'SGLang does not get the new weights at every step: check the weight update to the rollout engines after '
        'each train step, and add `--use-tis` meanwhile.'),
    "engine_async_lag": (
        'Rollouts come from an older policy (asynchronous training): bound how far the rollout may run ahead, and '
        'add `--use-tis` (or a masking `--custom-tis-function-path`).'),
}

# When the run's manifest already has what a fix sets (kldiag.frameworks.SETTINGS): the fix to give instead.
IF_SET = {
    "entropy_collapse": ("clip_higher", (
        "The upper clip is already {clip_high:g} (`--eps-clip-high`, DAPO's clip-higher): add `--entropy-coef` "
        '(e.g. 0.001) or raise the rollout temperature.')),
    "engine_mismatch": ("engine_is", (
        '`--use-tis` is already on: try a `--custom-tis-function-path` that masks (icepop), add '
        '`--get-mismatch-metrics`, and check the SGLang dtype and temperature.')),
    "offpolicy_drift": ("opsm", (
        'The off-policy sequence mask is already on: lower `--opsm-delta`, add `--use-tis`, and update fewer times '
        'per rollout.')),
}

# MoE routing (kldiag/diagnosis/routing.py): R3 in THUDM/slime@624b824a (slime/utils/arguments.py,
# slime/utils/routing_replay.py).
FIXES["moe_routing_mismatch"] = (
    "SGLang routes tokens to other experts than Megatron: turn on rollout routing replay with "
    "`--use-rollout-routing-replay` (it implies `--use-routing-replay`), and keep `--use-tis` for the rest.")
FIXES["routing_replay_broken"] = (
    "`--use-rollout-routing-replay` is on but Megatron does not route as SGLang did: check that each sample's "
    "`rollout_routed_experts` has one row per token but the last, that no MoE layer is all zeros (a pipeline-"
    "parallel capture bug slime's validator rejects), and that the Megatron patch that calls the replay top-k is "
    "applied (RoutingReplay.assert_all_consumed has no call site).")

# parity contracts (slime/Miles true-on-policy mode, args.true_on_policy_mode)
FIXES["parity_broken"] = (
    "The true on-policy mode (slime and Miles' true-on-policy-mode flag) promises bitwise-equal SGLang and Megatron "
    "log-probs: check that both run the "
    "batch-invariant kernels, the same attention backend and the same temperature path, at the first token off "
    "(the evidence names it); meanwhile keep `--use-tis`.")
