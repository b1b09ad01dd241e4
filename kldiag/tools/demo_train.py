"""The demo's GRPO training: a tiny autoregressive policy, plain torch, CPU, seconds.

The task is built so that DeepSeek-V3.2 section 3.1 happens for real:

- a prompt is a topic (`<cat>`, `<sea>`, ...); a completion is `length` words sampled token
  by token; the reward of a completion is the mean over its words of +1 (a word of the
  prompt's topic), 0 (another topic's word) or -1 (a filler: " um", " like", ...);
- the reference policy (the "SFT model", the initial policy frozen) *likes* the fillers:
  its output bias gives each filler `ref_filler_boost` nats more than a word;
- rollouts come from a behaviour policy as real trainers have one: a copy of the policy
  that lags `lag` steps, run by an "engine" that samples at another temperature
  (`sampler_temperature`); the engine's own log-probs are recorded as logp_sampler, the
  trainer's recompute of the lagging copy as logp_old;
- the loss is GRPO's: group-relative advantages, a PPO-clipped surrogate on
  rho = pi_theta/pi_old, plus beta times a KL estimator against the reference, either
  K3 (Schulman 2020) or the corrected k3_is = rho * k3 (DeepSeek-V3.2 eq. 7, rho
  differentiable).

The reward pushes fillers far below the reference; the stale, hotter sampler keeps
sampling them; K3's gradient weight on each such token is 1 - pi_ref/pi_theta (unbounded)
while k3_is's is rho * log(pi_theta/pi_ref) (DeepSeek-V3.2 eq. 9). torch is imported
inside the functions: this module is only imported when a demo runs.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

TOPICS = ("cat", "sea", "sun", "tree")
WORDS = (
    " purr", " whisker", " paw",
    " wave", " tide", " salt",
    " light", " warm", " dawn",
    " leaf", " root", " bark",
)
FILLERS = (" um", " like", " basically", " actually")


@dataclass(frozen=True)
class DemoConfig:
    """Every knob of the demo training. Defaults: the committed sample runs."""

    estimator: str = "k3"  # KL loss: "k3" (Schulman) or "k3_is" (DeepSeek-V3.2 eq. 7)
    steps: int = 200
    prompts_per_step: int = 8
    group_size: int = 8  # completions per prompt (GRPO group)
    length: int = 8  # tokens per completion
    hidden: int = 128
    lr: float = 2e-2  # Adam
    beta: float = 0.04  # KL coefficient (DeepSeekMath GRPO)
    clip_range: tuple[float, float] = (0.2, 0.2)  # PPO clip of rho: [1 - low, 1 + high]
    lag: int = 4  # the behaviour policy is the policy of `lag` steps ago
    sampler_temperature: float = 1.2  # engine temperature; the trainer assumes 1
    ref_filler_boost: float = 2.0  # nats the reference prefers each filler over a word
    max_grad_norm: float | None = 1.0  # clip the gradient norm (TRL's default is 1.0)
    seed: int = 0
    threads: int = 1  # torch threads: the matrices are tiny, more threads only add overhead
    pieces: tuple[str, ...] | None = None  # override the vocabulary text (tests)


@dataclass
class StepStats:
    """One training step, as the demo prints and tests it."""

    step: int
    reward: float  # mean reward of the step's completions
    p_punished: float  # pi_theta's total mass on the fillers, mean over sampled contexts
    sampled_punished: float  # fraction of sampled tokens that are fillers
    grad_norm: float


@dataclass
class TrainResult:
    config: DemoConfig
    history: list[StepStats] = field(default_factory=list)
    seconds: float = 0.0


def vocab(cfg: DemoConfig | None = None) -> list[str]:
    """Token id -> text: topic prompts first, then words, then fillers."""
    default = [f"<{t}>" for t in TOPICS] + list(WORDS) + list(FILLERS)
    if cfg is None or cfg.pieces is None:
        return default
    if len(cfg.pieces) != len(default):
        raise ValueError(f"pieces must have {len(default)} entries (topics, words, fillers), got {len(cfg.pieces)}")
    return list(cfg.pieces)


N_PROMPT = len(TOPICS)
N_OUT = len(WORDS) + len(FILLERS)  # the policy's output space: words and fillers
FILLER_IDS = np.arange(len(WORDS), N_OUT)  # output indices of the fillers


def token_scores() -> np.ndarray:
    """[N_PROMPT, N_OUT] reward of emitting each output token after each prompt."""
    scores = np.zeros((N_PROMPT, N_OUT))
    per_topic = len(WORDS) // N_PROMPT
    for t in range(N_PROMPT):
        scores[t, t * per_topic:(t + 1) * per_topic] = 1.0
    scores[:, FILLER_IDS] = -1.0
    return scores


# ---- the policy: functional, so that torch stays a lazy import -------------------------


def init_params(cfg: DemoConfig, gen) -> dict[str, Any]:
    """Embeddings of prompt, position and previous token, a 2-layer MLP, output logits.

    The output bias gives each filler `ref_filler_boost` nats: the initial policy, frozen
    as the reference, likes them.
    """
    import torch

    h = cfg.hidden

    def rand(*shape, scale):
        return (torch.randn(*shape, generator=gen, dtype=torch.float32) * scale).requires_grad_()

    bias = torch.zeros(N_OUT)
    bias[torch.as_tensor(FILLER_IDS)] = cfg.ref_filler_boost
    return {
        "prompt": rand(N_PROMPT, h, scale=0.5),
        "pos": rand(cfg.length, h, scale=0.5),
        "prev": rand(N_OUT + 1, h, scale=0.5),  # last row: "no previous token"
        "w1": rand(h, h, scale=h ** -0.5),
        "b1": torch.zeros(h, requires_grad=True),
        "w2": rand(h, N_OUT, scale=0.1 * h ** -0.5),
        "b2": bias.requires_grad_(),
    }


def logits_at(params: dict[str, Any], prompts, prev, pos: int):
    """Logits [B, N_OUT] of the next token given prompt [B], previous token [B] at `pos`."""
    import torch

    x = params["prompt"][prompts] + params["pos"][pos] + params["prev"][prev]
    return torch.tanh(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]


def all_logits(params: dict[str, Any], prompts, tokens):
    """Teacher-forced logits [B, T, N_OUT] of completions `tokens` [B, T] (output indices)."""
    import torch

    b, t = tokens.shape
    prev = torch.cat([torch.full((b, 1), N_OUT, dtype=torch.long), tokens[:, :-1]], dim=1)
    x = params["prompt"][prompts][:, None, :] + params["pos"][None, :t, :] + params["prev"][prev]
    return torch.tanh(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]


def token_logp(logits, tokens):
    """log softmax(logits) gathered at `tokens`: [B, T]."""
    import torch

    return torch.log_softmax(logits, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)


def engine_sample(params: dict[str, Any], prompts, length: int, temperature: float, gen):
    """The inference engine: samples `length` tokens at `temperature`; returns tokens and
    the engine's log-probs of them (logp_sampler), both [B, length]."""
    import torch

    b = prompts.shape[0]
    prev = torch.full((b,), N_OUT, dtype=torch.long)
    tokens, logps = [], []
    with torch.no_grad():
        for pos in range(length):
            logp = torch.log_softmax(logits_at(params, prompts, prev, pos) / temperature, dim=-1)
            prev = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(-1)
            tokens.append(prev)
            logps.append(logp.gather(-1, prev[:, None]).squeeze(-1))
    return torch.stack(tokens, 1), torch.stack(logps, 1)


# ---- GRPO pieces -----------------------------------------------------------------------


def group_advantages(rewards, group_size: int, eps: float = 1e-4):
    """GRPO: (r - mean of its group) / (std of its group + eps); rewards [B] grouped in order."""
    r = rewards.view(-1, group_size)
    adv = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps)
    return adv.reshape(-1)


def kl_loss(estimator: str, logp, logp_ref, logp_old):
    """Per-token KL loss [B, T] with the gradient flowing through logp.

    k3 = exp(d) - d - 1, d = logp_ref - logp (Schulman 2020): weight 1 - exp(d).
    k3_is = rho * k3, rho = exp(logp - logp_old) differentiable (DeepSeek-V3.2 eq. 7):
    weight rho * (logp - logp_ref) (eq. 9). Same maths as kldiag.estimators, in torch.
    """
    import torch

    d = logp_ref - logp
    k3 = torch.expm1(d) - d
    if estimator == "k3":
        return k3
    if estimator == "k3_is":
        return torch.exp(logp - logp_old) * k3
    raise ValueError(f"the demo trains with estimator 'k3' or 'k3_is', not {estimator!r}")


def ppo_surrogate(logp, logp_old, advantages, clip_range: tuple[float, float]):
    """Per-token PPO-clipped policy loss [B, T]: -min(rho A, clip(rho) A)."""
    import torch

    rho = torch.exp(logp - logp_old)
    adv = advantages[:, None]
    clipped = torch.clamp(rho, 1.0 - clip_range[0], 1.0 + clip_range[1])
    return -torch.minimum(rho * adv, clipped * adv)


def _snapshot(params: dict[str, Any]) -> dict[str, Any]:
    return {k: v.detach().clone() for k, v in params.items()}


def _ids(step: int, cfg: DemoConfig):
    """Sequence ids unique in the run and group ids, both [B]."""
    import torch

    b = cfg.prompts_per_step * cfg.group_size
    seq = step * b + torch.arange(b)
    group = step * cfg.prompts_per_step + torch.arange(cfg.prompts_per_step).repeat_interleave(cfg.group_size)
    return seq, group


def train(cfg: DemoConfig, record: Callable[..., None] | None = None,
          progress: Callable[[StepStats], None] | None = None) -> TrainResult:
    """Run the GRPO training; `record(**tensors)` gets each step's per-token evidence with
    the keywords of `kldiag.Recorder.record`. Deterministic given `cfg.seed`."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        return _train(cfg, record, progress)
    finally:
        torch.set_num_threads(threads)  # the caller's process keeps its own setting


def _train(cfg: DemoConfig, record, progress) -> TrainResult:
    import torch

    gen = torch.Generator().manual_seed(cfg.seed)
    params = init_params(cfg, gen)
    ref = _snapshot(params)
    history = deque([_snapshot(params)], maxlen=cfg.lag + 1)  # history[0]: `lag` steps ago
    opt = torch.optim.Adam(list(params.values()), lr=cfg.lr)
    scores = torch.as_tensor(token_scores(), dtype=torch.float32)
    fillers = torch.as_tensor(FILLER_IDS)
    result, start = TrainResult(cfg), time.perf_counter()
    for step in range(cfg.steps):
        behaviour = history[0]
        prompts = torch.randint(N_PROMPT, (cfg.prompts_per_step,), generator=gen).repeat_interleave(cfg.group_size)
        tokens, logp_sampler = engine_sample(behaviour, prompts, cfg.length, cfg.sampler_temperature, gen)
        rewards = scores[prompts[:, None], tokens].mean(1)
        advantages = group_advantages(rewards, cfg.group_size)
        with torch.no_grad():
            logp_old = token_logp(all_logits(behaviour, prompts, tokens), tokens)
            logp_ref = token_logp(all_logits(ref, prompts, tokens), tokens)
        logits = all_logits(params, prompts, tokens)
        logp = token_logp(logits, tokens)
        loss = (ppo_surrogate(logp, logp_old, advantages, cfg.clip_range)
                + cfg.beta * kl_loss(cfg.estimator, logp, logp_ref, logp_old)).mean()
        opt.zero_grad()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(list(params.values()), cfg.max_grad_norm or float("inf"))
        opt.step()
        history.append(_snapshot(params))
        if record is not None:
            seq, group = _ids(step, cfg)
            record(step=step, logp=logp.detach(), logp_old=logp_old, logp_ref=logp_ref,
                   logp_sampler=logp_sampler, advantages=advantages, mask=torch.ones_like(tokens, dtype=torch.bool),
                   token_ids=tokens + N_PROMPT, seq_ids=seq, group_ids=group)
        with torch.no_grad():
            p_fill = torch.softmax(logits, -1)[..., fillers].sum(-1).mean()
        stats = StepStats(step, float(rewards.mean()), float(p_fill),
                          float(torch.isin(tokens, fillers).float().mean()), float(grad_norm))
        result.history.append(stats)
        if progress is not None:
            progress(stats)
    result.seconds = time.perf_counter() - start
    return result


def run_config(cfg: DemoConfig) -> dict[str, Any]:
    """What the demo writes to the run manifest's `config` (the analysis reads beta,
    estimator and clip_range from there)."""
    d = {k: v for k, v in vars(cfg).items() if k != "pieces"}
    d["clip_range"] = list(cfg.clip_range)
    return d
