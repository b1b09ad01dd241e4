"""AReaL: the options kldiag names in its fixes.

Checked in areal 1.0.4 (PyPI wheel), `areal/api/cli_args.py`: `actor.kl_ctl` / `actor.kl_estimator` (k1/k2/k3, in
the reward only; `KLEstimator` in `areal/utils/data.py` clamps to +-10), `actor.eps_clip` / `actor.eps_clip_higher`,
`actor.recompute_logprob`, `actor.use_decoupled_loss`, `actor.rejection_sampling.{level,action,metric,agg,upper,
lower}`, `actor.ppo_n_minibatches`, `gconfig.temperature`.
"""

from __future__ import annotations

SUPPORTED = "==1.0.4"  # kldiag.integrations.areal; keep in step with the Makefile's install
ESTIMATOR_OF = {"k1": "k1", "k2": "k2", "k3": "k3_clamped"}

FIXES = {
    "k3_weight_blowup": (
        'AReaL puts the KL in the reward: use `actor.kl_estimator=k1` or `k2`, or lower `actor.kl_ctl`.'),
    "offpolicy_drift": (
        'Turn on `actor.use_decoupled_loss=true` with `actor.recompute_logprob=true`, and bound the staleness with '
        '`actor.rejection_sampling.upper` (e.g. 2.0).'),
    "engine_mismatch": (
        'Set `actor.recompute_logprob=true` and `actor.use_decoupled_loss=true` with '
        '`actor.rejection_sampling.level=token` (`actor.rejection_sampling.action=mask`, '
        '`actor.rejection_sampling.upper=2.0`); check the engine dtype.'),
    "entropy_collapse": (
        "Raise the upper clip: `actor.eps_clip_higher=0.28` (DAPO's clip-higher), or raise `gconfig.temperature`."),
}
