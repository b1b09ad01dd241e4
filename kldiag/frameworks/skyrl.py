"""SkyRL: the options kldiag names in its fixes.

Checked in skyrl 0.4.0 (PyPI wheel), `skyrl/train/config/config.py`: `trainer.algorithm.kl_estimator_type`
(k1/abs/k2/k3; `compute_approx_kl` in `skyrl/backends/skyrl_train/utils/ppo_utils.py` clamps k3 to +-10),
`trainer.algorithm.use_kl_loss` / `use_kl_in_reward` / `kl_loss_coef`, `trainer.algorithm.eps_clip_low` /
`eps_clip_high`, `trainer.algorithm.use_entropy_loss` / `entropy_loss_coef`,
`trainer.algorithm.off_policy_correction.tis_ratio_type` / `token_tis_ratio_clip_high` /
`token_mask_is_threshold_low` / `token_mask_is_threshold_high`, `trainer.update_epochs_per_batch`,
`generator.sampling_params.temperature`.
"""

from __future__ import annotations

SUPPORTED = "==0.4.0"  # kldiag.integrations.skyrl; keep in step with the Makefile's install
# trainer.algorithm.kl_estimator_type -> the estimator kldiag records (k3's value is clamped at +-10)
ESTIMATOR_OF = {"k1": "k1", "k2": "k2", "k3": "k3_clamped"}
OPC = "trainer.algorithm.off_policy_correction."

FIXES = {
    "k3_weight_blowup": (
        'Set `trainer.algorithm.kl_estimator_type=k2` (its gradient grows like the log ratio, not its exponential).'),
    "clamp_dead_zone": (
        'SkyRL clamps k3 to +-10: `trainer.algorithm.kl_estimator_type=k2` keeps a gradient for far more tokens.'),
    "offpolicy_drift": (
        'Fewer updates per rollout: lower `trainer.update_epochs_per_batch` or raise '
        '`trainer.policy_mini_batch_size`.'),
    "engine_mismatch": (
        f'Turn on the train/rollout correction: `{OPC}tis_ratio_type=token` with `{OPC}token_tis_ratio_clip_high=2.0`, '
        f'or mask outliers with `{OPC}token_mask_is_threshold_low` / `{OPC}token_mask_is_threshold_high`; check the '
        'vLLM dtype.'),
    "entropy_collapse": (
        "Raise the upper clip: `trainer.algorithm.eps_clip_high=0.28` (DAPO's clip-higher), set "
        '`trainer.algorithm.use_entropy_loss=true`, or raise `generator.sampling_params.temperature`.'),
}
