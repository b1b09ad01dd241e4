"""OpenRLHF: the options kldiag names in its fixes.

Checked in OpenRLHF 0.11.2 (`--algo.kl.estimator`, `--actor.entropy_coef`).
"""

from __future__ import annotations

FIXES = {
    "k3_weight_blowup": (
        'Use `--algo.kl.estimator k2` (gradient log(pi_theta/pi_ref), bounded by a log).'),
    "clamp_dead_zone": (
        'OpenRLHF clamps every estimator to +-10: `--algo.kl.estimator k2` keeps a gradient for far more tokens (k2 '
        '> 10 needs |log ratio| > 4.5).'),
    "offpolicy_drift": (
        'Turn on `--algo.advantage.is_correction_enable` (TIS/icepop); fewer epochs per rollout.'),
    "engine_mismatch": (
        'Turn on `--algo.advantage.is_correction_enable` (`_type icepop` or `tis`).'),
    "numerical_fault": (
        'Check fp16 overflow, -inf masking of sampled tokens, and the sampling temperature.'),
    "entropy_collapse": (
        'Add `--actor.entropy_coef`, or raise the sampling temperature.'),
}
