"""Recorder on CUDA tensors: record()'s hold against a bare `.cpu()` copy, and a GPU training loop's
step time with and without the recorder.

    python bench/recorder_cuda.py [--batch 64 --time 4096 --calls 50 --steps 20 --pairs 6]

Every figure is a ratio to a baseline measured in the same run on the same device:
- hold: wall time record() holds the calling thread, per micro-batch of [B, T] log-probs (bf16, then
  fp32) with logp_old, logp_ref, mask, token ids and per-row advantages / a bare `.cpu()` of the same
  tensors; once with the device idle, once with ~20 ms of kernels queued before the call (a copy
  to the host waits for them, record() should not);
- step: a small causal LM (embedding, 4 transformer layers, 32k vocab) trained with Adam in bf16
  autocast, `loss.item()` every step; median of per-pair ratios (attached / plain), pairs of
  `--steps` steps interleaved, with the minimum and maximum.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

import kldiag


def micro_batch(b: int, t: int, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    logp = -torch.empty(b, t, device="cuda").exponential_(1.0, generator=g)
    lengths = torch.randint(t // 2, t + 1, (b,), device="cuda", generator=g)
    return {"logp": logp.to(dtype), "logp_old": (logp - 0.01).to(dtype), "logp_ref": (logp + 0.2).to(dtype),
            "advantages": torch.randn(b, device="cuda", generator=g),
            "mask": torch.arange(t, device="cuda")[None, :] < lengths[:, None],
            "token_ids": torch.randint(0, 151_936, (b, t), device="cuda", generator=g)}


def busy(ms: float) -> None:
    torch.cuda._sleep(int(ms * 1e-3 * CYCLES_PER_S))


def bench_hold(run: Path, batch: dict[str, torch.Tensor], calls: int, queued_ms: float) -> tuple[float, float]:
    """(median record() hold, median bare .cpu() of the same tensors), seconds."""
    hold, bare = [], []
    with kldiag.Recorder(run, strict=True, queue_batches=calls + 2) as rec:
        rec.record(step=0, **batch)  # warm the pinned pool
        rec.flush()
        for i in range(calls):
            torch.cuda.synchronize()
            busy(queued_ms)
            t0 = time.perf_counter()
            rec.record(step=i + 1, **batch)
            hold.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
            busy(queued_ms)
            t0 = time.perf_counter()
            _ = [x.cpu() for x in batch.values()]
            bare.append(time.perf_counter() - t0)
            if i % 8 == 7:
                rec.flush()
    return statistics.median(hold), statistics.median(bare)


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int = 32_768, d: int = 512, layers: int = 4):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        layer = torch.nn.TransformerEncoderLayer(d, 8, 4 * d, batch_first=True, norm_first=True)
        self.body = torch.nn.TransformerEncoder(layer, layers)
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        causal = torch.nn.Transformer.generate_square_subsequent_mask(ids.shape[1], device=ids.device)
        return self.head(self.body(self.emb(ids), mask=causal, is_causal=True))


def train_steps(model, opt, ids, n: int, rec=None, step0: int = 0) -> float:
    """Seconds per GRPO-like step (K3 penalty to a fixed reference), optionally recording each."""
    ref = ids.float().mul(0).sub(2.0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(n):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(ids[:, :-1])
        logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        d = ref[:, 1:] - logp
        loss = (torch.exp(d) - d - 1).mean() - logp.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if rec is not None:
            rec.record(step=step0 + i, logp=logp.detach().to(torch.bfloat16), logp_old=logp.detach(),
                       logp_ref=ref[:, 1:], token_ids=ids[:, 1:])
        loss.item()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n


def bench_steps(tmp: Path, steps: int, pairs: int, b: int, t: int) -> list[tuple[float, float]]:
    torch.manual_seed(0)
    model = TinyLM().cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-5)
    ids = torch.randint(0, 32_768, (b, t + 1), device="cuda")
    train_steps(model, opt, ids, 5)  # warm-up: kernels, allocator
    out = []
    with kldiag.Recorder(tmp / "train", strict=True) as rec:
        train_steps(model, opt, ids, 3, rec, step0=10**6)
        for p in range(pairs):
            plain = train_steps(model, opt, ids, steps)
            attached = train_steps(model, opt, ids, steps, rec, step0=p * steps)
            out.append((plain, attached))
    return out


def profile_hold(run: Path, batch: dict[str, torch.Tensor], calls: int) -> None:
    """The functions record() spends its hold in (cProfile, device idle), top 12 by own time."""
    import cProfile
    import pstats

    with kldiag.Recorder(run, strict=True, queue_batches=calls + 2) as rec:
        rec.record(step=0, **batch)
        rec.flush()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        for i in range(calls):
            prof.enable()
            rec.record(step=i + 1, **batch)
            prof.disable()
            if i % 8 == 7:
                rec.flush()
    pstats.Stats(prof).sort_stats("tottime").print_stats(12)


def _calibrate() -> float:
    """GPU clock cycles per second for torch.cuda._sleep."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(100_000_000)
    end.record()
    end.synchronize()
    return 100_000_000 / (start.elapsed_time(end) * 1e-3)


def main() -> None:
    global CYCLES_PER_S
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--time", type=int, default=4096)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--train-batch", type=int, default=8)
    ap.add_argument("--train-time", type=int, default=1024)
    ap.add_argument("--profile", action="store_true", help="also print where record() spends its hold (cProfile)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this bench measures the recorder's CUDA path")
    CYCLES_PER_S = _calibrate()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, kldiag {kldiag.__version__}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for dtype in (torch.bfloat16, torch.float32):
            batch = micro_batch(args.batch, args.time, dtype)
            name = str(dtype).removeprefix("torch.")
            for queued in (0.0, 20.0):
                hold, bare = bench_hold(tmp / f"hold-{name}-{queued:.0f}", batch, args.calls, queued)
                print(f"hold [{args.batch}, {args.time}] {name} log-probs, {queued:.0f} ms queued: record() "
                      f"{hold * 1e3:.3f} ms, bare .cpu() {bare * 1e3:.3f} ms, ratio {hold / bare:.3f}")
        if args.profile:
            profile_hold(tmp / "profile", micro_batch(args.batch, args.time, torch.bfloat16), args.calls)
        pairs = bench_steps(tmp, args.steps, args.pairs, args.train_batch, args.train_time)
        ratios = sorted(a / p for p, a in pairs)
        print(f"train step [{args.train_batch}, {args.train_time}] TinyLM: plain "
              f"{statistics.median(p for p, _ in pairs) * 1e3:.2f} ms, attached "
              f"{statistics.median(a for _, a in pairs) * 1e3:.2f} ms; ratio median {statistics.median(ratios):.4f} "
              f"(min {ratios[0]:.4f}, max {ratios[-1]:.4f}, {len(ratios)} pairs of {args.steps} steps)")


CYCLES_PER_S = 1.5e9

if __name__ == "__main__":
    main()
