"""NeMo-RL: the options kldiag names in its fixes.

Checked in NeMo-RL `nemo_rl/algorithms/loss/loss_functions.py` (loss_fn.* keys).
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
        "NeMo-RL flags token_mult_prob_error > 1.05: check the generation backend's dtype and temperature; enable "
        'its TIS correction.'),
    "numerical_fault": (
        'Check fp16 overflow, -inf masking of sampled tokens, and the generation temperature.'),
    "entropy_collapse": (
        'Raise the upper clip ratio or the generation temperature.'),
}
