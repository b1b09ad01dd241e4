"""Step time of a real TRL GRPOTrainer run with kldiag attached vs the same run without it.

    python bench/trl_overhead.py                 # 5 interleaved pairs of 12-step runs
    python bench/trl_overhead.py --repeats 9 --steps 20

Both runs of a pair use the same tiny model, seed and data (examples/trl_grpo.py), so they
do the same work; the order within a pair alternates, and the ratio reported is the median
over pairs, to fight the noise of a shared machine. The time is trainer.train()'s wall time
per optimizer step (generation, reference forward, loss, backward, optimizer, logging,
and with kldiag the host copies, the log metrics and the background writer). Target:
attached / plain within 1.05 (DESIGN.md section 5). The tiny model makes this a worst
case: kldiag's per-token cost is compared with a forward pass of a 2-layer, 32-wide model.
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

# The hook's work on the training thread (everything else it does is the original TRL call).
HOOK_WORK = ("_assign_seq_ids", "_capture", "_record", "_add_metrics", "close")


def instrument_hook() -> dict[str, float]:
    """Wrap the hook's work methods to add their wall time to the returned dict (seconds)."""
    from kldiag.integrations import trl as kt

    spent = {"seconds": 0.0}

    def timed(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent["seconds"] += time.perf_counter() - start
        return wrapper

    for name in HOOK_WORK:
        setattr(kt._Hook, name, timed(getattr(kt._Hook, name)))
    return spent


def run_once(model_dir: Path, work: Path, attached: bool, steps: int, seed: int) -> tuple[float, int]:
    """(wall seconds per optimizer step of trainer.train(), token rows recorded)."""
    from transformers import PrinterCallback

    from kldiag.integrations.trl import attach

    trainer = trl_grpo.make_trainer(model_dir, work / "out", steps=steps, seed=seed)
    trainer.remove_callback(PrinterCallback)
    rec = attach(trainer, work / "run") if attached else None
    start = time.perf_counter()
    trainer.train()  # with kldiag, this includes closing the recorder (publishing the last part)
    elapsed = time.perf_counter() - start
    return elapsed / steps, (rec.stats["rows"] if rec is not None else 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per run")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved (plain, attached) pairs")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    spent = instrument_hook()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = trl_grpo.build_tiny_model(tmp / "model", seed=args.seed)
        run_once(model_dir, tmp / "warmup", attached=True, steps=2, seed=args.seed)  # imports, caches
        spent["seconds"] = 0.0
        ratios, plain, attached, rows = [], [], [], 0
        for r in range(args.repeats):
            times = {}
            for kind in ((False, True) if r % 2 == 0 else (True, False)):
                times[kind], n = run_once(model_dir, tmp / f"{r}_{kind}", kind, args.steps, args.seed)
                rows = max(rows, n)
            plain.append(times[False])
            attached.append(times[True])
            ratios.append(times[True] / times[False])
            print(f"pair {r}: plain {times[False] * 1e3:7.1f} ms/step   attached {times[True] * 1e3:7.1f} ms/step"
                  f"   ratio {ratios[-1]:.3f}")
    hook_ms = spent["seconds"] / (args.repeats * args.steps) * 1e3
    print(f"\ntiny Qwen2 GRPO, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{args.steps} steps x {args.repeats} pairs, {rows} token rows recorded per attached run")
    print(f"median step time: plain {statistics.median(plain) * 1e3:.1f} ms, "
          f"attached {statistics.median(attached) * 1e3:.1f} ms")
    print(f"kldiag work on the training thread: {hook_ms:.2f} ms/step = "
          f"{hook_ms / (statistics.median(attached) * 1e3):.2%} of the attached step time")
    print(f"attached / plain step time: {statistics.median(ratios):.3f}x (median of pair ratios; "
          f"min {min(ratios):.3f}, max {max(ratios):.3f}; target <= 1.05)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
