"""What top-k lists cost: bytes per token on disk, and the TRL step time with attach(topk=K).

    python bench/topk.py                      # bytes per token (200k tokens), then bench/trl_overhead.py --topk 20
    python bench/topk.py --no-trl             # bytes only
    python bench/topk.py --tokens 1000000 --k 20 --vocab 151936

Bytes: the same recorded tokens three times with kldiag.Recorder (its Parquet settings,
kldiag/format/schema.py): no top-k lists, the trainer's top-K (topk_ids/topk_logp), and both
sides' (plus topk_ids_sampler/topk_logp_sampler); the sum of the part files over the token rows.
The lists are drawn like an LM's: each token's K largest of `vocab` logits (a heavy head of a few
hundred candidates over a flat tail), ids spread over the vocabulary, the engine's a perturbed copy
of the trainer's (mostly the same ids, in nearly the same order), log-probs in float32.

Step time: bench/trl_overhead.py --topk K, blocks mode: one attached run whose generation cycles
alternate top-k on and off (both recording), so the ratio is the top-k capture's cost alone, against
the tiny model's forward (vocabulary ~30: the extra LM-head projection is nearly free here; on a real
vocabulary it is one more [tokens x hidden] x [hidden x vocab] product per micro-batch, see
kldiag/integrations/trl/kernel.py TopkCapture).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import kldiag

HEAD = 512  # candidate ids per token whose logits stand out of the flat tail


def lists(rng: np.random.Generator, n: int, k: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """[n, k] ids and float32 log-probs: the top k of a head of HEAD logits over vocab - HEAD flat ones."""
    sharp = rng.uniform(0.5, 4.0, size=(n, 1))  # per-token spread: confident and uncertain tokens
    head = rng.normal(size=(n, HEAD)) * sharp
    log_z = np.logaddexp(np.log(np.exp(head).sum(1)), np.log(vocab - HEAD) - 2.0 * sharp[:, 0])
    top = -np.sort(-head, axis=1)[:, :k]
    ids = rng.integers(0, vocab, size=(n, k))  # a repeat within a row (rare at 150k ids) changes no byte count
    return ids.astype(np.int32), (top - log_z[:, None]).astype(np.float32)


def engine_copy(rng: np.random.Generator, ids: np.ndarray, logp: np.ndarray,
                vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """The engine's lists: log-probs nudged (bf16-like noise), one in ten tails id replaced, re-sorted."""
    lp = logp + rng.normal(scale=0.01, size=logp.shape).astype(np.float32)
    ids = ids.copy()
    swap = rng.random(ids.shape) < 0.1
    swap[:, :5] = False
    ids[swap] = rng.integers(0, vocab, size=int(swap.sum()))
    order = np.argsort(-lp, axis=1, kind="stable")
    return np.take_along_axis(ids, order, 1), np.take_along_axis(lp, order, 1)


def record(path: Path, tokens: int, k: int, vocab: int, sides: int, seed: int) -> tuple[int, int]:
    """(bytes of the part files, token rows) of a run of `tokens` tokens with `sides` lists (0, 1, 2)."""
    rng = np.random.default_rng(seed)
    b, t = 64, 512
    rec = kldiag.Recorder(path, rotate_steps=4)
    for step in range(tokens // (b * t)):
        ids, lp = lists(rng, b * t, k, vocab)
        token = ids[:, 0].reshape(b, t)
        logp = lp[:, 0].reshape(b, t)
        kw = {}
        if sides >= 1:
            kw.update(topk_ids=ids.reshape(b, t, k), topk_logp=lp.reshape(b, t, k))
        if sides >= 2:
            ids_s, lp_s = engine_copy(rng, ids, lp, vocab)
            kw.update(topk_ids_sampler=ids_s.reshape(b, t, k), topk_logp_sampler=lp_s.reshape(b, t, k))
        rec.record(step=step, logp=logp, logp_old=logp, logp_sampler=logp + np.float32(0.01),
                   token_ids=token, advantages=rng.normal(size=b).astype(np.float32), **kw)
    rec.close()
    parts = list((path / "tokens").rglob("part-*.parquet"))
    return sum(p.stat().st_size for p in parts), kldiag.open_run(path).read(["step"]).num_rows


def reducer_speed(run: Path) -> str:
    """The TopkReducer's pass over a run (no cache, this process): tokens per second."""
    from kldiag.analysis.reducers.topk import TopkReducer
    from kldiag.analysis.runtime import runner

    r = TopkReducer()
    t0 = time.perf_counter()
    out = r.result(runner.Pass(run / ".nocache", kldiag.open_run(run).parts(), [r],
                               kldiag.AnalysisConfig(use_cache=False)).merged(r))
    s = time.perf_counter() - t0
    return (f"TopkReducer over the both-sides run: {out['tokens_both'] / s:,.0f} tokens/s "
            f"({out['tokens_both']:,} tokens in {s:.1f} s; kl_mean {out['kl_mean']:.4f})")


def head_cost(k: int, vocab: int, hidden: int, tokens: int, pairs: int) -> str:
    """TopkCapture's cost against TRL's own fused scoring forward, on a 1-layer Qwen2 with a real
    vocabulary (random weights, float32, this CPU): `pairs` interleaved (plain, with capture) calls
    of model(..., fused_lm_head=True) on one sequence of `tokens` completion tokens, no grad."""
    import statistics

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from kldiag.integrations.trl.kernel import TopkCapture

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=1,
                      num_attention_heads=hidden // 64, num_key_value_heads=2, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg).eval()
    add_fused_lm_head(model, temperature=1.0, outputs=("log_probs", "entropy"))
    ids = torch.randint(0, vocab, (1, 32 + tokens))
    att = torch.ones_like(ids)
    labels = ids.clone()
    labels[:, :32] = -100

    def call(capture: bool) -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            cap = TopkCapture(model, k, 1.0, tokens) if capture else None
            out = model(input_ids=ids, attention_mask=att, labels=labels, fused_lm_head=True)
            if cap is not None:
                cap.close()
                cap.result(out.log_probs[:, -tokens:], check=False)
        return time.perf_counter() - t0

    call(True), call(False)  # first-call costs
    ratios, plain = [], []
    for i in range(pairs):  # alternate which runs first
        if i % 2 == 0:
            a = call(False)
            b = call(True)
        else:
            b = call(True)
            a = call(False)
        ratios.append(b / a)
        plain.append(a)
    return (f"1-layer Qwen2, hidden {hidden}, vocabulary {vocab:,}, {tokens} completion tokens, "
            f"{torch.get_num_threads()} threads: TRL's fused scoring forward "
            f"{statistics.median(plain) * 1e3:.0f} ms; with TopkCapture(k={k}) "
            f"x{statistics.median(ratios):.2f} (median of {pairs} pairs, min {min(ratios):.2f}, max {max(ratios):.2f})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=200_000)
    p.add_argument("--k", type=int, default=20)
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-trl", action="store_true", help="skip the TRL step-time pairs")
    p.add_argument("--no-head", action="store_true", help="skip the real-vocabulary LM-head pairs")
    p.add_argument("--head-tokens", type=int, default=256)
    p.add_argument("--trl-steps", type=int, default=402, help="bench/trl_overhead.py --steps")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        base = None
        for sides, name in ((0, "no top-k"), (1, f"trainer top-{args.k}"), (2, f"both sides top-{args.k}")):
            t0 = time.perf_counter()
            size, rows = record(Path(tmp) / name.replace(" ", "_"), args.tokens, args.k, args.vocab, sides, args.seed)
            per = size / rows
            base = base or per
            print(f"{name:>22}: {per:7.1f} bytes per token ({rows:,} tokens, {size / 1e6:.1f} MB, "
                  f"x{per / base:.2f} of no top-k; recorded in {time.perf_counter() - t0:.1f} s)", flush=True)
        print(reducer_speed(Path(tmp) / f"both_sides_top-{args.k}"), flush=True)
    if not args.no_head:
        print(head_cost(args.k, args.vocab, 896, args.head_tokens, pairs=6), flush=True)
    if args.no_trl:
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import trl_overhead

    print(f"\nTRL step time, attach(topk={args.k}) on vs off (bench/trl_overhead.py --topk {args.k}):", flush=True)
    return trl_overhead.main(["--topk", str(args.k), "--steps", str(args.trl_steps)])


if __name__ == "__main__":
    raise SystemExit(main())
