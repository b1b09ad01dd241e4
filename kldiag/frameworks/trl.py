"""TRL (GRPOTrainer): the options kldiag names in its fixes, the versions its hook supports.

Checked in trl 1.16.0 `trl/trainer/grpo_config.py` (use_bias_correction_kl, off_policy_mask_threshold,
vllm_importance_sampling_correction (default True), vllm_importance_sampling_mode / _clip_max, num_iterations,
steps_per_generation, epsilon_high, temperature, beta, entropy_coef, use_adaptive_entropy, entropy_target,
cast_lm_head_to_fp32, bf16); tests/test_frameworks.py checks every backticked name against `trl.GRPOConfig`.
"""

from __future__ import annotations

SUPPORTED = ">=1.16,<1.17"  # keep in step with the `trl` extra in pyproject.toml

FIXES = {
    "k3_weight_blowup": (
        'Set `GRPOConfig(use_bias_correction_kl=True)`: the KL becomes rho * k3 (DeepSeek-V3.2 eq. 7), whose weight '
        'rho * log(pi_theta/pi_ref) grows like a log; add `off_policy_mask_threshold` to drop stale '
        'negative-advantage sequences.'),
    "clamp_dead_zone": (
        'TRL does not clamp K3; if your loss does, drop the clamp and use `GRPOConfig(use_bias_correction_kl=True)` '
        'instead.'),
    "offpolicy_drift": (
        'Reuse each generation less: lower `num_iterations` / `steps_per_generation`, and set '
        '`off_policy_mask_threshold` (DeepSeek-V3.2 off-policy sequence mask).'),
    "engine_mismatch": (
        'Set `GRPOConfig(vllm_importance_sampling_correction=True)` (TRL\'s default: IS on pi_old/mu) and check vLLM '
        "samples with the trainer's `temperature`, top-p and dtype (`cast_lm_head_to_fp32=True`)."),
    "numerical_fault": (
        'Train in bf16 (`bf16=True`, not fp16), keep `cast_lm_head_to_fp32=True`, and check that no sampled token is '
        'masked to -inf by the logits processing.'),
    "entropy_collapse": (
        "Raise the upper clip `epsilon_high` (DAPO's clip-higher, e.g. 0.28) or the sampling `temperature`; lower "
        '`beta` if the reference pins the policy.'),
    "engine_temperature_mismatch": (
        "TRL divides the trainer's logits by `GRPOConfig.temperature` (grpo_trainer.py "
        '_get_per_token_logps_and_entropies) and passes the same value to vLLM: make sure no other temperature or '
        'logits processor reaches the engine, and that the engine returns processed log-probs.'),
}

# When the run's manifest already has what a fix sets (kldiag.frameworks.SETTINGS): the fix to give instead.
IF_SET = {
    "entropy_collapse": ("clip_higher", (
        "The upper clip is already `epsilon_high={clip_high:g}` (DAPO's clip-higher): add an entropy bonus, "
        '`entropy_coef` > 0, or `use_adaptive_entropy=True` with an `entropy_target` near the entropy the run '
        'started with; or raise the sampling `temperature`.')),
    "engine_mismatch": ("engine_is", (
        'The importance-sampling correction is already on (`vllm_importance_sampling_correction=True`): mask '
        'rather than truncate (`vllm_importance_sampling_mode="token_mask"`) or lower '
        "`vllm_importance_sampling_clip_max`, and remove the mismatch at its source: vLLM's `temperature`, top-p "
        'and dtype against the trainer\'s, `cast_lm_head_to_fp32=True`.')),
    "offpolicy_drift": ("opsm", (
        'Reuse each generation less: lower `num_iterations` / `steps_per_generation`; the off-policy sequence mask '
        'is already on: lower `off_policy_mask_threshold` to drop more stale negative-advantage sequences.')),
}
