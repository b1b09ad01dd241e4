"""NeMo-RL: the options kldiag names in its fixes.

Checked in NeMo-RL `nemo_rl/algorithms/loss/loss_functions.py` (`ClippedPGLossConfig`: loss_fn.* keys,
`use_importance_sampling_correction`, `truncated_importance_sampling_ratio`, `ratio_clip_max`) and its
configs (`policy.generation.temperature`).
"""

from __future__ import annotations

FIXES = {
    "k3_weight_blowup": (
        'Set `loss_fn.use_on_policy_kl_approximation=true` (KL weighted by pi_theta/pi_gen) or '
        '`loss_fn.reference_policy_kl_type=k2`.'),
    "clamp_dead_zone": (
        'Raise `loss_fn.kl_output_clamp_value` or use `loss_fn.reference_policy_kl_type=k2`.'),
    "offpolicy_drift": (
        'Fewer policy updates per generation batch; enable the seq-mask-tis / icepop correction.'),
    "engine_mismatch": (
        'Set `loss_fn.use_importance_sampling_correction=true` (optionally '
        '`loss_fn.truncated_importance_sampling_ratio`, e.g. 2.0); NeMo-RL flags token_mult_prob_error > 1.05: check '
        'the generation backend\'s dtype and temperature.'),
    "numerical_fault": (
        'Check fp16 overflow, -inf masking of sampled tokens, and the generation temperature.'),
    "entropy_collapse": (
        "Raise the upper clip `loss_fn.ratio_clip_max` (DAPO's clip-higher, e.g. 0.28) or "
        '`policy.generation.temperature`.'),
    "engine_raw_logprobs": (
        'The generation backend returns pre-temperature log-probs while sampling at '
        '`policy.generation.temperature`: make it return processed log-probs; until then leave '
        '`loss_fn.use_importance_sampling_correction` off.'),
    "engine_wrong_token": (
        'The generation log-probs are off by one position against the response tokens: align them; until then '
        'leave `loss_fn.use_importance_sampling_correction` off (token_mult_prob_error is meaningless meanwhile).'),
    "engine_precision": (
        'The generation backend and the policy differ in precision: match their dtypes and set '
        '`loss_fn.use_importance_sampling_correction=true` with `loss_fn.truncated_importance_sampling_ratio`.'),
    "engine_stale_weights": (
        'The generation workers do not get the new weights at every step (the refit): check it runs after each '
        'step, and set `loss_fn.use_importance_sampling_correction=true` meanwhile.'),
    "engine_async_lag": (
        'With asynchronous GRPO (grpo.async_grpo.enabled) trajectories come from older policies: lower '
        'grpo.async_grpo.max_trajectory_age_steps, and keep `loss_fn.use_importance_sampling_correction=true`.'),
}

# When the run's manifest already has what a fix sets (kldiag.frameworks.SETTINGS): the fix to give instead.
IF_SET = {
    "entropy_collapse": ("clip_higher", (
        "The upper clip is already `loss_fn.ratio_clip_max={clip_high:g}` (DAPO's clip-higher): raise "
        '`policy.generation.temperature`, or add an entropy bonus to the loss.')),
    "engine_mismatch": ("engine_is", (
        '`loss_fn.use_importance_sampling_correction` is already on: set '
        '`loss_fn.truncated_importance_sampling_ratio` (e.g. 2.0) and remove the mismatch at its source: the '
        'generation backend\'s dtype and `policy.generation.temperature`.')),
}
