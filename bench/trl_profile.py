"""Where kldiag's time goes in a TRL GRPOTrainer run: thread CPU of the hook's and the writer's parts.

    python bench/trl_profile.py [--steps 100]
    cd /tmp && PYTHONPATH=/path/to/other/checkout python /path/to/bench/trl_profile.py  # another kldiag

The tiny model of examples/trl_grpo.py (2 micro-batches of [8, 12] a step). Each part is
wrapped with time.thread_time, so the figures are the CPU the calling thread spent in it,
robust to other load: the training thread's (the hook's wrappers, Recorder.record) and the
writer threads' (per micro-batch, per conversion, per published part). Parts a kldiag
checkout does not have are left out, so older commits profile too. A warm-up run of 4 steps
comes first (imports, numba's cache); the figures are of the second run.
"""

from __future__ import annotations

import argparse
import collections
import functools
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import trl_grpo  # (examples/trl_grpo.py: the tiny model, reward and trainer)

TRAIN, WRITER = "training thread: ", "writer: "


def instrument() -> tuple[dict[str, float], collections.Counter]:
    """Wrap the parts; returns (seconds, calls) by part name, filled as the run goes."""
    from kldiag.integrations import trl as kt
    from kldiag.record import recorder as R
    from kldiag.record import writer as W

    spent: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()

    def wrap(owner, name: str, key: str) -> None:
        fn = getattr(owner, name, None)
        if fn is None:
            return

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[key] += time.thread_time() - start
                calls[key] += 1
        setattr(owner, name, timed)

    for name in ("_capture", "_record", "_add_metrics", "_wait_converted", "_assign_seq_ids"):
        wrap(kt._Hook, name, TRAIN + "hook." + name)
    wrap(R.Recorder, "record", TRAIN + "  of which Recorder.record")
    wrap(kt, "batch_partials", "either thread: batch_partials (log metrics)")
    wrap(W.Writer, "_add", WRITER + "Writer._add, per micro-batch")
    wrap(kt._Hook, "_observe", WRITER + "  of which log metrics (hook._observe)")
    wrap(W, "to_record_batch", WRITER + "  of which to_record_batch")
    wrap(W, "gather_rows", WRITER + "  of which gather_rows (pooled batches)")
    wrap(W.Writer, "convert", WRITER + "convert (gather + Arrow, per 64k rows or part)")
    wrap(W.Writer, "write_part", "publisher: write_part (per part)")
    return spent, calls


def run(model_dir: Path, work: Path, steps: int):
    from transformers import PrinterCallback

    from kldiag.integrations.trl import attach

    trainer = trl_grpo.make_trainer(model_dir, work / "out", steps=steps, seed=0)
    trainer.remove_callback(PrinterCallback)
    rec = attach(trainer, work / "run")
    trainer.train()
    return rec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args(argv)
    import transformers

    transformers.logging.set_verbosity_error()
    spent, calls = instrument()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = trl_grpo.build_tiny_model(tmp / "model")
        run(model_dir, tmp / "warmup", 4)
        spent.clear()
        calls.clear()
        rec = run(model_dir, tmp / "profiled", args.steps)
    writer = getattr(rec, "writer_cpu_s", None)
    print(f"\n{args.steps} steps; thread CPU per step (and per call):")
    print(f"  writer threads, in all: {writer * 1e3 / args.steps:.3f} ms" if writer else "  writer threads: n/a")
    for key in sorted(spent, key=lambda k: (not k.startswith(TRAIN), k)):
        print(f"  {key:52s} {spent[key] * 1e3 / args.steps:7.3f} ms  "
              f"{spent[key] / calls[key] * 1e6:8.1f} us/call  ({calls[key]} calls)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
