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

# When the run's manifest already has what a fix sets (kldiag.frameworks.SETTINGS): the fix to give instead.
IF_SET = {
    "entropy_collapse": ("clip_higher", (
        "The upper clip is already {clip_high:g} (DAPO's clip-higher): add an entropy bonus (a small coefficient "
        'times the mean token entropy) or sample at a higher temperature.')),
    "engine_mismatch": ("engine_is", (
        "The run already corrects the mismatch with importance sampling: remove it at its source (match temperature, "
        'top-p, dtype and kernels between the engine and the trainer), and mask rather than truncate outliers.')),
}
