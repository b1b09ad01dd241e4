"""A plain torch loop (no known trainer): the fixes in the terms of the maths."""

from __future__ import annotations

FIXES = {
    "async_staleness": (
        "Bound the staleness of the samples you train on (drop those more than a few weight versions old), or "
        "correct them: a truncated importance weight on pi_theta/pi_old per token and the off-policy sequence mask."),
    "k3_weight_blowup": (
        'Multiply the K3 term by rho = exp(logp - logp_old) without detaching it (DeepSeek-V3.2 eq. 7), or use K2 = '
        '0.5 * (logp - logp_ref)**2 as the loss.'),
    "clamp_dead_zone": (
        'Remove the clamp on K3 (it zeroes the gradient exactly where pi_theta << pi_ref) and use rho * K3 or K2 '
        'instead.'),
    "offpolicy_drift": (
        "Update fewer times on each batch of samples, clip or mask importance ratios (truncated IS, DeepSeek-V3.2's "
        'sequence mask).'),
    "engine_mismatch": (
        "The inference engine and the trainer disagree on the sampled tokens' log-probs: match temperature, top-p, "
        'dtype and kernels, and correct with truncated importance sampling.'),
    "numerical_fault": (
        'Look for fp16 overflow, -inf masking of sampled tokens, and log-softmax applied twice or to '
        'temperature-scaled logits.'),
    "entropy_collapse": (
        "Clip-higher (an asymmetric PPO clip, DAPO's upper epsilon 0.28), an entropy bonus, or a higher sampling "
        'temperature.'),
    "engine_temperature_mismatch": (
        "The engine samples at temperature {t:.3g} while the trainer scores at 1: divide the trainer's logits by the "
        "sampling temperature (or sample at 1), and record the engine's processed (post-temperature) log-probs, not "
        'the raw ones.'),
    "engine_raw_logprobs": (
        "The engine samples at temperature {t:.3g} but returns pre-temperature (raw) log-probs: return the log-probs "
        "of the distribution it samples from, log_softmax(logits / T), and score at T in the trainer; until then "
        'importance weights against them are biased.'),
    "engine_wrong_token": (
        "The engine's log-probs are off by one position against the completion's token ids (logits and ids "
        "gathered with a shift, or a prompt/completion boundary off by one): align them before any importance "
        'correction, which otherwise weights each token by its neighbour\'s probability.'),
    "engine_precision": (
        "The engine computes in another precision than the trainer (bf16 logits against fp32): compute the "
        "engine's last layer and log-softmax in fp32, or sample and train in the same dtype (fp16 in both removes "
        'most of bf16\'s rounding); correct what is left with truncated importance sampling.'),
    "engine_stale_weights": (
        "The engine gets the trainer's weights only every few steps (a weight sync that is skipped or fails in "
        "between): sync after every optimizer step and check that the engine's weights change, and correct "
        'with importance sampling on pi_old/mu until it does.'),
    "engine_async_lag": (
        "Rollouts come from the policy of several steps back (asynchronous generation): bound the staleness (a "
        "smaller rollout queue or maximum age), and correct it with truncated or masked importance sampling on "
        'pi_old/mu.'),
    "engine_retokenization": (
        "Feed the trainer the token ids the engine generated and saw (token-in-token-out): build each sequence by "
        "appending the engine's output ids and the tool reply's ids, never by decoding the conversation to text and "
        "tokenising it again (a re-tokenisation merges or splits pieces at turn boundaries, e.g. 'Hel'+'lo' -> "
        "'Hello', and a chat template may re-render or drop earlier turns)."),
}
from kldiag.frameworks.sampling import TRUNCATION_FIXES  # noqa: E402 - the truncation fix lives with the sampling keys

FIXES["engine_truncated_sampling"] = TRUNCATION_FIXES["plain"]
# The recorder's own trouble, the same under every trainer (kldiag.diagnosis.missing).
FIXES["data_missing"] = (
    "Restore the listed parts from a copy if one exists (kldiag never deletes or rewrites a part); look in the "
    "trainer's log around those steps for a full disk, a killed writer or a copy cut short, and at run.json's "
    "writer statistics (dropped_rows, lost_rows, write_errors): the recorder's default backpressure='block' never "
    "drops rows.")

# When the run's manifest already has what a fix sets (kldiag.frameworks.SETTINGS): the fix to give instead.
IF_SET = {
    "entropy_collapse": ("clip_higher", (
        "The upper clip is already {clip_high:g} (DAPO's clip-higher): add an entropy bonus (a small coefficient "
        'times the mean token entropy) or sample at a higher temperature.')),
    "engine_mismatch": ("engine_is", (
        "The run already corrects the mismatch with importance sampling: remove it at its source (match temperature, "
        'top-p, dtype and kernels between the engine and the trainer), and mask rather than truncate outliers.')),
}

# MoE routing (kldiag/diagnosis/routing.py). Rollout routing replay ("R3") per framework, read from their code:
# verl-project/verl@1dda039b, THUDM/slime@624b824a, radixark/miles@31f1ca96, NVIDIA-NeMo/RL@7ea279ab,
# NovaSky-AI/SkyRL@a9564572, PrimeIntellect-ai/prime-rl@559b4477, areal-project/AReaL@cbff54d6.
R3_KEYS = ("verl `actor_rollout_ref.actor.megatron.router_replay.mode=R3` with "
           "`actor_rollout_ref.rollout.enable_rollout_routing_replay=True`; slime and Miles "
           "`--use-rollout-routing-replay`; NeMo-RL `policy.router_replay.enabled=true`; SkyRL "
           "`trainer.policy.megatron_config.moe_enable_routing_replay=true` with "
           "`generator.inference_engine.enable_return_routed_experts=true`; prime-rl "
           "`trainer.enable_router_replay=true`; "
           "AReaL captures the routes (`rollout.return_routed_experts=true`) but replays none yet")
FIXES["moe_routing_mismatch"] = (
    "The engine routes tokens near a router tie to other experts than the trainer (a low-precision router): turn "
    "on rollout routing replay, the engine's routes forced in the trainer's routers (" + R3_KEYS + "), or compute "
    "the engine's router in fp32; correct what is left with truncated importance sampling.")
FIXES["routing_replay_broken"] = (
    "Routing replay is configured but the trainer does not route as the engine did: check that the engine returns "
    "its routes for every token the loss reads (prompt and completion, one row fewer than tokens), that they reach "
    "the trainer aligned with the tokens (padding and the missing last row), that every MoE layer's router is "
    "patched (a fused router bypasses replay) and that the replay stage is set for the forward and the backward "
    "(" + R3_KEYS + ").")

# parity contracts (kldiag/diagnosis/contract.py) and the learning signal (diagnosis/signal.py)
FIXES["parity_broken"] = (
    "The run promises bitwise-equal engine and trainer log-probs: find the first token off (the evidence names its "
    "step, sequence and position) and compare the two computation paths there: batch-invariant kernels on both "
    "sides, the same dtype of the logits and of the temperature division, the same attention backend and "
    "parallel layout. Until then correct with truncated importance sampling on pi_old/mu.")
FIXES["batch_variance"] = (
    "Compute pi_old with the same micro-batch size, padding and kernels as the update (or batch-invariant "
    "kernels): before the first optimizer step the two forward passes must agree, and a ratio that is not 1 "
    "on-policy makes the PPO clip act on noise.")
FIXES["kl_dominated_signal"] = (
    "Most prompt groups give every completion the same reward: filter or resample them (dynamic sampling, as "
    "DAPO), make the prompt set match the policy's level, or lower beta so the KL term does not pull the "
    "untrained tokens back toward the reference.")
