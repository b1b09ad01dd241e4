"""Tiny-model runs sampled with top-k / top-p / min-p truncation: the known truth of `engine_truncated_sampling`.

    python -m kldiag.tools.sampling_runs runs/topk --top-k 8            # engine truncates, trainer does not
    python -m kldiag.tools.sampling_runs runs/topk_ok --top-k 8 --replay-mask   # trainer applies the same mask
    kldiag analyze runs/topk          # names engine_truncated_sampling; runs/topk_ok stays healthy

    from kldiag.tools.sampling_runs import RUNS, make_run
    make_run("runs/topp", RUNS["top_p0.9"])

A GRPO training of a tiny autoregressive policy, plain torch on the CPU: a 2-layer GRU over a 64-token
vocabulary whose output carries a context-dependent gain (a random linear read of the hidden state, exp'd),
so that its next-token distributions range from near-deterministic to near-uniform. At every step an "engine"
(the trainer's own float32 weights) samples each position from the truncated distribution, as vLLM does:
logits / T, then top-k, top-p (smallest set of largest probabilities reaching p, after top-k) and min-p,
the dropped ids at -inf, and returns the log-softmax of those processed logits (vLLM's processed_logprobs: the
truncated, renormalised distribution) as logp_sampler. The trainer scores the completions over the full
vocabulary at T (logp_old before the step's updates, logp before each mini-batch's Adam step), so on every
sampled token log mu - log pi_old = -log(kept mass) >= 0. With `replay_mask` the trainer renormalises its
log-probs over the engine's kept ids (DeepSeek-V3.2's "keep sampling mask"), and sampler and trainer agree.
The entropy recorded is that of the trainer's full distribution at T. Recorded with kldiag.Recorder and a
manifest whose config["engine_sampling"] (kldiag.frameworks.sampling) holds the settings, in the `trainer`'s keys.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from kldiag.frameworks import sampling as S
from kldiag.record.recorder import Recorder


@dataclass(frozen=True)
class SamplingRun:
    """One tiny-model run: the engine's truncation and whether the trainer replays its mask."""

    name: str = "untruncated"
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off
    temperature: float = 1.0  # the engine samples at T and the trainer scores at T (no temperature mismatch)
    replay_mask: bool = False  # the trainer renormalises over the engine's kept ids
    trainer: str = "plain"  # whose keys the manifest's sampling settings use: plain, trl, verl, slime, nemo_rl
    steps: int = 40
    prompts_per_step: int = 4
    group_size: int = 4  # completions per prompt (sequences per step: prompts_per_step * group_size)
    prompt_len: int = 4
    length: int = 16  # completion tokens
    vocab: int = 64
    embed: int = 32
    hidden: int = 64
    log_gain: float = 1.5  # the logits' std over the vocabulary is exp(log_gain + gain_spread * tanh(g.h)) ...
    gain_spread: float = 1.2  # ... so that the entropies spread from near 0 to near log(vocab)
    minibatches: int = 2
    lr: float = 3e-4
    entropy_coef: float = 0.05  # an entropy bonus: GRPO on a fixed reward alone drives the policy deterministic
    dataset: int = 32  # prompts in the dataset (group ids = the prompt's index)
    group_ids: bool = True  # record them (off: no context is shared, the parity fits are pooled)
    seed: int = 0


RUN_LIST: tuple[SamplingRun, ...] = (
    SamplingRun("untruncated"),
    SamplingRun("top_k8", top_k=8),
    SamplingRun("top_p0.9", top_p=0.9),
    SamplingRun("top_k8_replayed", top_k=8, replay_mask=True),
    SamplingRun("top_p0.9_replayed", top_p=0.9, replay_mask=True),
)
RUNS: dict[str, SamplingRun] = {r.name: r for r in RUN_LIST}


def keep_mask(z, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0):
    """bool [..., V]: the ids vLLM's sampler keeps for logits z (already divided by T): top-k, then top-p on
    the top-k-renormalised probabilities (a token is kept while the mass before it is below p), then min-p."""
    import torch

    keep = torch.ones_like(z, dtype=torch.bool)
    if top_k and top_k < z.shape[-1]:
        kth = torch.topk(z, top_k, dim=-1).values[..., -1:]
        keep &= z >= kth
    if top_p < 1.0:
        p = torch.softmax(z.masked_fill(~keep, float("-inf")), dim=-1)
        sp, order = torch.sort(p, dim=-1, descending=True)
        before = torch.cumsum(sp, dim=-1) - sp
        keep &= torch.zeros_like(keep).scatter(-1, order, before < top_p)
    if min_p > 0.0:
        p = torch.softmax(z, dim=-1)
        keep &= p >= min_p * p.max(dim=-1, keepdim=True).values
    return keep


def build_model(run: SamplingRun):
    """The policy: embedding, 2-layer GRU, head; logits = standardised head(h) x a gain read from h."""
    import torch

    with torch.random.fork_rng():
        torch.manual_seed(run.seed)
        model = torch.nn.ModuleDict({
            "emb": torch.nn.Embedding(run.vocab, run.embed),
            "gru": torch.nn.GRU(run.embed, run.hidden, num_layers=2, batch_first=True),
            "head": torch.nn.Linear(run.hidden, run.vocab),
            "g": torch.nn.Linear(run.hidden, 1)})
        with torch.no_grad():
            model["g"].weight.normal_().mul_(8.0 / run.hidden ** 0.5)
    return model


def _logits(model, run: SamplingRun, h):
    import torch

    z = model["head"](h)
    z = (z - z.mean(-1, keepdim=True)) / (z.std(-1, keepdim=True) + 1e-6)
    gain = torch.exp(run.log_gain + run.gain_spread * torch.tanh(model["g"](h)))
    return z * gain / run.temperature


def engine_sample(model, run: SamplingRun, prompts, gen):
    """The engine: tokens [B, L], its processed log-probs [B, L] and the kept ids [B, L, V]."""
    import torch

    with torch.no_grad():
        out, state = model["gru"](model["emb"](prompts))
        h = out[:, -1]
        tokens, logps, kept = [], [], []
        for _ in range(run.length):
            z = _logits(model, run, h)
            keep = keep_mask(z, run.top_k, run.top_p, run.min_p)
            lp = torch.log_softmax(z.masked_fill(~keep, float("-inf")), dim=-1)
            x = torch.multinomial(lp.exp(), 1, generator=gen)
            tokens.append(x[:, 0])
            logps.append(lp.gather(-1, x)[:, 0])
            kept.append(keep)
            out, state = model["gru"](model["emb"](x), state)
            h = out[:, -1]
    return torch.stack(tokens, 1), torch.stack(logps, 1), torch.stack(kept, 1)


def trainer_scores(model, run: SamplingRun, prompts, tokens, kept):
    """The trainer's log-probs of the tokens [B, L] (over the kept ids with replay_mask, else the full
    vocabulary) and its full-vocabulary entropy [B, L]."""
    import torch

    seq = torch.cat([prompts, tokens], 1)
    out, _ = model["gru"](model["emb"](seq[:, :-1]))
    z = _logits(model, run, out[:, prompts.shape[1] - 1:])
    full = torch.log_softmax(z, dim=-1)
    entropy = -(full.exp() * full).sum(-1)
    lp = torch.log_softmax(z.masked_fill(~kept, float("-inf")), dim=-1) if run.replay_mask else full
    return lp.gather(-1, tokens[..., None])[..., 0], entropy


def manifest_sampling(run: SamplingRun) -> dict[str, Any]:
    """config["engine_sampling"] as the run's `trainer` would record it (its own key names)."""
    k, p, mp, t = run.top_k, run.top_p, run.min_p, run.temperature
    if run.trainer == "trl":
        return S.from_trl({"temperature": t, "top_k": k, "top_p": p, "min_p": mp or None, "use_vllm": True})
    if run.trainer == "verl":
        return S.from_verl({"temperature": t, "top_k": k or -1, "top_p": p, "logprobs_mode": "processed_logprobs",
                            "calculate_log_probs": True, "name": "vllm"})
    if run.trainer == "slime":
        return S.from_slime({"rollout_temperature": t, "rollout_top_k": k or -1, "rollout_top_p": p})
    if run.trainer == "nemo_rl":
        return S.from_nemo_rl({"temperature": t, "top_k": k or None, "top_p": p, "backend": "vllm"})
    replay = [n for n in S.TRUNCATIONS if run.replay_mask]
    flags = {n: f"kldiag.tools.sampling_runs --{n.replace('_', '-')}" for n in ("temperature", *S.TRUNCATIONS)}
    return S.settings(t, k, p, mp, "processed_logprobs", replay, "torch", flags)


def _advantages(reward, group: int):
    r = reward.view(-1, group)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, unbiased=False, keepdim=True) + 1e-4)).view(-1)


def train(run: SamplingRun, record) -> None:
    """`run.steps` GRPO steps (PPO clip 0.2, no KL, an entropy bonus); `record(**kw)` gets each mini-batch's
    keywords."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(run.seed)
        model = build_model(run)
        opt = torch.optim.Adam(model.parameters(), lr=run.lr)
        data = torch.randint(run.vocab, (run.dataset, run.prompt_len), generator=gen)
        score = torch.rand(run.vocab, generator=gen)  # the reward: the completion's mean token score
        b = run.prompts_per_step * run.group_size
        per = b // max(run.minibatches, 1)
        for step in range(run.steps):
            pid = torch.randint(run.dataset, (run.prompts_per_step,), generator=gen).repeat_interleave(run.group_size)
            prompts = data[pid]
            tokens, logp_sampler, kept = engine_sample(model, run, prompts, gen)
            with torch.no_grad():
                logp_old, _ = trainer_scores(model, run, prompts, tokens, kept)
            adv = _advantages(score[tokens].mean(1), run.group_size)
            for micro, start in enumerate(range(0, b, per)):
                rows = slice(start, start + per)
                logp, entropy = trainer_scores(model, run, prompts[rows], tokens[rows], kept[rows])
                ratio = torch.exp(logp - logp_old[rows])
                a = adv[rows, None]
                loss = -torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a).mean() - run.entropy_coef * entropy.mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                record(step=step, micro=micro, logp=logp.detach(), logp_old=logp_old[rows],
                       logp_sampler=logp_sampler[rows], advantages=adv[rows], token_ids=tokens[rows],
                       seq_ids=step * b + torch.arange(b)[rows],
                       group_ids=pid[rows] if run.group_ids else None, entropy=entropy.detach())
    finally:
        torch.set_num_threads(threads)


def make_run(run_dir: str | Path, run: SamplingRun) -> Path:
    """Train `run` and write it with kldiag.Recorder into run_dir (manifest config["engine_sampling"] included)."""
    if run.trainer not in ("plain", "trl", "verl", "slime", "nemo_rl"):
        raise ValueError(f"trainer {run.trainer!r}: choose plain, trl, verl, slime or nemo_rl")
    name = "kldiag.tools.sampling_runs" if run.trainer == "plain" else run.trainer
    config = {**asdict(run), S.KEY: manifest_sampling(run), "sampling_run": run.name}
    with Recorder(run_dir, beta=0.0, estimator="k3", clip_range=0.2, trainer=name, trainer_version="1",
                  config=config, tags=["kldiag.tools.sampling_runs"]) as rec:
        train(run, rec.record)
    return Path(run_dir)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kldiag.tools.sampling_runs", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="the run directory to write")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--replay-mask", action="store_true", help="the trainer renormalises over the kept ids")
    p.add_argument("--trainer", default="plain", choices=("plain", "trl", "verl", "slime", "nemo_rl"))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    run = replace(SamplingRun(), name=Path(a.out).name, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
                  temperature=a.temperature, replay_mask=a.replay_mask, trainer=a.trainer, steps=a.steps, seed=a.seed)
    print(make_run(a.out, run))
    return 0


if __name__ == "__main__":
    sys.exit(main())
