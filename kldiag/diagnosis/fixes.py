"""Fixes phrased with the run's own trainer options (the manifest's trainer name).

Option names checked in the frameworks' code: TRL 1.16.0 `trl/trainer/grpo_config.py`
(use_bias_correction_kl, off_policy_mask_threshold, vllm_importance_sampling_correction,
num_iterations, steps_per_generation, epsilon_high, temperature, beta); verl
(verl-project/verl@1dda039b: `actor_rollout_ref.actor.kl_loss_type` incl. `k3+`,
`algorithm.rollout_correction.*` in docs/algo/rollout_corr.md, `actor.ppo_epochs`,
`actor.clip_ratio_high`, `actor.entropy_coeff`, `rollout.calculate_log_probs`); slime
(THUDM/slime@624b824a `slime/utils/arguments.py`: --use-unbiased-kl, --kl-loss-type, --use-tis,
--use-opsm/--opsm-delta, --get-mismatch-metrics, --eps-clip-high, --entropy-coef); OpenRLHF
(--algo.kl.estimator, --algo.advantage.is_correction_enable); NeMo-RL (loss_fn.* keys,
nemo_rl/algorithms/loss/loss_functions.py). See /work/shared/FRAMEWORKS.md.
"""

from __future__ import annotations

FAMILIES = ("trl", "verl", "slime", "openrlhf", "nemo_rl", "plain")

FIXES: dict[str, dict[str, str]] = {
    "k3_weight_blowup": {
        "trl": "Set `GRPOConfig(use_bias_correction_kl=True)`: the KL becomes rho * k3 (DeepSeek-V3.2 eq. 7), "
               "whose weight rho * log(pi_theta/pi_ref) grows like a log; add `off_policy_mask_threshold` "
               "to drop stale negative-advantage sequences.",
        "verl": "verl has no unbiased KL: set `actor_rollout_ref.actor.kl_loss_type=k3+` (K3 value, K2's "
                "bounded gradient; verl PR #2953) or `kl_loss_type=k2`.",
        "slime": "Add `--use-unbiased-kl` (rho * K3, DeepSeek-V3.2 eq. 7); keep `--kl-loss-type k3`.",
        "openrlhf": "Use `--algo.kl.estimator k2` (gradient log(pi_theta/pi_ref), bounded by a log).",
        "nemo_rl": "Set `loss_fn.use_on_policy_kl_approximation=true` (KL weighted by pi_theta/pi_gen) or "
                   "`loss_fn.reference_policy_kl_type=k2`.",
        "plain": "Multiply the K3 term by rho = exp(logp - logp_old) without detaching it (DeepSeek-V3.2 eq. 7), "
                 "or use K2 = 0.5 * (logp - logp_ref)**2 as the loss.",
    },
    "clamp_dead_zone": {
        "trl": "TRL does not clamp K3; if your loss does, drop the clamp and use "
               "`GRPOConfig(use_bias_correction_kl=True)` instead.",
        "verl": "The K3 clamp at 10 zeroes these tokens' KL gradient: use `actor_rollout_ref.actor.kl_loss_type=k3+` "
                "or `k2` (no clamp on the gradient).",
        "slime": "slime clamps only `low_var_kl`: use `--kl-loss-type k3 --use-unbiased-kl`.",
        "openrlhf": "OpenRLHF clamps every estimator to +-10: `--algo.kl.estimator k2` keeps a gradient for "
                    "far more tokens (k2 > 10 needs |log ratio| > 4.5).",
        "nemo_rl": "Raise `loss_fn.kl_output_clamp_value` or use `loss_fn.reference_policy_kl_type=k2`.",
        "plain": "Remove the clamp on K3 (it zeroes the gradient exactly where pi_theta << pi_ref) and use "
                 "rho * K3 or K2 instead.",
    },
    "offpolicy_drift": {
        "trl": "Reuse each generation less: lower `num_iterations` / `steps_per_generation`, and set "
               "`off_policy_mask_threshold` (DeepSeek-V3.2 off-policy sequence mask).",
        "verl": "Lower `actor_rollout_ref.actor.ppo_epochs` (or the mini-batch count), and turn on "
                "`algorithm.rollout_correction.rollout_is=token` with `rollout_rs` (verl docs: rollout_corr.md).",
        "slime": "Add `--use-opsm --opsm-delta 1e-4` and `--use-tis`; fewer updates per rollout.",
        "openrlhf": "Turn on `--algo.advantage.is_correction_enable` (TIS/icepop); fewer epochs per rollout.",
        "nemo_rl": "Fewer policy updates per generation batch; enable the seq-mask-tis / icepop correction.",
        "plain": "Update fewer times on each batch of samples, clip or mask importance ratios "
                 "(truncated IS, DeepSeek-V3.2's sequence mask).",
    },
    "engine_mismatch": {
        "trl": "Set `GRPOConfig(vllm_importance_sampling_correction=True)` (truncated IS on pi_old/mu) and check "
               "vLLM samples with the trainer's `temperature`, top-p and dtype (`cast_lm_head_to_fp32`).",
        "verl": "Keep `actor_rollout_ref.rollout.calculate_log_probs=True` and set "
                "`algorithm.rollout_correction.rollout_is=token` (`rollout_is_threshold=2.0`); check "
                "`rollout.logprobs_mode` and the rollout dtype.",
        "slime": "Add `--use-tis` (or a `--custom-tis-function-path` such as icepop) and `--get-mismatch-metrics`; "
                 "check the SGLang dtype and temperature.",
        "openrlhf": "Turn on `--algo.advantage.is_correction_enable` (`_type icepop` or `tis`).",
        "nemo_rl": "NeMo-RL flags token_mult_prob_error > 1.05: check the generation backend's dtype and "
                   "temperature; enable its TIS correction.",
        "plain": "The inference engine and the trainer disagree on the sampled tokens' log-probs: match "
                 "temperature, top-p, dtype and kernels, and correct with truncated importance sampling.",
    },
    "numerical_fault": {
        "trl": "Train in bf16 (`bf16=True`, not fp16), keep `cast_lm_head_to_fp32=True`, and check that "
               "no sampled token is masked to -inf by the logits processing.",
        "verl": "Check `actor_rollout_ref.rollout.logprobs_mode`, fp16 overflow in the actor, and -inf masking "
                "of sampled tokens (verl issues #751, #891: NaN in low_var_kl).",
        "slime": "Check fp16 overflow, -inf masking of sampled tokens, and the rollout/train temperature.",
        "openrlhf": "Check fp16 overflow, -inf masking of sampled tokens, and the sampling temperature.",
        "nemo_rl": "Check fp16 overflow, -inf masking of sampled tokens, and the generation temperature.",
        "plain": "Look for fp16 overflow, -inf masking of sampled tokens, and log-softmax applied twice or to "
                 "temperature-scaled logits.",
    },
    "entropy_collapse": {
        "trl": "Raise the upper clip `epsilon_high` (DAPO's clip-higher, e.g. 0.28) or the sampling "
               "`temperature`; lower `beta` if the reference pins the policy.",
        "verl": "Raise `actor_rollout_ref.actor.clip_ratio_high` (e.g. 0.28), add `actor.entropy_coeff`, or use "
                "`actor.policy_loss.loss_mode=clip_cov`/`kl_cov`.",
        "slime": "Raise `--eps-clip-high` (e.g. 0.28) or add `--entropy-coef`.",
        "openrlhf": "Add `--actor.entropy_coef`, or raise the sampling temperature.",
        "nemo_rl": "Raise the upper clip ratio or the generation temperature.",
        "plain": "Clip-higher (an asymmetric PPO clip, DAPO), an entropy bonus, or a higher sampling temperature.",
    },
}


def family(manifest) -> str:
    """The trainer family of a run from its manifest's trainer name ("plain" when unknown)."""
    name = str((getattr(manifest, "trainer", None) or {}).get("name") or "").lower().replace("-", "_")
    for f in FAMILIES[:-1]:
        if name == f or name.startswith(f + ".") or name.startswith(f + "_") or (f == "nemo_rl" and "nemo" in name):
            return f
    return "plain"


def fix_for(cause: str, manifest) -> str:
    """The fix for `cause` phrased for the run's trainer; plain-torch advice otherwise."""
    table = FIXES.get(cause, {})
    return table.get(family(manifest)) or table.get("plain", "")
