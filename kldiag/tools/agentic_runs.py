"""Tiny-model multi-turn (agentic) runs: generated turns separated by tool replies, optionally re-tokenised.

    from kldiag.tools.agentic_runs import AgenticRun, make_run
    make_run("runs/agent", AgenticRun(retokenize=True))   # seconds, written with kldiag.Recorder
    python -m kldiag.tools.agentic_runs runs/agent --retokenize

A GRU language model over a 64-token vocabulary (built from the config, random weights, plain torch
on the CPU) plays the policy. Each sequence is a prompt, then `turns` generated turns separated by
tool replies: [prompt | turn 0 | tool | turn 1 | tool | turn 2]; the prompt and the tool replies are
outside the loss (mask False). The "engine" samples each turn token by token with the trainer's
weights and returns the sampled tokens' log-probs (logp_sampler); the tool's reply is a function of
the turn before it. The trainer scores the whole sequence teacher-forced (logp_old before the step's
updates, logp_ref with the initial weights), then takes one Adam step per mini-batch of a PPO
surrogate (GRPO group advantages), recording each mini-batch's logp before its update.

Defect `retokenize`: the trainer re-tokenises the conversation text, and at the boundary before
turns `retokenize_turns` the tool reply's last token comes out as another id (a merge the engine's
token-by-token stream never made). The trainer then scores the first tokens of those turns in a
context the engine never saw: a mismatch at each such turn's first tokens, fading along the turn,
none in turn 0. What the trainer stores as token ids are its own.

Placeholders: on tokens the engine did not generate, logp_sampler holds 0.0 ("0.0", as many dumps
store), NaN ("nan"), or the engine's own log-prob of the token in its context (None: an engine that
scores prompt and tool tokens).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from kldiag.record.recorder import Recorder

PLACEHOLDERS = ("0.0", "nan", None)


@dataclass(frozen=True)
class AgenticRun:
    """One multi-turn run. 40 steps x 16 sequences x 40 positions build in a few seconds."""

    steps: int = 40
    prompts_per_step: int = 4
    group_size: int = 4
    prompt_len: int = 4
    turn_len: int = 8
    tool_len: int = 4
    turns: int = 3  # generated turns per sequence (1: single-turn completions)
    vocab: int = 64
    hidden: int = 32
    lr: float = 3e-3
    minibatches: int = 2
    retokenize: bool = False
    retokenize_turns: tuple[int, ...] = (1, 2)  # turns whose boundary the trainer tokenises differently
    retokenize_from: int = 0  # the first step re-tokenised (a template or tokenizer change mid-run)
    engine_temperature: float = 1.0  # the engine samples softmax(z / T) and reports those log-probs (a
    # mismatch in every turn: the control a re-tokenisation must not be confused with)
    placeholder: str | None = "0.0"  # logp_sampler on tokens outside the loss (PLACEHOLDERS)
    record_turns: bool = False  # pass turn= to record() (format v1.2)
    seed: int = 0

    @property
    def length(self) -> int:
        return self.prompt_len + self.turns * self.turn_len + (self.turns - 1) * self.tool_len


def layout(run: AgenticRun) -> tuple[np.ndarray, np.ndarray]:
    """(turn [L]: the generated turn of each position, -1 for prompt and tool tokens; boundary [L] bool:
    the tool reply's last position before each turn in run.retokenize_turns)."""
    turn = np.full(run.length, -1, np.int64)
    boundary = np.zeros(run.length, bool)
    at = run.prompt_len
    for k in range(run.turns):
        if k:
            if k in run.retokenize_turns:
                boundary[at - 1] = True
        turn[at: at + run.turn_len] = k
        at += run.turn_len + (run.tool_len if k < run.turns - 1 else 0)
    return turn, boundary


def build_model(run: AgenticRun, gen) -> dict[str, Any]:
    """The policy: embedding, one GRU cell, output layer (+1 input row: the start token)."""
    import torch

    h, v = run.hidden, run.vocab

    def rand(*shape, scale):
        return (torch.randn(*shape, generator=gen) * scale).requires_grad_()

    return {"emb": rand(v + 1, h, scale=1.0), "w_ih": rand(3 * h, h, scale=h ** -0.5),
            "w_hh": rand(3 * h, h, scale=h ** -0.5), "b_ih": torch.zeros(3 * h, requires_grad=True),
            "b_hh": torch.zeros(3 * h, requires_grad=True), "out": rand(h, v, scale=2.0 * h ** -0.5)}


def _step(p: dict[str, Any], x, hid):
    """One GRU cell step (Cho et al. 2014): the new hidden state [B, H] after input token x [B]."""
    import torch

    gi = p["emb"][x] @ p["w_ih"].T + p["b_ih"]
    gh = hid @ p["w_hh"].T + p["b_hh"]
    i_r, i_z, i_n = gi.chunk(3, -1)
    h_r, h_z, h_n = gh.chunk(3, -1)
    r, z = torch.sigmoid(i_r + h_r), torch.sigmoid(i_z + h_z)
    return (1 - z) * torch.tanh(i_n + r * h_n) + z * hid


def score(p: dict[str, Any], tokens, vocab: int):
    """Teacher-forced log-probs [B, L] of `tokens` [B, L] (position 0 is predicted from the start token)."""
    import torch

    b, n = tokens.shape
    hid = torch.zeros(b, p["w_hh"].shape[1])
    prev = torch.full((b,), vocab, dtype=torch.long)
    out = []
    for t in range(n):
        hid = _step(p, prev, hid)
        out.append(torch.log_softmax(hid @ p["out"], -1).gather(-1, tokens[:, t:t + 1]).squeeze(-1))
        prev = tokens[:, t]
    return torch.stack(out, 1)


def _tool_reply(run: AgenticRun, generated) -> Any:
    """The tool's reply [B, tool_len]: a deterministic function of the turn it answers."""
    import torch

    base = generated.sum(1, keepdim=True) * 7
    return (base + torch.arange(1, run.tool_len + 1) * 13) % run.vocab


def rollout(run: AgenticRun, p: dict[str, Any], prompts, gen) -> tuple[Any, Any]:
    """The engine: (tokens [B, L] as it generated and saw them, its log-prob of each [B, L]; those of
    prompt and tool tokens are its scores of them)."""
    import torch

    turn_of, _ = layout(run)
    b = prompts.shape[0]
    hid = torch.zeros(b, run.hidden)
    prev = torch.full((b,), run.vocab, dtype=torch.long)
    tokens, logps, pending = [], [], list(prompts.T)
    with torch.no_grad():
        for t in range(run.length):
            hid = _step(p, prev, hid)
            lp = torch.log_softmax(hid @ p["out"] / run.engine_temperature, -1)
            if turn_of[t] >= 0:
                tok = torch.multinomial(lp.exp(), 1, generator=gen).squeeze(-1)
            else:
                if not pending:  # a tool reply to the turn just generated
                    last = torch.stack(tokens[t - run.turn_len: t], 1)
                    pending = list(_tool_reply(run, last).T)
                tok = pending.pop(0)
            tokens.append(tok)
            logps.append(lp.gather(-1, tok[:, None]).squeeze(-1))
            prev = tok
    return torch.stack(tokens, 1), torch.stack(logps, 1)


def trainer_tokens(run: AgenticRun, tokens, step: int):
    """The trainer's re-tokenisation of the engine's tokens: at a mis-tokenised boundary the tool's
    last token becomes another id (its merge with the turn's leading text)."""
    if not run.retokenize or step < run.retokenize_from:
        return tokens
    _, boundary = layout(run)
    out = tokens.clone()
    cols = np.flatnonzero(boundary)
    out[:, cols] = (tokens[:, cols] + run.vocab // 2 + 1) % run.vocab
    return out


def _advantages(tokens, mask, run: AgenticRun):
    """GRPO group advantages of a toy reward: the share of generated tokens in the lower half of the vocabulary."""
    r = ((tokens < run.vocab // 2) & mask).sum(1).float() / mask.sum(1)
    g = r.view(-1, run.group_size)
    return ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-4)).view(-1)


def _sampler_column(run: AgenticRun, logp_engine, mask):
    import torch

    if run.placeholder is None:
        return logp_engine
    fill = 0.0 if run.placeholder == "0.0" else math.nan
    return torch.where(mask, logp_engine, torch.full_like(logp_engine, fill))


def train(run: AgenticRun, record) -> None:
    """`run.steps` PPO steps; `record(**kw)` gets each mini-batch with kldiag.Recorder's keywords."""
    import torch

    if run.placeholder not in PLACEHOLDERS:
        raise ValueError(f"placeholder {run.placeholder!r}: choose one of {PLACEHOLDERS}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(run.seed)
        p = build_model(run, gen)
        ref = {k: v.detach().clone() for k, v in p.items()}
        opt = torch.optim.Adam(list(p.values()), lr=run.lr)
        turn_of, _ = layout(run)
        mask = torch.as_tensor(turn_of >= 0).expand(run.prompts_per_step * run.group_size, -1)
        b = run.prompts_per_step * run.group_size
        per = b // run.minibatches
        for step in range(run.steps):
            prompts = torch.randint(run.vocab, (run.prompts_per_step, run.prompt_len), generator=gen)
            prompts = prompts.repeat_interleave(run.group_size, 0)
            tokens, logp_engine = rollout(run, p, prompts, gen)
            seen = trainer_tokens(run, tokens, step)
            with torch.no_grad():
                logp_old, logp_ref = score(p, seen, run.vocab), score(ref, seen, run.vocab)
            adv = _advantages(seen, mask, run)
            sampler = _sampler_column(run, logp_engine, mask)
            for micro, start in enumerate(range(0, b, per)):
                rows = slice(start, start + per)
                logp = _update(run, p, opt, seen[rows], mask[rows], logp_old[rows], adv[rows])
                extra = _turn_arg(run, turn_of, per)
                record(step=step, micro=micro, logp=logp, logp_old=logp_old[rows], logp_ref=logp_ref[rows],
                       logp_sampler=sampler[rows], advantages=adv[rows], mask=mask[rows],
                       completion_mask=torch.ones_like(mask[rows]), token_ids=seen[rows],
                       seq_ids=step * b + torch.arange(start, start + per),
                       group_ids=(step * run.prompts_per_step + torch.arange(start, start + per) // run.group_size),
                       **extra)
    finally:
        torch.set_num_threads(threads)


def _update(run: AgenticRun, p, opt, tokens, mask, logp_old, adv):
    """One mini-batch: its log-probs before the Adam step (returned), then the step on a PPO surrogate."""
    import torch

    logp = score(p, tokens, run.vocab)
    ratio = torch.exp(logp - logp_old)
    surr = torch.minimum(ratio * adv[:, None], ratio.clamp(0.8, 1.2) * adv[:, None])
    loss = -(surr * mask).sum() / mask.sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return logp.detach()


def _turn_arg(run: AgenticRun, turn_of: np.ndarray, rows: int) -> dict[str, Any]:
    if not run.record_turns:
        return {}
    return {"turn": np.broadcast_to(turn_of, (rows, len(turn_of))).copy()}


def make_run(run_dir: str | Path, run: AgenticRun = AgenticRun()) -> Path:
    """Train `run` and write it with kldiag.Recorder into run_dir; returns run_dir."""
    config = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(run).items()}
    with Recorder(run_dir, beta=0.0, estimator="k3", clip_range=0.2, trainer="kldiag.tools.agentic_runs",
                  trainer_version="1", config={**config, "agentic_run": True},
                  tags=["kldiag.tools.agentic_runs"]) as rec:
        train(run, rec.record)
    return Path(run_dir)


def sized(run: AgenticRun, **changes: Any) -> AgenticRun:
    return replace(run, **changes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kldiag.tools.agentic_runs", description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path, help="the run directory to write")
    ap.add_argument("--retokenize", action="store_true", help="the trainer re-tokenises turn boundaries")
    ap.add_argument("--retokenize-turns", type=int, nargs="+", default=[1, 2], help="turns whose boundary differs")
    ap.add_argument("--retokenize-from", type=int, default=0, help="the first step re-tokenised")
    ap.add_argument("--turns", type=int, default=3, help="generated turns per sequence")
    ap.add_argument("--engine-temperature", type=float, default=1.0,
                    help="the engine samples and reports at this temperature (a mismatch in every turn)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--placeholder", choices=["0.0", "nan", "none"], default="0.0",
                    help="logp_sampler on tool/prompt tokens (none: the engine's own log-prob)")
    ap.add_argument("--record-turns", action="store_true", help="pass turn= to record() (format v1.2)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    run = AgenticRun(steps=a.steps, turns=a.turns, retokenize=a.retokenize,
                     retokenize_turns=tuple(a.retokenize_turns), retokenize_from=a.retokenize_from,
                     placeholder=None if a.placeholder == "none" else a.placeholder,
                     record_turns=a.record_turns, seed=a.seed, engine_temperature=a.engine_temperature)
    print(make_run(a.out, run))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
