"""Tiny-model runs with one trainer/engine defect each: the known truth of the mismatch root causes.

    from kldiag.tools.mismatch_runs import RUNS, make_run
    make_run("runs/stale", RUNS["stale_sync"])   # trained and written with kldiag.Recorder in seconds
    # diagnose(kldiag.analyze("runs/stale")) should name RUNS["stale_sync"].expect, and nothing else

A real GRPO training of the demo's tiny autoregressive policy (kldiag/tools/demo_train.py: its model,
advantages, PPO surrogate and KL loss), plain torch on the CPU. At step t the trainer holds theta_t; an
"engine", the same torch model, samples the step's completions and returns their log-probs
(logp_sampler); the trainer recomputes them in float32 (logp_old), then takes one Adam step per
mini-batch, recording each mini-batch's logp before its update. The engine has one defect:

    none            the trainer's weights, float32, temperature 1 (healthy)
    temperature     samples softmax(z / T) and returns those (processed) log-probs; the trainer scores at 1
    raw_logprobs    samples softmax(z / T) but returns log softmax(z), pre-temperature; the trainer scores at T
    shifted_gather  returns the log-prob of the token at position t + shift (an off-by-one gather)
    bf16            bfloat16 weights and activations (log-softmax in float32) against the float32 trainer
    stale_sync      the weights of the last sync: the trainer's weights reach the engine every N steps only
    async_lag       the weights of `lag` steps ago, every step (asynchronous rollouts)

Every logit carries a shared offset (`logit_offset`), as an LLM's logits do: a softmax ignores it, a
bfloat16 engine rounds at its scale. `prompt_ids` records group_ids as the prompt's index in the dataset
(the same prompt, the same id at every step); off, each GRPO group gets a fresh id every step, as the TRL
hook records them, and no context can be matched across steps.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kldiag.record.recorder import Recorder
from kldiag.tools.demo_train import (
    N_OUT,
    N_PROMPT,
    DemoConfig,
    all_logits,
    group_advantages,
    init_params,
    kl_loss,
    logits_at,
    ppo_surrogate,
    token_logp,
    token_scores,
)

DEFECTS = ("none", "temperature", "raw_logprobs", "shifted_gather", "bf16", "stale_sync", "async_lag")


@dataclass(frozen=True)
class MismatchRun:
    """One tiny-model run and the cause its diagnosis must name (None: no cause at all)."""

    name: str
    defect: str = "none"
    expect: str | None = None
    steps: int = 60
    temperature: float = 1.0  # the engine's sampling temperature (temperature, raw_logprobs)
    shift: int = 1  # shifted_gather: logp_sampler[t] is the engine's log-prob at position t + shift
    sync_every: int = 0  # stale_sync: the engine gets the trainer's weights at steps that are multiples of N
    lag: int = 0  # async_lag: the engine's weights are those of `lag` steps ago
    prompt_ids: bool = True  # group_ids = the prompt's dataset index (stable across steps)
    logit_offset: float = 40.0  # shared by every logit, as an LLM's: invisible in float32, rounded in bf16
    prompts_per_step: int = 8
    group_size: int = 8
    length: int = 8
    minibatches: int = 2  # Adam steps per step, one per mini-batch of groups
    hidden: int = 64
    lr: float = 1e-2
    beta: float = 0.3  # k3_is against the initial policy (enough to keep the entropy from collapsing)
    seed: int = 0


RUN_LIST: tuple[MismatchRun, ...] = (
    MismatchRun("healthy"),
    MismatchRun("temperature", "temperature", "engine_temperature_mismatch", temperature=1.25),
    MismatchRun("raw_logprobs", "raw_logprobs", "engine_raw_logprobs", temperature=1.25),
    MismatchRun("shifted_gather", "shifted_gather", "engine_wrong_token", shift=1),
    MismatchRun("bf16", "bf16", "engine_precision"),
    MismatchRun("stale_sync", "stale_sync", "engine_stale_weights", sync_every=5),
    MismatchRun("stale_sync_no_prompt_ids", "stale_sync", "engine_stale_weights", sync_every=5, prompt_ids=False),
    MismatchRun("async_lag", "async_lag", "engine_async_lag", lag=3),
    MismatchRun("async_lag_no_prompt_ids", "async_lag", "engine_async_lag", lag=3, prompt_ids=False),
)
RUNS: dict[str, MismatchRun] = {r.name: r for r in RUN_LIST}


def _demo_config(run: MismatchRun):

    return DemoConfig(steps=run.steps, prompts_per_step=run.prompts_per_step, group_size=run.group_size,
                      length=run.length, hidden=run.hidden, lr=run.lr, beta=run.beta, lag=0,
                      sampler_temperature=1.0, ref_filler_boost=0.0, seed=run.seed)


def _snapshot(params: dict[str, Any], dtype=None) -> dict[str, Any]:
    return {k: v.detach().clone().to(dtype or v.dtype) for k, v in params.items()}


def engine_sample(params: dict[str, Any], prompts, run: MismatchRun, gen):
    """The engine: samples `run.length` tokens from softmax(z / T) with its own weights (bf16 ones compute
    in bf16); returns the tokens [B, L] and the log-probs it reports [B, L] (raw: of softmax(z))."""
    import torch


    temp = run.temperature if run.defect in ("temperature", "raw_logprobs") else 1.0
    prev = torch.full((prompts.shape[0],), N_OUT, dtype=torch.long)
    tokens, logps = [], []
    with torch.no_grad():
        for pos in range(run.length):
            z = logits_at(params, prompts, prev, pos).float()
            lp = torch.log_softmax(z / temp, dim=-1)
            prev = torch.multinomial(lp.exp(), 1, generator=gen).squeeze(-1)
            shown = torch.log_softmax(z, dim=-1) if run.defect == "raw_logprobs" else lp
            tokens.append(prev)
            logps.append(shown.gather(-1, prev[:, None]).squeeze(-1))
    tokens, logps = torch.stack(tokens, 1), torch.stack(logps, 1)
    if run.defect == "shifted_gather":  # position t gets position t + shift's value; the edge keeps its own
        k = run.shift
        shifted = logps.clone()
        if k > 0:
            shifted[:, :-k] = logps[:, k:]
        elif k < 0:
            shifted[:, -k:] = logps[:, :k]
        logps = shifted
    return tokens, logps


class _Engine:
    """Which weights the engine holds at each step (a copy of the trainer's, per the defect)."""

    def __init__(self, run: MismatchRun, params: dict[str, Any]):
        self.run = run
        self.history: deque = deque(maxlen=max(run.lag, 0) + 1)
        self.synced = _snapshot(params)

    def weights(self, step: int, params: dict[str, Any]) -> dict[str, Any]:
        import torch

        run = self.run
        self.history.append(_snapshot(params))
        if run.defect == "async_lag":
            return self.history[0]  # `lag` steps ago (the initial weights until then)
        if run.defect == "stale_sync":
            if step % max(run.sync_every, 1) == 0:
                self.synced = _snapshot(params)
            return self.synced
        if run.defect == "bf16":
            return _snapshot(params, torch.bfloat16)
        return self.history[-1]


def _ids(step: int, run: MismatchRun, prompts):
    import torch

    b = run.prompts_per_step * run.group_size
    seq = step * b + torch.arange(b)
    group = (step * run.prompts_per_step + torch.arange(run.prompts_per_step)).repeat_interleave(run.group_size)
    return seq, (prompts.clone() if run.prompt_ids else group)


def _entropy(logits):
    import torch

    lp = torch.log_softmax(logits, dim=-1)
    return -(lp.exp() * lp).sum(-1)


def _update(run, params, opt, batch, rows, ref_scale: float):
    """One mini-batch: the policy's log-probs before its Adam step (recorded), then the step."""
    import torch


    prompts, tokens = batch["prompts"][rows], batch["tokens"][rows]
    logits = all_logits(params, prompts, tokens) / ref_scale
    logp = token_logp(logits, tokens)
    loss = (ppo_surrogate(logp, batch["logp_old"][rows], batch["advantages"][rows], (0.2, 0.2))
            + run.beta * kl_loss("k3_is", logp, batch["logp_ref"][rows], batch["logp_old"][rows])).mean()
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(list(params.values()), 1.0)
    opt.step()
    return logp.detach(), _entropy(logits.detach())


def _rollout(run, step, params, ref, engine, gen, scores):
    """The step's batch: prompts, the engine's tokens and log-probs, the trainer's logp_old and logp_ref."""
    import torch


    prompts = torch.randint(N_PROMPT, (run.prompts_per_step,), generator=gen).repeat_interleave(run.group_size)
    tokens, logp_sampler = engine_sample(engine.weights(step, params), prompts, run, gen)
    scale = run.temperature if run.defect == "raw_logprobs" else 1.0  # the trainer scores at the sampling T
    with torch.no_grad():
        logp_old = token_logp(all_logits(params, prompts, tokens) / scale, tokens)
        logp_ref = token_logp(all_logits(ref, prompts, tokens) / scale, tokens)
    advantages = group_advantages(scores[prompts[:, None], tokens].mean(1), run.group_size)
    return {"prompts": prompts, "tokens": tokens, "logp_sampler": logp_sampler, "logp_old": logp_old,
            "logp_ref": logp_ref, "advantages": advantages, "scale": scale}


def train(run: MismatchRun, record) -> None:
    """Train `run.steps` GRPO steps; `record(**kw)` gets each mini-batch with kldiag.Recorder's keywords."""
    import torch


    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(run.seed)
        params = init_params(_demo_config(run), gen)
        with torch.no_grad():
            params["b2"] += run.logit_offset
        ref, engine = _snapshot(params), _Engine(run, params)
        opt = torch.optim.Adam(list(params.values()), lr=run.lr)
        scores = torch.as_tensor(token_scores(), dtype=torch.float32)
        per = run.group_size * max(run.prompts_per_step // run.minibatches, 1)
        for step in range(run.steps):
            batch = _rollout(run, step, params, ref, engine, gen, scores)
            seq, group = _ids(step, run, batch["prompts"])
            for micro, start in enumerate(range(0, len(seq), per)):
                rows = slice(start, start + per)
                logp, entropy = _update(run, params, opt, batch, rows, batch["scale"])
                record(step=step, micro=micro, logp=logp, logp_old=batch["logp_old"][rows],
                       logp_ref=batch["logp_ref"][rows], logp_sampler=batch["logp_sampler"][rows],
                       advantages=batch["advantages"][rows], mask=torch.ones_like(logp, dtype=torch.bool),
                       token_ids=batch["tokens"][rows] + N_PROMPT, seq_ids=seq[rows], group_ids=group[rows],
                       entropy=entropy)
    finally:
        torch.set_num_threads(threads)


def make_run(run_dir: str | Path, run: MismatchRun) -> Path:
    """Train `run` and write it with kldiag.Recorder into run_dir; returns run_dir."""
    if run.defect not in DEFECTS:
        raise ValueError(f"defect {run.defect!r}: choose from {', '.join(DEFECTS)}")
    config = {k: v for k, v in vars(run).items() if k not in ("name", "expect")}
    with Recorder(run_dir, beta=run.beta, estimator="k3_is", clip_range=0.2, trainer="kldiag.tools.mismatch_runs",
                  trainer_version="1", config={**config, "mismatch_run": run.name},
                  tags=["kldiag.tools.mismatch_runs"]) as rec:
        train(run, rec.record)
    return Path(run_dir)


def sized(run: MismatchRun, **changes: Any) -> MismatchRun:
    """The run with some fields changed (tests shrink or vary runs)."""
    return replace(run, **changes)
