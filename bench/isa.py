"""The compiled reduce's cost per instruction set, on this one machine: what a CPU without AVX-512 pays.

    python bench/isa.py                     # host and znver3 (AVX2, AMD Zen 3) targets
    python bench/isa.py --targets host,haswell,znver3,x86-64-v2 --tokens 2e6

numba compiles kldiag's kernels for the host CPU (bench/machine.py). A run timed on two machines mixes two
things: the CPU and the code numba made for it. This script separates them: each target is compiled here, in a
fresh process with NUMBA_CPU_NAME and NUMBA_CPU_FEATURES="" (LLVM's features of that CPU, not the host's) and
its own numba cache, and runs on this CPU; every instruction set the target uses must be one this CPU has.
On the same batches, decoded once and held in memory, each process times (thread CPU time, the least of
--repeat: the figure holds on a loaded machine):
- fused_pass: the analysis's compiled pass alone (kldiag.analysis.kernels.fused);
- the analysis's reduce: its reducer's fold of the batches (the pass and the Python around it);
- the dashboard's first pass: the analysis and every reducer kldiag.views.dashboard.reducers() gives, in one fold.
Printed in ns a row, and as a ratio to the host target measured in the same run.

Each target compiles every kernel once (about two minutes a target here).

Figures on an Intel Xeon with AVX-512, numba 0.68.1 (`python bench/isa.py --targets host,haswell,znver3,x86-64-v2
--tokens 2e6 --repeat 3`, on a machine shared with other jobs), ns a row:

    target      fused_pass  analysis  dashboard first pass
    host        14.8        24.6      125.9
    haswell     20.3        31.1      138.4   (AVX2: 1.37x, 1.26x, 1.10x the host's)
    znver3      18.4        28.1      146.9   (AVX2: 1.24x, 1.14x, 1.17x)
    x86-64-v2   38.9        47.6      197.1   (SSE4.2: 2.63x, 1.93x, 1.57x)

Without AVX-512 the pass's loop keeps its 21 vector accumulators in 16 registers, not 32: it spills (470
stack references in its body against 91), and 64-bit integer maxima and selects take two instructions each.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from kldiag.tools.synth import SynthConfig, make_run

import machine  # bench/machine.py, next to this script

TARGETS = {"host": None, "haswell": "haswell", "znver3": "znver3", "x86-64-v2": "x86-64-v2"}
TARGET_FLAGS = {"haswell": "avx2", "znver3": "avx2", "x86-64-v2": "sse4_2"}  # what the CPU must list to run it

CHILD = """
import json, sys, time
from kldiag.analysis import AnalysisConfig
from kldiag.analysis.core import partials, stats
from kldiag.analysis.core.batch import Batch
from kldiag.analysis.kernels import fused, scans
from kldiag.analysis.pipeline import thresholds
from kldiag.analysis.runtime import part_fold, runner
from kldiag.format import open_run
from kldiag.views import dashboard
run, repeat = sys.argv[1], int(sys.argv[2])
r = open_run(run)
th = thresholds(AnalysisConfig(), r.manifest)
first = [partials.AnalysisReducer(th)] + [runner.bound(x, r.parts()) for x in dashboard.reducers()]
cols = part_fold.union_columns(first)
data = [(p, list(part_fold.part_batches(p, cols, runner.KERNEL_ROWS))) for p in r.parts()]
n = sum(b.num_rows for _, bs in data for b in bs)
prep = []
for _, bs in data:
    for batch in bs:
        b = Batch.from_arrow(batch)
        starts, _ = scans.seq_starts(b.step, b.seq)
        sidx, n_steps = scans.step_of_seqs(b.step, starts)
        prep.append((starts, sidx, n_steps, stats.kernel_inputs(b)))
import numpy as np
params = np.array([np.log(th.tau), th.weight_limit, th.clamp, 1.0 - th.clip_low, 1.0 + th.clip_high])

def kernel():
    for starts, sidx, n_steps, inp in prep:
        fused.fused_pass(starts, sidx, n_steps, *inp, params, stats.ABS_GRID, stats.D_GRID)

def fold(group):
    def go():
        for p, bs in data:
            f = part_fold.PartFold(p, group)
            for b in bs:
                f.add(b)
            f.finish()
    return go

def least(fn):
    fn()  # compiled (or loaded from this target's cache) before the clock starts
    times = []
    for _ in range(repeat):
        c = time.thread_time()
        fn()
        times.append(time.thread_time() - c)
    return min(times) / n * 1e9

print(json.dumps({"rows": n, "fused_pass": least(kernel), "analysis": least(fold(first[:1])),
                  "first_pass": least(fold(first))}))
"""


def measure(run: Path, target: str, repeat: int, cache: Path) -> dict:
    """One fresh process compiled for `target`: its figures (ns a row)."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache / target))
    if TARGETS[target]:
        env.update(NUMBA_CPU_NAME=TARGETS[target], NUMBA_CPU_FEATURES="")
    out = subprocess.run([sys.executable, "-c", CHILD, str(run), str(repeat)], env=env, check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=float, default=4e6)
    ap.add_argument("--targets", default="host,znver3", help=f"comma-separated, of {', '.join(TARGETS)}")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    print("\n".join(machine.machine_lines()))
    _, flags = machine.cpu_info()
    targets = []
    for t in args.targets.split(","):
        if t not in TARGETS:
            raise SystemExit(f"unknown target {t!r}: use {', '.join(TARGETS)}")
        if TARGET_FLAGS.get(t) and TARGET_FLAGS[t] not in flags:
            print(f"{t}: skipped, this CPU lacks {TARGET_FLAGS[t]}")
            continue
        targets.append(t)
    seqs, mean_len = 200, 250
    steps = max(1, int(args.tokens / (seqs * mean_len)))
    with tempfile.TemporaryDirectory(prefix="kldiag-isa-") as tmp:
        run = Path(tmp) / "run"
        make_run(run, SynthConfig(steps=steps, seqs_per_step=seqs, seq_len=(150, 350), micro_batches=4))
        got = {t: measure(run, t, args.repeat, Path(tmp)) for t in targets}
    base = got.get("host")
    print(f"{next(iter(got.values()))['rows'] / 1e6:.1f}M rows; thread CPU ns a row, the least of {args.repeat}")
    for t, g in got.items():
        ratios = "" if base is None or t == "host" else "  (" + ", ".join(
            f"{g[k] / base[k]:.2f}x" for k in ("fused_pass", "analysis", "first_pass")) + " the host's)"
        print(f"  {t:10s} fused_pass {g['fused_pass']:6.1f}  analysis {g['analysis']:6.1f}  "
              f"dashboard first pass {g['first_pass']:6.1f}{ratios}")


if __name__ == "__main__":
    main()
