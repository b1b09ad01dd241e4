"""OpenRLHF: the options kldiag names in its fixes.

Checked in OpenRLHF 0.11.2 (PyPI wheel), `openrlhf/cli/train_ppo_ray.py`'s argument parser:
`--algo.kl.estimator` (k1/k2/k3), `--algo.kl.unbiased_gradient` (keeps the estimator's value, backprops the
IS-weighted k1 gradient through `openrlhf/models/utils.py` `compute_approx_kl`, past its +-10 clamp),
`--algo.advantage.is_correction_level` (off/token/seq), `_mode` (mask/clip), `_threshold`,
`--actor.eps_clip_low_high`, `--actor.entropy_coef`, `--actor.dual_clip`, `--train.max_epochs`,
`--rollout.temperature` (the actor divides its logits by it, `openrlhf/models/actor.py`).
tests/test_frameworks.py checks every flag against that parser's source.
"""

from __future__ import annotations

SUPPORTED = "==0.11.2"  # kldiag.integrations.openrlhf; keep in step with the Makefile's install
# --algo.kl.estimator -> the estimator kldiag records; compute_approx_kl clamps every value to +-10
# (openrlhf/models/utils.py), which the manifest's kl_clamp says
ESTIMATOR_OF = {"k1": "k1", "k2": "k2", "k3": "k3_clamped"}

FIXES = {
    "k3_weight_blowup": (
        'Add `--algo.kl.unbiased_gradient` (keeps the K3 value, backprops rho * log(pi_theta/pi_ref), which grows '
        'like a log), or use `--algo.kl.estimator k2`.'),
    "clamp_dead_zone": (
        'OpenRLHF clamps every estimator to +-10: `--algo.kl.unbiased_gradient` backprops a gradient past the clamp; '
        '`--algo.kl.estimator k2` keeps one for far more tokens (k2 > 10 needs |log ratio| > 4.5).'),
    "offpolicy_drift": (
        'Fewer updates per rollout: lower `--train.max_epochs` (or raise `--train.batch_size` toward '
        '`--rollout.batch_size`); `--algo.kl.unbiased_gradient` keeps the KL gradient unbiased off-policy.'),
    "engine_mismatch": (
        'Turn on the train/rollout correction: `--algo.advantage.is_correction_level token` with '
        '`--algo.advantage.is_correction_mode clip` (TIS) or `mask` (ICEPOP), bounds '
        '`--algo.advantage.is_correction_threshold 0.5 5.0`; check the vLLM dtype.'),
    "numerical_fault": (
        'Check fp16 overflow, -inf masking of sampled tokens, and the sampling temperature.'),
    "entropy_collapse": (
        "Raise the upper clip: `--actor.eps_clip_low_high 0.2 0.28` (DAPO's clip-higher), add "
        '`--actor.entropy_coef`, or raise `--rollout.temperature`.'),
    "engine_temperature_mismatch": (
        'OpenRLHF divides the actor\'s logits by `--rollout.temperature` and samples with it: make sure no other '
        'temperature or logits processor reaches vLLM, and that its log-probs are the processed ones.'),
    "engine_raw_logprobs": (
        'The actor divides its logits by `--rollout.temperature`, but the vLLM log-probs are pre-temperature: make '
        'vLLM return processed log-probs; until then leave `--algo.advantage.is_correction_level off`.'),
    "engine_wrong_token": (
        'The vLLM log-probs are off by one position against the response tokens: align them; until then leave '
        '`--algo.advantage.is_correction_level off`.'),
    "engine_precision": (
        'vLLM and the actor differ in precision (`--ds.param_dtype`): match them where you can and keep '
        '`--algo.advantage.is_correction_level token` with `--algo.advantage.is_correction_mode mask`.'),
    "engine_stale_weights": (
        'vLLM does not get the new weights at every step: check the weight broadcast (`--vllm.sync_backend`, '
        '`--vllm.sync_with_ray`), and keep `--algo.advantage.is_correction_level token` meanwhile.'),
    "engine_async_lag": (
        'With `--train.async_enable` rollouts come from an older policy: lower `--train.async_queue_size`, and keep '
        '`--algo.advantage.is_correction_level token`.'),
}

# When the run's manifest already has what a fix sets (kldiag.frameworks.SETTINGS): the fix to give instead.
IF_SET = {
    "entropy_collapse": ("clip_higher", (
        'The upper clip is already {clip_high:g} (DAPO\'s clip-higher): add `--actor.entropy_coef` (e.g. 0.001) or '
        'raise `--rollout.temperature`.')),
    "engine_mismatch": ("engine_is", (
        'The train/rollout correction is already on: narrow `--algo.advantage.is_correction_threshold` or use '
        '`--algo.advantage.is_correction_level seq`, and remove the mismatch at its source (vLLM dtype, '
        '`--rollout.temperature`).')),
}
