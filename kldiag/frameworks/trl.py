"""TRL (GRPOTrainer): the options kldiag names in its fixes, the versions its hook supports.

Checked in trl 1.16.0 `trl/trainer/grpo_config.py` (use_bias_correction_kl, off_policy_mask_threshold,
vllm_importance_sampling_correction (default True), vllm_importance_sampling_mode / _clip_max, num_iterations,
steps_per_generation, epsilon_high, temperature, beta, entropy_coef, use_adaptive_entropy, entropy_target,
cast_lm_head_to_fp32, bf16); tests/test_frameworks.py checks every backticked name against `trl.GRPOConfig`.
"""

from __future__ import annotations

SUPPORTED = ">=1.15,<1.17"  # keep in step with the `trl` extra in pyproject.toml and _TRL_MIN in integrations/trl/__init__.py

FIXES = {
    "async_staleness": (
        "GRPOTrainer serves each generation over `steps_per_generation` x `num_iterations` optimizer steps: lower "
        "them; with trl.experimental's AsyncGRPOTrainer, lower AsyncGRPOConfig's max_staleness (default 4)."),
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
    "engine_raw_logprobs": (
        "TRL scores with the sampling `temperature`, but the vLLM log-probs are pre-temperature (raw): make vLLM "
        "return processed log-probs (vLLM's logprobs_mode processed_logprobs), and until then do not weight by "
        'them: `vllm_importance_sampling_correction=False`.'),
    "engine_wrong_token": (
        "The vLLM log-probs are off by one position against the completion ids (a custom rollout function or "
        "`vllm_mode` server returning them shifted): align them; until then set "
        '`vllm_importance_sampling_correction=False`, which otherwise weights each token by its neighbour\'s.'),
    "engine_precision": (
        "vLLM's numerics differ from the trainer's: keep `cast_lm_head_to_fp32=True`, sample with the dtype the "
        "trainer uses (`bf16`), and keep `vllm_importance_sampling_correction=True` "
        '(`vllm_importance_sampling_mode="token_mask"` masks the outliers).'),
    "engine_stale_weights": (
        "vLLM does not get the new weights at every step: with `vllm_mode=\"server\"` check that the weight-sync "
        "group on `vllm_group_port` reaches the server (a failed sync leaves it on old weights), and keep "
        '`vllm_importance_sampling_correction=True` meanwhile.'),
    "engine_async_lag": (
        "The completions come from an older policy than the trainer's: lower `steps_per_generation` (one "
        "generation serves that many optimizer steps), check the weight sync to the `vllm_mode` server, and keep "
        '`vllm_importance_sampling_correction=True`.'),
    "engine_retokenization": (
        "The trainer scores re-tokenised turns: let GRPOTrainer's own tool loop build multi-turn completions (its "
        "tools or environment_factory argument; trl/trainer/grpo_trainer.py _tool_call_loop, TRL 1.16, appends the "
        "tool reply's ids to the engine's completion ids and swaps a chat template that is not prefix-preserving "
        "for a training-safe one), or make a rollout_func return the engine's prompt_ids and completion_ids (with "
        "env_mask on tool tokens), never ids re-encoded from decoded text."),
}
from kldiag.frameworks.sampling import TRUNCATION_FIXES  # noqa: E402 - the truncation fix lives with the sampling keys

FIXES["engine_truncated_sampling"] = TRUNCATION_FIXES["trl"]
from kldiag.frameworks.plain import FIXES as _PLAIN  # noqa: E402

FIXES["data_missing"] = _PLAIN["data_missing"]  # the recorder's trouble, not TRL's

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

# MoE routing (kldiag/diagnosis/routing.py): TRL 1.16 has no rollout routing replay (GRPOTrainer's vLLM
# generation returns no routes), so the fix is the importance-sampling correction and the engine's precision.
FIXES["moe_routing_mismatch"] = (
    "vLLM routes tokens near a router tie to other experts than the trainer; TRL has no routing replay: keep "
    "`vllm_importance_sampling_correction=True` with `vllm_importance_sampling_mode=\"token_mask\"` (it masks the "
    "tokens routed differently, whose ratio is far from 1), sample with the dtype the trainer uses, or train the "
    "MoE with a framework that replays the engine's routes (verl, slime, NeMo-RL, SkyRL, prime-rl).")
FIXES["routing_replay_broken"] = (
    "The run says routing replay was on, but TRL replays no routes: the engine's and the trainer's routes differ. "
    "Drop the routing_replay setting from the run's config, or move the run to a framework with routing replay; "
    "meanwhile keep `vllm_importance_sampling_correction=True`.")

# parity contracts and the learning signal (GRPOConfig fields of TRL 1.16)
FIXES["parity_broken"] = (
    "The run declares true on-policy but vLLM's log-probs differ from the trainer's: match the dtypes "
    "(`cast_lm_head_to_fp32` on both sides), the kernels and the temperature path at the first token off, and keep "
    "`vllm_importance_sampling_correction=True` meanwhile.")
FIXES["batch_variance"] = (
    "The old log-probs are computed in another pass than the update's (other batch sizes or padding): compute them "
    "with the same `per_device_train_batch_size` as the update, or use batch-invariant kernels.")
FIXES["kl_dominated_signal"] = (
    "Most groups have all-equal rewards, so only the KL term moves their tokens: lower `beta` (TRL's default is 0), "
    "sample more completions per prompt or pick prompts of the policy's level; `scale_rewards` does not help, a "
    "group without spread stays at advantage 0.")
