"""Step time of the TRL example with kldiag.Guard on against off (kldiag attached in both).

    python bench/guard_overhead.py                 # 5 interleaved pairs of 12-step runs
    python bench/guard_overhead.py --repeats 9 --steps 20

Both runs of a pair are examples/trl_grpo.py's tiny GRPO run (use_bias_correction_kl=True, so
the default guard, on="blowup,nonfinite", never acts) with `attach(trainer, run)`; one of
them passes `guard=kldiag.Guard()`. The order within a pair alternates and the figure is the
median over pairs of the wall-time ratio, to fight a shared machine's noise. Also printed:
the guard's own time on the training thread (observe() copies and enqueues; end_step() waits
for the worker and judges the rules), measured by wrapping those two methods, as a share of
the step time, which is the overhead that does not depend on the noise. Target: within 1%.
--synthetic also times the guard alone on LLM-sized batches (no trainer).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import trl_grpo  # (examples/trl_grpo.py: the tiny model, reward and trainer)


def instrument_guard() -> dict[str, float]:
    """Add the wall time of Guard.observe and Guard.end_step to the returned dict (seconds)."""
    from kldiag.live import guard as G

    spent = {"observe": 0.0, "end_step": 0.0}
    for name in spent:
        fn = getattr(G.Guard, name)

        def wrapper(*args, _fn=fn, _name=name, **kwargs):
            start = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                spent[_name] += time.perf_counter() - start
        setattr(G.Guard, name, functools.wraps(fn)(wrapper))
    return spent


def run_once(model_dir: Path, work: Path, guarded: bool, steps: int, seed: int) -> float:
    """Wall seconds per optimizer step of trainer.train()."""
    from transformers import PrinterCallback

    import kldiag
    from kldiag.integrations.trl import attach

    trainer = trl_grpo.make_trainer(model_dir, work / "out", steps=steps, seed=seed)
    trainer.remove_callback(PrinterCallback)
    guard = kldiag.Guard() if guarded else None
    attach(trainer, work / "run", guard=guard)
    start = time.perf_counter()
    trainer.train()
    wall = (time.perf_counter() - start) / steps
    if guard is not None and (guard.fired or guard.failed):
        raise SystemExit(f"the guard acted ({guard.fired}, {guard.failed}): not an overhead measurement")
    return wall


def synthetic(batch: int, length: int, micro: int, steps: int = 50) -> None:
    """The guard alone on LLM-sized batches: training-thread and worker milliseconds per step."""
    import numpy as np

    import kldiag
    from kldiag.live import guard as G

    rng = np.random.default_rng(0)
    logp = -rng.exponential(0.7, (batch, length)).astype(np.float32)
    ref, old = (logp - 0.01).astype(np.float32), (logp - 0.02).astype(np.float32)
    mask = np.ones((batch, length), bool)
    g = kldiag.Guard()
    thread = 0.0
    for step in range(steps):
        start = time.perf_counter()
        for _ in range(micro):
            g.observe(step, logp, ref, old, None, mask)
        thread += time.perf_counter() - start
        g._drain()  # wait for the worker out of the timing: it runs during the next forward
        start = time.perf_counter()
        g.end_step(step)
        thread += time.perf_counter() - start
    g.close()
    start = time.perf_counter()
    for _ in range(5 * micro):
        G.step_sums(*(a.astype(np.float64) for a in (logp, ref, old)), None, mask)
    worker = (time.perf_counter() - start) / 5
    tokens = batch * length * micro
    print(f"guard alone, {micro} micro-batches of {batch}x{length} ({tokens:,} tokens) per step: training thread "
          f"{thread / steps * 1e3:.2f} ms/step, worker {worker * 1e3:.1f} ms/step (off the training thread)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per run")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved (off, on) pairs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--synthetic", action="store_true",
                        help="also time the guard alone on LLM-sized batches (4 x 16 x 2048 tokens per step)")
    args = parser.parse_args(argv)
    if args.synthetic:
        synthetic(16, 2048, 4)
    if args.repeats < 1:
        return 0

    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    spent = instrument_guard()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = trl_grpo.build_tiny_model(tmp / "model", seed=args.seed)
        run_once(model_dir, tmp / "warmup", guarded=True, steps=2, seed=args.seed)  # imports, caches
        spent.update(observe=0.0, end_step=0.0)
        wall: dict[bool, list[float]] = {False: [], True: []}
        for r in range(args.repeats):
            for guarded in ((False, True) if r % 2 == 0 else (True, False)):
                wall[guarded].append(run_once(model_dir, tmp / f"{r}_{guarded}", guarded, args.steps, args.seed))
            print(f"pair {r}: guard off {wall[False][-1] * 1e3:7.1f} ms/step   on {wall[True][-1] * 1e3:7.1f} "
                  f"ms/step   ratio {wall[True][-1] / wall[False][-1]:.3f}", flush=True)
    off = statistics.median(wall[False])
    ratio = statistics.median(a / b for a, b in zip(wall[True], wall[False], strict=True))
    per_step = {k: v / (args.repeats * args.steps) * 1e3 for k, v in spent.items()}
    own = sum(per_step.values())
    print(f"\ntiny Qwen2 GRPO (k3_is), torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{args.steps} steps x {args.repeats} pairs")
    print(f"median step time: guard off {off * 1e3:.1f} ms, on {statistics.median(wall[True]) * 1e3:.1f} ms")
    print(f"guard on the training thread: observe {per_step['observe']:.3f} ms/step + end_step "
          f"{per_step['end_step']:.3f} ms/step = {own / (off * 1e3):.3%} of the step time (target <= 1%)")
    print(f"guard on / off step time: {ratio:.3f}x wall (median of {args.repeats} pair ratios)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
