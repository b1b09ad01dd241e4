"""Step time of a real TRL GRPOTrainer run with kldiag recording vs without.

    python bench/trl_overhead.py                       # 4 runs of 402 steps: 198 block pairs (~80 s)
    python bench/trl_overhead.py --mode runs --repeats 24 --steps 30   # whole-run pairs (the older bench)
    python bench/trl_overhead.py --every-n-steps 4 --flight-steps 4   # a sampled run with the flight ring
    python bench/trl_overhead.py --topk 20             # attach(topk=20): its blocks toggle top-k, not kldiag
    cd /tmp && PYTHONPATH=/path/to/other/checkout python /path/to/bench/trl_overhead.py  # another kldiag

Same tiny model, seed and data (examples/trl_grpo.py) in every run. The tiny model makes
this a worst case: kldiag's per-token cost is set against a forward pass of a 2-layer,
32-wide model. Target: attached / plain within 1.05 (docs/recorder.md, "Measured").

Two ways to pair "with" and "without", both reporting the min, median and max pair ratio:
- `blocks` (default): kldiag is attached to one long run and switched on and off
  (`_Hook.active`) in alternating blocks of whole generation cycles (a cycle generates once
  and spends its completions over steps_per_generation * num_iterations micro-steps); a
  pair is an on block and the off block next to it, in alternating order. On this 2-core
  VM the plain step time drifts by up to 50% over a second or so (other tenants), which
  whole-run pairs (1.5 s each) cannot cancel and adjacent 0.1 s blocks do. A block's time
  runs from its first step's start to the next block's, so it holds its logs, and with
  them each log's wait for the writer; the recorder's one-off close is amortised over the
  recorded steps in the "with close" figure.
- `runs`: whole trainer.train() runs with and without kldiag (the one-off close included).

Robust to other load on the machine because they are thread CPU time (time.thread_time):
the hook's work on the training thread per recorded step (target <= 1 ms) and the CPU of
the recorder's writer threads per recorded step.
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
    returned dict (seconds: work, work_cpu, close, close_cpu)."""
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


def writer_cpu(rec) -> float:
    """CPU seconds of the recorder's writer threads (after close)."""
    return getattr(rec, "writer_cpu_s", None) or rec._writer.bench_cpu_s


def writer_cpu_clock() -> None:
    """For a kldiag without Recorder.writer_cpu_s: the writer thread notes its CPU time when it ends."""
    from kldiag.record import writer as W

    run = W.Writer.run

    def timed_run(self) -> None:
        try:
            run(self)
        finally:
            self.bench_cpu_s = time.thread_time()
    W.Writer.run = timed_run


def trainer_for(model_dir: Path, out: Path, steps: int, seed: int):
    from transformers import PrinterCallback

    trainer = trl_grpo.make_trainer(model_dir, out, steps=steps, seed=seed)
    trainer.remove_callback(PrinterCallback)
    return trainer


def cycle_steps(trainer) -> int:
    """Optimizer steps per generation cycle (TRL GRPOTrainer._prepare_inputs)."""
    a = trainer.args
    micro = a.steps_per_generation * trainer.num_iterations
    if micro % a.gradient_accumulation_steps:
        raise SystemExit("a generation cycle is not a whole number of optimizer steps; blocks need it")
    return micro // a.gradient_accumulation_steps


def block_run(model_dir: Path, work: Path, steps: int, block: int, seed: int, first_on: bool,
              **options: object) -> dict[str, object]:
    """One attached run whose hook is on and off in alternating blocks of `block` cycles.

    Returns the (on, off) seconds of each pair of blocks but the first (first-call costs), the
    number of recorded blocks and their size in steps, the writer threads' CPU seconds and the
    rows recorded.
    """
    from transformers import TrainerCallback

    from kldiag.integrations.trl import attach

    trainer = trainer_for(model_dir, work / "out", steps, seed)
    rec = attach(trainer, work / "run", **options)
    hook = trainer._kldiag_hook
    topk = options.get("topk")
    size = block * cycle_steps(trainer)
    starts: list[float] = []

    class Toggle(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step % size == 0:  # a block begins: its state decided by its pair's order
                starts.append(time.perf_counter())
                on = _on(state.global_step // size, first_on)
                if topk:  # --topk: both blocks record; only the top-k capture is switched
                    hook.topk = topk if on else None
                else:
                    hook.active = on

    trainer.add_callback(Toggle())
    trainer.train()
    starts.append(time.perf_counter())  # the last block ends with train(): its close is timed on its own
    flight_bytes = getattr(rec, "flight_nbytes", 0)
    blocks = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    pairs = []
    for p in range(1, len(blocks) // 2):  # pair 0 holds first-call costs
        i, j = 2 * p, 2 * p + 1
        on, off = (blocks[i], blocks[j]) if _on(i, first_on) else (blocks[j], blocks[i])
        pairs.append((on, off))
    on_blocks = sum(_on(b, first_on) for b in range(len(blocks)))
    return {"pairs": pairs, "on_blocks": on_blocks, "block_steps": size, "writer_cpu": writer_cpu(rec),
            "rows": rec.stats["rows"], "flight_bytes": flight_bytes}


def _on(index: int, first_on: bool) -> bool:
    """Block `index` records: pairs alternate (on, off), (off, on), ... starting as `first_on` says."""
    on_first = (index // 2 % 2 == 0) == first_on
    return (index % 2 == 0) == on_first


def spread(ratios: list[float]) -> str:
    return f"min {min(ratios):.3f}  median {statistics.median(ratios):.3f}  max {max(ratios):.3f}"


def main_blocks(args, model_dir: Path, tmp: Path, spent: dict[str, float], options: dict) -> None:
    if args.runs % 2:
        raise SystemExit("--runs must be even: runs come in complementary couples")
    runs, on_blocks, writer, rows, closes, size = [], 0, 0.0, 0, 0.0, 1
    block_run(model_dir, tmp / "warmup", 4 * 2 * args.block, args.block, args.seed, True, **options)
    spent.update(dict.fromkeys(spent, 0.0))
    for r in range(args.runs):
        closed = spent["close"]
        out = block_run(model_dir, tmp / f"run{r}", args.steps, args.block, args.seed, r % 2 == 0, **options)
        closes += spent["close"] - closed
        runs.append(out["pairs"])
        on_blocks += out["on_blocks"]
        size = out["block_steps"]
        writer += out["writer_cpu"]
        rows += out["rows"]
        ring = f", flight ring {out['flight_bytes'] / 1e6:.2f} MB" if out.get("flight_bytes") else ""
        print(f"run {r}: {len(out['pairs'])} block pairs, on/off {spread([a / b for a, b in out['pairs']])}{ring}",
              flush=True)
    ratios = couple_ratios(runs)
    on, off = (sum(p[k] for pairs in runs for p in pairs) for k in (0, 1))
    report(args, spent, on_blocks * size, writer, rows, off / (sum(map(len, runs)) * size) * 1e3)
    what = f"top-k {args.topk} on / off (both recording)" if args.topk else "on / off"
    print(f"{what}, {len(ratios)} pairs of {args.block} cycle(s) ({size} steps) over complementary runs: "
          f"{spread(ratios)}  (target: median <= 1.05)")
    print(f"total on / total off: {on / off:.3f}; with the recorder's one-off close amortised over the "
          f"recorded blocks: {(on + closes * sum(map(len, runs)) / on_blocks) / off:.3f}")


def couple_ratios(runs: list[list[tuple[float, float]]]) -> list[float]:
    """sqrt(r_a * r_b) per pair index of each couple of complementary runs (r: on / off).

    Runs are deterministic (same seed, same data), so a block's own work w differs from its
    neighbour's only by its data: in run a the pair gives r_a = o * w1 / w2, in run b (the
    other block recording) r_b = o * w2 / w1, and the product cancels the data, leaving o^2.
    Adjacent blocks (0.1 s apart) cancel the machine's drift.
    """
    out = []
    for a, b in zip(runs[::2], runs[1::2], strict=True):
        out += [(ra_on / ra_off * rb_on / rb_off) ** 0.5 for (ra_on, ra_off), (rb_on, rb_off) in zip(a, b, strict=True)]
    return out


def report(args, spent: dict[str, float], recorded: int, writer: float, rows: int, plain_ms: float) -> None:
    import torch

    work_ms = spent["work_cpu"] / recorded * 1e3
    print(f"\ntiny Qwen2 GRPO, torch {torch.__version__}, {torch.get_num_threads()} threads, mode {args.mode}; "
          f"{recorded} recorded steps, {rows} token rows; plain step ~{plain_ms:.1f} ms")
    print(f"kldiag work on the training thread, thread CPU: {work_ms:.2f} ms per recorded step (target <= 1), "
          f"wall {spent['work'] / recorded * 1e3:.2f} ms; writer threads' CPU: {writer / recorded * 1e3:.2f} ms "
          f"per recorded step")


def run_once(model_dir: Path, work: Path, attached: bool, steps: int, seed: int,
             **options: object) -> tuple[float, float, int, float]:
    """(wall and process-CPU seconds per step of trainer.train(), token rows, writer CPU seconds)."""
    from kldiag.integrations.trl import attach

    trainer = trainer_for(model_dir, work / "out", steps, seed)
    rec = attach(trainer, work / "run", **options) if attached else None
    wall, cpu = time.perf_counter(), time.process_time()
    trainer.train()  # with kldiag, this includes closing the recorder (publishing the last part)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return wall / steps, cpu / steps, (rec.stats["rows"] if rec else 0), (writer_cpu(rec) if rec else 0.0)


def main_runs(args, model_dir: Path, tmp: Path, spent: dict[str, float], options: dict) -> None:
    for kind in (True, False):  # imports, caches, first-call costs of both kinds
        run_once(model_dir, tmp / f"warmup_{kind}", attached=kind, steps=2, seed=args.seed)
    spent.update(dict.fromkeys(spent, 0.0))
    wall, cpu, rows, writer = {False: [], True: []}, {False: [], True: []}, 0, 0.0
    for r in range(args.repeats):
        for kind in ((False, True) if r % 2 == 0 else (True, False)):
            w, c, n, wcpu = run_once(model_dir, tmp / f"{r}_{kind}", kind, args.steps, args.seed, **options)
            wall[kind].append(w)
            cpu[kind].append(c)
            rows, writer = max(rows, n), writer + wcpu
        print(f"pair {r}: plain {wall[False][-1] * 1e3:6.1f} ms/step  attached {wall[True][-1] * 1e3:6.1f} ms/step"
              f"  wall ratio {wall[True][-1] / wall[False][-1]:.3f}", flush=True)
    report(args, spent, args.repeats * args.steps, writer, rows, statistics.median(wall[False]) * 1e3)
    for name, v in (("wall", wall), ("process CPU", cpu)):
        print(f"attached / plain, {args.repeats} run pairs, {name}: "
              f"{spread([a / b for a, b in zip(v[True], v[False], strict=True)])}")
    print(f"closing the recorder at the end: {spent['close'] / args.repeats * 1e3:.1f} ms per run")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("blocks", "runs"), default="blocks")
    parser.add_argument("--steps", type=int, default=None,
                        help="optimizer steps per run (default: 402 in blocks mode, 30 in runs mode)")
    parser.add_argument("--runs", type=int, default=4, help="blocks mode: attached runs (couples of complements)")
    parser.add_argument("--block", type=int, default=1, help="blocks mode: generation cycles per block")
    parser.add_argument("--repeats", type=int, default=24, help="runs mode: interleaved (plain, attached) pairs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--writer-nice", type=int, default=None,
                        help="Recorder(writer_nice=...): the publishing thread's nice increment (0: none)")
    parser.add_argument("--every-n-steps", type=int, default=None, help="Recorder(every_n_steps=...): sample steps")
    parser.add_argument("--flight-steps", type=int, default=None,
                        help="Recorder(flight_steps=...): the flight recorder's ring (with --every-n-steps)")
    parser.add_argument("--topk", type=int, default=None,
                        help="attach(topk=K); blocks mode then pairs top-k on / top-k off, both recording")
    args = parser.parse_args(argv)
    args.steps = args.steps or (402 if args.mode == "blocks" else 30)

    import transformers

    transformers.logging.set_verbosity_error()
    spent = instrument_hook()
    import kldiag

    if not hasattr(kldiag.Recorder, "writer_cpu_s"):
        writer_cpu_clock()
    options = {k: v for k, v in (("writer_nice", args.writer_nice), ("every_n_steps", args.every_n_steps),
                                 ("flight_steps", args.flight_steps), ("topk", args.topk)) if v is not None}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = trl_grpo.build_tiny_model(tmp / "model", seed=args.seed)
        (main_blocks if args.mode == "blocks" else main_runs)(args, model_dir, tmp, spent, options)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
