"""Peak memory of the Ray driver against the number of parts, and the partial sizes behind the
driver-memory projection of docs/scale.md.

    .venv/bin/python bench/ray_memory.py                              # this tree
    .venv/bin/python bench/ray_memory.py --before /tmp/kl_before      # and another checkout, interleaved
    .venv/bin/python bench/ray_memory.py --parts 16,64 --ranks 8 --big /tmp/kldiag_bench_dash_300m

Runs (kldiag.tools.synth, written once under --root and reused):
- `p<N>`: one rank, N parts of one step each (64 sequences of 100-299 tokens a step, about 12.8k
  rows a part): the per-part partial is mostly its top-1000 tokens, the merged one grows with steps
  and sequences;
- `r<R>`: R ranks, 64 steps, 16 steps a part (4 parts a rank): (step, rank) rows grow with R; analysed
  with per_rank off and on;
- `--big RUN`: any run (e.g. bench/dashboard.py's 300M-row run), for the driver's memory against the
  merged partial's size.

Each analysis runs in a fresh driver process (`kldiag.analyze(RUN, AnalysisConfig(engine="ray",
use_cache=...))` on a local Ray of --cpus CPUs started before the measurement; the workers' kldiag is
checked to be the checkout's). Printed per run: the driver's RSS after ray.init and a warm-up task,
its peak during the analysis (psutil, sampled every 5 ms; ru_maxrss too) and the growth between them.
Partial sizes come from this tree (kldiag.analysis.partials), by table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent

DRIVER = """
import json, os, resource, shutil, sys, threading, time
import psutil
run, spec = sys.argv[1], json.loads(sys.argv[2])
import kldiag, ray
ray.init(num_cpus=spec["cpus"], include_dashboard=False, logging_level="ERROR", log_to_driver=False)
worker_kldiag = ray.get(ray.remote(lambda: __import__("kldiag").__file__).remote())
if spec["cache"]:
    shutil.rmtree(os.path.join(run, ".kldiag"), ignore_errors=True)
proc = psutil.Process()
base = proc.memory_info().rss
peak, stop = [base], threading.Event()
def sample():
    while not stop.is_set():
        peak[0] = max(peak[0], proc.memory_info().rss)
        time.sleep(0.005)
th = threading.Thread(target=sample, daemon=True)
th.start()
t = time.perf_counter()
a = kldiag.analyze(run, kldiag.AnalysisConfig(engine="ray", use_cache=spec["cache"], per_rank=spec["per_rank"]))
seconds = time.perf_counter() - t
stop.set(); th.join()
peak[0] = max(peak[0], proc.memory_info().rss)
print(json.dumps({"kldiag": kldiag.__file__, "worker_kldiag": worker_kldiag, "base_mb": base / 2**20,
                  "peak_mb": peak[0] / 2**20, "ru_maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "seconds": seconds, "rows": a.info["rows"], "steps": a.steps.num_rows,
                  "sequences": a.sequences.num_rows, "files": a.files}))
ray.shutdown()
"""


def load() -> str:
    return " ".join(open("/proc/loadavg").read().split()[:3])


def make_runs(root: Path, parts: list[int], ranks: list[int]) -> dict[str, tuple[Path, dict]]:
    from kldiag.tools.synth import SynthConfig, make_run

    runs = {}
    for n in parts:
        cfg = SynthConfig(steps=n, seqs_per_step=64, seq_len=(100, 300), vocab_size=0, blowup_step=n // 2,
                          blowup_frac=0.001, rows_per_file=1, seed=3)
        runs[f"p{n}"] = (root / f"p{n}", cfg)
    for r in ranks:
        cfg = SynthConfig(steps=64, ranks=r, seqs_per_step=16, seq_len=(100, 300), vocab_size=0, blowup_step=32,
                          blowup_frac=0.001, rows_per_file=16 * 16 * 200, seed=3)
        runs[f"r{r}"] = (root / f"r{r}", cfg)
    for name, (path, cfg) in runs.items():
        if not (path / "run.json").exists():
            shutil.rmtree(path, ignore_errors=True)
            make_run(path, cfg)
    return runs


def sizes(run: Path) -> dict:
    """Per-part and merged partial sizes (bytes by table) of this tree's analysis reducer."""
    from kldiag.analysis import AnalysisConfig, partials
    from kldiag.analysis.engine import thresholds
    from kldiag.format import open_run

    r = open_run(run)
    th = thresholds(AnalysisConfig(), r.manifest)
    ps = [partials.compute_part(p, th, 1 << 20) for p in r.parts()]
    merged = partials.merge(ps, th.top_k)

    def nbytes(p, t):
        return sum(a.nbytes for a in getattr(p, t).values())

    def nrows(p, t):
        table = getattr(p, t)
        return len(next(iter(table.values()))) if table else 0

    out = {"parts": len(ps), "rows": sum(p.rows for p in ps)}
    for t in partials.TABLES:
        out[f"part_{t}_bytes"] = statistics.mean(nbytes(p, t) for p in ps)
        out[f"merged_{t}_bytes"] = nbytes(merged, t)
        out[f"merged_{t}_rows"] = nrows(merged, t)
    out["part_bytes"] = sum(out[f"part_{t}_bytes"] for t in partials.TABLES)
    out["merged_bytes"] = sum(out[f"merged_{t}_bytes"] for t in partials.TABLES)
    return out


def drive(checkout: Path, run: Path, cpus: int, cache: bool, per_rank: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    spec = json.dumps({"cpus": cpus, "cache": cache, "per_rank": per_rank})
    out = subprocess.run([sys.executable, "-c", DRIVER, str(run), spec], env=env, cwd="/", capture_output=True,
                         text=True)
    if out.returncode:
        raise SystemExit(f"driver failed ({out.returncode}): {out.stderr[-3000:]}")
    f = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("kldiag", "worker_kldiag"):
        if not f[key].startswith(str(checkout) + "/"):
            raise SystemExit(f"{key} is {f[key]}, not from {checkout}")
    f["load"] = load()
    return f


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, default=Path("/tmp/kldiag_bench_raymem"))
    ap.add_argument("--parts", default="16,64,256,1024")
    ap.add_argument("--ranks", default="8,64", help="R of the multi-rank runs (per_rank off and on)")
    ap.add_argument("--big", type=Path, action="append", default=[], help="also this run (no per_rank variant)")
    ap.add_argument("--before", type=Path, help="another checkout, measured interleaved with this one")
    ap.add_argument("--cpus", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--cache", action="store_true", help="use_cache=True on a fresh cache (default: no cache)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    parts = [int(x) for x in args.parts.split(",") if x]
    ranks = [int(x) for x in args.ranks.split(",") if x]
    runs = make_runs(args.root, parts, ranks)
    todo = [(name, path, False) for name, (path, _) in runs.items()]
    todo += [(f"r{r}", runs[f"r{r}"][0], True) for r in ranks]
    todo += [(p.name, p, False) for p in args.big]
    checkouts = [("after", ROOT)] + ([("before", args.before.resolve())] if args.before else [])
    print(f"load average at start {load()}; local Ray with {args.cpus} CPUs; use_cache={args.cache}", flush=True)
    results = []
    for name, path, per_rank in todo:
        size = sizes(path)
        print(f"\n{name} ({path}): {size['rows'] / 1e6:.2f}M rows in {size['parts']} parts; partial per part "
              f"{size['part_bytes'] / 1e3:.0f} kB ({size['part_bytes'] / (size['rows'] / size['parts']):.2f} B/row; "
              f"top {size['part_top_bytes'] / 1e3:.0f} kB, steps {size['part_steps_bytes'] / 1e3:.1f} kB, "
              f"seqs {size['part_seqs_bytes'] / 1e3:.1f} kB); merged {size['merged_bytes'] / 1e6:.1f} MB "
              f"({size['merged_steps_rows']} (step, rank) rows x "
              f"{size['merged_steps_bytes'] / max(size['merged_steps_rows'], 1):.0f} B, "
              f"{size['merged_seqs_rows']} (step, seq) rows x "
              f"{size['merged_seqs_bytes'] / max(size['merged_seqs_rows'], 1):.0f} B)", flush=True)
        for rep in range(args.repeat):
            for label, checkout in (checkouts if rep % 2 == 0 else checkouts[::-1]):
                f = drive(checkout, path, args.cpus, args.cache, per_rank)
                f.update(run=name, checkout=label, per_rank=per_rank, repeat=rep, **size)
                results.append(f)
                print(f"  {label:6s} per_rank={per_rank!s:5s} #{rep + 1}: driver RSS {f['base_mb']:.0f} MB after "
                      f"ray.init, peak {f['peak_mb']:.0f} MB (ru_maxrss {f['ru_maxrss_mb']:.0f}): +"
                      f"{f['peak_mb'] - f['base_mb']:.0f} MB in {f['seconds']:.1f} s; load {f['load']}", flush=True)
    print("\n| run | parts | rows | per_rank | merged partial MB | " +
          " | ".join(f"{c} peak growth MB (min / median)" for c, _ in checkouts) + " |")
    print("|---|---|---|---|---|" + "---|" * len(checkouts))
    for name, _, per_rank in todo:
        rs = [r for r in results if r["run"] == name and r["per_rank"] == per_rank]
        cells = []
        for c, _ in checkouts:
            growth = [r["peak_mb"] - r["base_mb"] for r in rs if r["checkout"] == c]
            cells.append(f"{min(growth):.0f} / {statistics.median(growth):.0f}")
        r0 = rs[0]
        print(f"| {name} | {r0['parts']} | {r0['rows'] / 1e6:.2f}M | {per_rank} | {r0['merged_bytes'] / 1e6:.1f} | "
              + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=float))


if __name__ == "__main__":
    main()
