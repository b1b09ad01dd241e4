"""Step time of a real TRL GRPOTrainer run with kldiag attached vs the same run without it.

    python bench/trl_overhead.py                 # 24 interleaved pairs of 30-step runs (~80 s)
    python bench/trl_overhead.py --repeats 9 --steps 30
    cd /tmp && PYTHONPATH=/path/to/other/checkout python /path/to/bench/trl_overhead.py  # another kldiag

Both runs of a pair use the same tiny model, seed and data (examples/trl_grpo.py), so they
do the same work; the order within a pair alternates, and the ratios reported are the
minimum, median and maximum over pairs, to fight and show the noise of a shared machine.
The time is trainer.train()'s wall time per optimizer step (generation, reference forward,
loss, backward, optimizer, logging, and with kldiag the host copies, the log metrics and
the background writer). Target: attached / plain within 1.05 (DESIGN.md section 5). The
tiny model makes this a worst case: kldiag's per-token cost is compared with a forward
pass of a 2-layer, 32-wide model.

Also printed, robust to other load on the machine because they are thread CPU time
(time.thread_time): the hook's work on the training thread per step (target <= 1 ms), and
the CPU the recorder's writer threads spent per step (Recorder.writer_cpu_s, when the
kldiag under test has it).
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

# The hook's work on the training thread, per micro-batch or log (everything else it does is the
# original TRL call), and its one-off close at the end of training (join the writer, publish).
# Methods the kldiag under test lacks are skipped (_wait_converted: the log's wait for the writer).
HOOK_WORK = ("_assign_seq_ids", "_capture", "_record", "_add_metrics", "_wait_converted")
HOOK_END = ("close",)


def instrument_hook() -> dict[str, float]:
    """Wrap the hook's methods to add their wall time and the training thread's CPU time to the
    returned dict (seconds: work, work_cpu, close)."""
    from kldiag.integrations import trl as kt

    spent = {"work": 0.0, "work_cpu": 0.0, "close": 0.0, "close_cpu": 0.0}

    def timed(fn, key):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            start, cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] += time.perf_counter() - start
                spent[key + "_cpu"] += time.thread_time() - cpu
        return wrapper

    for names, key in ((HOOK_WORK, "work"), (HOOK_END, "close")):
        for name in names:
            if hasattr(kt._Hook, name):
                setattr(kt._Hook, name, timed(getattr(kt._Hook, name), key))
    return spent


def run_once(model_dir: Path, work: Path, attached: bool, steps: int, seed: int,
             **options: object) -> tuple[float, float, int, float]:
    """(wall and process-CPU seconds per optimizer step of trainer.train(), token rows recorded,
    writer threads' CPU seconds per step or NaN)."""
    from transformers import PrinterCallback

    from kldiag.integrations.trl import attach

    trainer = trl_grpo.make_trainer(model_dir, work / "out", steps=steps, seed=seed)
    trainer.remove_callback(PrinterCallback)
    rec = attach(trainer, work / "run", **options) if attached else None
    wall, cpu = time.perf_counter(), time.process_time()
    trainer.train()  # with kldiag, this includes closing the recorder (publishing the last part)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    writer = float("nan") if rec is None else getattr(rec, "writer_cpu_s", None) or rec._writer.bench_cpu_s
    return wall / steps, cpu / steps, (rec.stats["rows"] if rec is not None else 0), writer / steps


def writer_cpu_clock() -> None:
    """For a kldiag without Recorder.writer_cpu_s: the writer thread notes its CPU time when it ends."""
    from kldiag import _writer as W

    run = W.Writer.run

    def timed_run(self) -> None:
        try:
            run(self)
        finally:
            self.bench_cpu_s = time.thread_time()
    W.Writer.run = timed_run


def spread(ratios: list[float]) -> str:
    return f"min {min(ratios):.3f}  median {statistics.median(ratios):.3f}  max {max(ratios):.3f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    parser.add_argument("--repeats", type=int, default=24, help="interleaved (plain, attached) pairs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--writer-nice", type=int, default=None,
                        help="Recorder(writer_nice=...): the writer threads' nice increment (0: none)")
    args = parser.parse_args(argv)

    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    spent = instrument_hook()
    import kldiag

    if not hasattr(kldiag.Recorder, "writer_cpu_s"):
        writer_cpu_clock()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = trl_grpo.build_tiny_model(tmp / "model", seed=args.seed)
        options = {} if args.writer_nice is None else {"writer_nice": args.writer_nice}
        for kind in (True, False):  # imports, caches, first-call costs of both kinds
            run_once(model_dir, tmp / f"warmup_{kind}", attached=kind, steps=2, seed=args.seed)
        spent.update(dict.fromkeys(spent, 0.0))
        wall, cpu, rows, writer, closing = {False: [], True: []}, {False: [], True: []}, 0, [], []
        for r in range(args.repeats):
            for kind in ((False, True) if r % 2 == 0 else (True, False)):
                closed = spent["close"]
                w, c, n, wcpu = run_once(model_dir, tmp / f"{r}_{kind}", kind, args.steps, args.seed, **options)
                wall[kind].append(w)
                cpu[kind].append(c)
                rows = max(rows, n)
                if kind:
                    writer.append(wcpu)
                    closing.append((spent["close"] - closed) / args.steps)
            print(f"pair {r}: plain {wall[False][-1] * 1e3:7.1f} ms/step   attached {wall[True][-1] * 1e3:7.1f} "
                  f"ms/step   wall ratio {wall[True][-1] / wall[False][-1]:.3f}   "
                  f"cpu ratio {cpu[True][-1] / cpu[False][-1]:.3f}")
    med = {k: {kind: statistics.median(v[kind]) for kind in v} for k, v in (("wall", wall), ("cpu", cpu))}
    pair = {k: [a / b for a, b in zip(v[True], v[False], strict=True)] for k, v in (("wall", wall), ("cpu", cpu))}
    no_close = [(a - c) / b for a, c, b in zip(wall[True], closing, wall[False], strict=True)]
    work_ms = spent["work"] / (args.repeats * args.steps) * 1e3
    work_cpu_ms = spent["work_cpu"] / (args.repeats * args.steps) * 1e3
    print(f"\ntiny Qwen2 GRPO, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{args.steps} steps x {args.repeats} pairs, {rows} token rows recorded per attached run")
    print(f"median step time: plain {med['wall'][False] * 1e3:.1f} ms, attached {med['wall'][True] * 1e3:.1f} ms")
    print(f"kldiag work on the training thread: {work_ms:.2f} ms/step = {work_ms / (med['wall'][False] * 1e3):.2%}"
          f" of the plain step time; closing the recorder at the end: "
          f"{spent['close'] / args.repeats * 1e3:.1f} ms per run")
    print(f"kldiag work on the training thread, thread CPU time: {work_cpu_ms:.2f} ms/step (target <= 1); "
          f"writer threads' CPU: {statistics.median(writer) * 1e3:.2f} ms/step (median over attached runs)")
    print(f"attached / plain step time, {args.repeats} pair ratios: wall {spread(pair['wall'])}; "
          f"process CPU {spread(pair['cpu'])}  (target: median wall <= 1.05)")
    print(f"the same wall ratios less the one-off close (publish, statistics, manifest; fsyncs): "
          f"{spread(no_close)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
