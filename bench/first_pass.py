"""What each reducer of the dashboard's first pass adds to the analysis's reduce, decode left out.

    python bench/first_pass.py [--run /tmp/kldiag_bench_dash] [--parts 6] [--repeat 3]

The run is bench/dashboard.py's (30M rows: `python bench/dashboard.py --scale --cold-only --repeat 1` writes
it once and keeps it). The first --parts parts are decoded once, with every column the first pass reads,
and held in memory; then, on those batches, one thread (thread CPU time, the least of --repeat: the figure holds
on a loaded machine), in ns a row:
- the analysis's own reduce (kldiag.analysis.core.partials.AnalysisReducer);
- each reducer of kldiag.views.dashboard.reducers() alone: its marginal cost in the first pass (the estimators'
  reducer alone: in the first pass it rides in the analysis's compiled loop and costs less, see the last line);
- the whole first pass in one fold, and its ratio to the analysis's reduce.
bench/dashboard.py --breakdown gives the same with each reducer's decode included, and the end-to-end ratios.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from kldiag.analysis import AnalysisConfig
from kldiag.analysis.core import partials
from kldiag.analysis.pipeline import thresholds
from kldiag.analysis.runtime import part_fold, runner
from kldiag.format import open_run
from kldiag.views import dashboard


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", default="/tmp/kldiag_bench_dash")
    ap.add_argument("--parts", type=int, default=6)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    if not Path(args.run).exists():
        raise SystemExit(f"{args.run} does not exist: write it with `python bench/dashboard.py --scale --cold-only "
                         f"--repeat 1 --run {args.run}`")
    r = open_run(args.run)
    th = thresholds(AnalysisConfig(), r.manifest)
    first = [partials.AnalysisReducer(th)] + [runner.bound(x, r.parts()) for x in dashboard.reducers()]
    columns = part_fold.union_columns(first)
    data = [(p, list(part_fold.part_batches(p, columns, runner.KERNEL_ROWS))) for p in r.parts()[:args.parts]]
    n = sum(b.num_rows for _, bs in data for b in bs)

    def fold(group) -> None:
        for part, batches in data:
            f = part_fold.PartFold(part, group)
            for b in batches:
                f.add(b)
            f.finish()

    def least(group) -> float:
        times = []
        for _ in range(max(args.repeat, 1)):
            c = time.thread_time()
            fold(group)
            times.append(time.thread_time() - c)
        return min(times) / n * 1e9

    fold(first)  # numba's kernels compiled or loaded before the clock starts
    base = least(first[:1])
    print(f"{args.run}: {n / 1e6:.1f}M rows in {len(data)} parts, decoded once; thread CPU ns a row, "
          f"the least of {args.repeat}")
    print(f"  {'the analysis (reduce)':28s} {base:6.1f}")
    total = 0.0
    for red in first[1:]:
        c = least([red])
        total += c
        print(f"  {red.name + ' alone':28s} {c:6.1f}")
    every = least(first)
    print(f"  {'their sum':28s} {total:6.1f}")
    print(f"  {'the first pass, one fold':28s} {every:6.1f}  ({every / base:.2f}x the analysis's reduce)")


if __name__ == "__main__":
    main()
