"""verl: its KL penalty and loss aggregation, the estimator names its hook records, its fixes.

Checked in verl 0.9.1 (PyPI wheel): `verl/trainer/ppo/core_algos.py` (`kl_penalty`, `agg_loss`),
`verl/workers/utils/losses.py` (`ppo_loss`); option names in verl-project/verl@1dda039b
(`actor_rollout_ref.actor.kl_loss_type` incl. `k3+`, `algorithm.rollout_correction.*` in
docs/algo/rollout_corr.md, `actor.ppo_epochs`, `actor.clip_ratio_high`, `actor.entropy_coeff`,
`rollout.calculate_log_probs`, `rollout.logprobs_mode`); tests/test_frameworks.py checks every dotted key
of FIXES and IF_SET against verl 0.9.1's `verl/trainer/config/_generated_ppo_trainer.yaml`.
"""

from __future__ import annotations

import numpy as np

SUPPORTED = ">=0.9,<0.10"  # keep in step with the Makefile's `pip install --no-deps verl==0.9.1`
# kl_loss_type -> the estimator kldiag records (low_var_kl is K3 clamped at 10)
ESTIMATOR_OF = {"low_var_kl": "k3_clamped", "k3": "k3_clamped", "kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2"}
MICRO_SLOTS = 1024  # the verl hook writes micro = mini-batch * MICRO_SLOTS + micro-batch
MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean")


def agg_loss(loss_mat: np.ndarray, mask: np.ndarray, mode: str, dp_size: int = 1,
             batch_num_tokens: float | None = None, global_batch_size: float | None = None,
             loss_scale_factor: float | None = None) -> float:
    """core_algos.py `agg_loss` with verl's global batch info; loss_mat, mask [B, T], float64 inside."""
    x = np.where(mask, np.asarray(loss_mat, np.float64), 0.0)
    if mode == "token-mean":
        n = mask.sum() if batch_num_tokens is None else batch_num_tokens
        return float(x.sum() / n * dp_size)
    if mode == "token-sum":
        return float(x.sum() * dp_size)
    seq_mask = mask.sum(-1) > 0
    n_seq = seq_mask.sum() if global_batch_size is None else global_batch_size
    if mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        loss = float(x.sum(-1)[seq_mask].sum() / n_seq * dp_size)
        if mode.endswith("-norm"):
            loss /= loss_scale_factor if loss_scale_factor is not None else mask.shape[-1]
        return loss
    if mode == "seq-mean-token-mean":
        seq = x.sum(-1) / (mask.sum(-1) + 1e-8)
        return float(seq[seq_mask].sum() / n_seq * dp_size)
    raise ValueError(f"loss_agg_mode={mode!r}: use one of {', '.join(MODES)} (verl actor.loss_agg_mode)")


def dead_zone(logp: np.ndarray, logp_ref: np.ndarray) -> np.ndarray:
    """bool: tokens whose low_var_kl gradient is zero (log-ratio clamped at +-20, or value clamped at 10)."""
    d = np.asarray(logp_ref, np.float64) - np.asarray(logp, np.float64)
    kl = np.clip(d, -20.0, 20.0)
    with np.errstate(over="ignore"):
        kld = np.exp(kl) - kl - 1.0
    return (d < -20.0) | (d > 20.0) | (kld > 10.0)


def kl_penalty(logp: np.ndarray, ref: np.ndarray, kl_type: str) -> np.ndarray:
    """core_algos.py `kl_penalty` forward value (a '+' suffix changes only the gradient)."""
    base = kl_type[:-1] if kl_type.endswith("+") else kl_type
    if base in ("kl", "k1"):
        return logp - ref
    if base == "abs":
        return np.abs(logp - ref)
    if base in ("mse", "k2"):
        return 0.5 * (logp - ref) ** 2
    if base in ("low_var_kl", "k3"):
        kl = np.clip(ref - logp, -20.0, 20.0)
        return np.clip(np.exp(kl) - kl - 1, -10.0, 10.0)
    raise ValueError(f"kl_loss_type={kl_type!r}: use kl/k1, abs, mse/k2, low_var_kl/k3 (with an optional '+')")


ACTOR = "actor_rollout_ref.actor."  # verl config prefixes (keys checked against verl 0.9.1's trainer config)
ROLLOUT = "actor_rollout_ref.rollout."
CORR = "algorithm.rollout_correction."
FIXES = {
    "k3_weight_blowup": (
        f"verl has no unbiased KL: set `{ACTOR}kl_loss_type=k3+` (K3 value, K2's bounded gradient; verl PR #2953) "
        f"or `{ACTOR}kl_loss_type=k2`."),
    "clamp_dead_zone": (
        f"The K3 clamp at 10 zeroes these tokens' KL gradient: use `{ACTOR}kl_loss_type=k3+` or "
        f"`{ACTOR}kl_loss_type=k2` (no clamp on the gradient)."),
    "offpolicy_drift": (
        f"Lower `{ACTOR}ppo_epochs` (or the mini-batch count: raise `{ACTOR}ppo_mini_batch_size`), and turn on "
        f"`{CORR}rollout_is=token` with `{CORR}rollout_rs` (verl docs: rollout_corr.md)."),
    "engine_mismatch": (
        f"Keep `{ROLLOUT}calculate_log_probs=True` and set `{CORR}rollout_is=token` "
        f"(`{CORR}rollout_is_threshold=2.0`); check `{ROLLOUT}logprobs_mode` and the rollout dtype "
        f"(`{ROLLOUT}dtype`)."),
    "numerical_fault": (
        f"Check `{ROLLOUT}logprobs_mode`, fp16 overflow in the actor, and -inf masking of sampled tokens "
        "(verl issues #751, #891: NaN in low_var_kl)."),
    "entropy_collapse": (
        f"Raise `{ACTOR}clip_ratio_high` (e.g. 0.28), add `{ACTOR}entropy_coeff`, or use "
        f"`{ACTOR}policy_loss.loss_mode=clip_cov` or `kl_cov`."),
    "engine_temperature_mismatch": (
        f"Set the same `{ROLLOUT}temperature` for sampling and for the actor's log-prob recompute, and keep "
        f"`{ROLLOUT}logprobs_mode=processed_logprobs` (the default; raw_logprobs are pre-temperature)."),
    "engine_raw_logprobs": (
        f"Set `{ROLLOUT}logprobs_mode=processed_logprobs` (raw_logprobs are pre-temperature) and keep the actor's "
        f"recompute at the same `{ROLLOUT}temperature`; until then keep `{CORR}rollout_is=null`."),
    "engine_wrong_token": (
        f"The rollout log-probs are off by one position against the response ids (a custom server or agent loop, "
        f"`{ROLLOUT}agent.custom_async_server`): align them; until then set `{ROLLOUT}calculate_log_probs=False` "
        f"and `{CORR}rollout_is=null`."),
    "engine_precision": (
        f"The rollout computes in `{ROLLOUT}dtype` (bfloat16) against the actor's "
        f"`{ACTOR}fsdp_config.model_dtype`: match them where you can, and correct the rest with "
        f"`{CORR}rollout_is=token` (`{CORR}rollout_is_threshold=2.0`)."),
    "engine_stale_weights": (
        f"The rollout gets the actor's weights only every few steps: check the weight sync "
        f"(`{ROLLOUT}checkpoint_engine.backend`; with `{ROLLOUT}load_format=dummy` a failed sync leaves dummy or old "
        f"weights), and correct with `{CORR}rollout_is=token` meanwhile."),
    "engine_async_lag": (
        f"Rollouts come from an older policy (asynchronous rollouts): bound the staleness and correct it with "
        f"`{CORR}rollout_is=token` and `{CORR}rollout_rs` (verl docs: rollout_corr.md)."),
}

# When the run's manifest already has what a fix sets (kldiag.frameworks.SETTINGS): the fix to give instead.
IF_SET = {
    "entropy_collapse": ("clip_higher", (
        f"The upper clip is already `{ACTOR}clip_ratio_high={{clip_high:g}}` (DAPO's clip-higher): add "
        f"`{ACTOR}entropy_coeff` (e.g. 0.001), use `{ACTOR}policy_loss.loss_mode=clip_cov` or `kl_cov`, or raise "
        f"`{ROLLOUT}temperature`.")),
    "engine_mismatch": ("engine_is", (
        f"`{CORR}rollout_is` is already on: lower `{CORR}rollout_is_threshold` or add `{CORR}rollout_rs` "
        f"(rejection), and remove the mismatch at its source: `{ROLLOUT}logprobs_mode`, the rollout dtype "
        f"(`{ROLLOUT}dtype`).")),
}

# MoE routing (kldiag/diagnosis/routing.py): R3 in verl-project/verl@1dda039b (`EngineRouterReplayConfig`,
# verl/workers/config/engine.py; the megatron key is in verl 0.9.1's _generated_ppo_megatron_trainer.yaml).
R3 = f"`{ACTOR}megatron.router_replay.mode=R3` with `{ROLLOUT}enable_rollout_routing_replay=True`"
FIXES["moe_routing_mismatch"] = (
    f"The rollout routes tokens to other experts than the actor: turn on rollout routing replay, {R3} (vLLM >= "
    f"0.22 or SGLang; the VeOmni engine has the same mode under its own router_replay), and keep "
    f"`{CORR}rollout_is=token` for the rest.")
FIXES["routing_replay_broken"] = (
    f"Routing replay is configured ({R3}) but the actor does not route as the rollout did: check that the batch's "
    "routed_experts key covers every response token (verl pads the tail with zeros and masks the last row out), that "
    f"`{ACTOR}megatron.router_replay.mode` is R3 and not R2 in the update, and that every MoE layer's router is "
    "patched.")

# parity contracts and the learning signal (keys of verl 0.9.1's _generated_ppo_trainer.yaml)
FIXES["batch_variance"] = (
    f"Set `{ROLLOUT}log_prob_micro_batch_size_per_gpu` equal to `{ACTOR}ppo_micro_batch_size_per_gpu` (or "
    f"`{ACTOR}use_dynamic_bsz` on for both, the same token budget): the old-log-prob recompute and the update "
    "must see the same micro-batches (verl issue #6280).")
FIXES["kl_dominated_signal"] = (
    "Turn on dynamic sampling, `algorithm.filter_groups.enable=True` (with its metric, e.g. acc), so groups with "
    f"all-equal rewards are dropped and resampled, or lower `{ACTOR}kl_loss_coef`.")
