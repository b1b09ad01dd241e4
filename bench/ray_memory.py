"""Peak memory of the Ray driver against the number of parts, and the partial sizes behind the
driver-memory projection of docs/scale.md.

    .venv/bin/python bench/ray_memory.py                              # this tree
    .venv/bin/python bench/ray_memory.py --before /tmp/kl_before      # and another checkout, interleaved
    .venv/bin/python bench/ray_memory.py --parts 16,64 --ranks 8 --big /tmp/kldiag_bench_dash_300m
    .venv/bin/python bench/ray_memory.py --stream      # only: the streaming merge's time with R ranks

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
its peak during the analysis (VmHWM of /proc/self/status: ru_maxrss would include the parent's RSS at
fork, which Linux keeps across exec) and the growth between them; sampled every 5 ms, how much of it
was anonymous memory and how much shared memory (Ray's object store, mapped by ray.get).
Partial sizes come from this tree (kldiag.analysis.core.partials), by table; with the cache, the bytes of the
sequence rows the merge spilled to chunk files (kldiag/analysis/core/spill.py) come with each measurement.
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

from part_opens import commit  # a sibling script: the checkout's commit, and whether kldiag/ is dirty

ROOT = Path(__file__).resolve().parent.parent

DRIVER = """
import json, os, re, shutil, sys, threading, time
from pathlib import Path
run, spec = sys.argv[1], json.loads(sys.argv[2])
import kldiag, ray

def status():
    # VmHWM: this process's own peak (ru_maxrss would include the parent's RSS at fork: Linux keeps it across exec)
    text = open("/proc/self/status").read()
    return {k: int(re.search(k + r":\\s+(\\d+) kB", text).group(1)) / 1024
            for k in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")}

ray.init(num_cpus=spec["cpus"], include_dashboard=False, logging_level="ERROR", log_to_driver=False)
worker_kldiag = ray.get(ray.remote(lambda: __import__("kldiag").__file__).remote())
# warm-up on a tiny run: imports, Ray workers started, the task function shipped
kldiag.analyze(spec["warmup"], kldiag.AnalysisConfig(engine="ray", use_cache=False, per_rank=spec["per_rank"]))
if spec["cache"]:
    shutil.rmtree(os.path.join(run, ".kldiag"), ignore_errors=True)
base = status()
peak, stop = dict(base), threading.Event()
def sample():
    while not stop.is_set():
        for k, v in status().items():
            peak[k] = max(peak[k], v)
        time.sleep(0.005)
th = threading.Thread(target=sample, daemon=True)
th.start()
t = time.perf_counter()
a = kldiag.analyze(run, kldiag.AnalysisConfig(engine="ray", use_cache=spec["cache"], per_rank=spec["per_rank"]))
seconds = time.perf_counter() - t
stop.set(); th.join()
end = status()
print(json.dumps({"kldiag": kldiag.__file__, "worker_kldiag": worker_kldiag, "base_mb": base["VmRSS"],
                  "base_anon": base["RssAnon"], "base_shmem": base["RssShmem"],
                  "base_hwm_mb": base["VmHWM"], "peak_mb": end["VmHWM"], "sampled": peak, "end": end,
                  "seconds": seconds, "rows": a.info["rows"], "steps": a.steps.num_rows,
                  "sequences": a.sequence_count if hasattr(type(a), "sequence_count") else a.sequences.num_rows,
                  "files": a.files, "chunk_files_mb": sum(f.stat().st_size for f in
                                                          Path(run, ".kldiag", "prefix", "seqs").glob("*.seqs")) / 1e6}))
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
    for path, cfg in runs.values():
        if not (path / "run.json").exists():
            shutil.rmtree(path, ignore_errors=True)
            make_run(path, cfg)
    return runs


def sizes(run: Path, per_rank: bool) -> dict:
    """Per-part and merged partial sizes (bytes by table) of this tree's analysis reducer."""
    from kldiag.analysis import AnalysisConfig
    from kldiag.analysis.core import partials
    from kldiag.analysis.pipeline import thresholds
    from kldiag.analysis.runtime import part_fold
    from kldiag.format import open_run

    r = open_run(run)
    th = thresholds(AnalysisConfig(per_rank=per_rank), r.manifest)
    ps = [part_fold.partial_of(p, th, 1 << 20) for p in r.parts()]
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


def drive(checkout: Path, run: Path, cpus: int, cache: bool, per_rank: bool, warmup: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    spec = json.dumps({"cpus": cpus, "cache": cache, "per_rank": per_rank, "warmup": str(warmup)})
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


def stream_test(root: Path, cases: str) -> None:
    """prefix.Stream against one merge of the same partials when R ranks' parts cover the same steps.

    Partials are copies of one real one-step partial (p16's first part) moved to other steps, ranks
    merged (per_rank off); each part holds 4 steps of one rank, parts listed by first step as a run's
    listing has them, so about R partials are open at any time."""
    import time
    from dataclasses import dataclass

    import numpy as np

    from kldiag.analysis import AnalysisConfig
    from kldiag.analysis.cache import prefix
    from kldiag.analysis.core import partials
    from kldiag.analysis.pipeline import thresholds
    from kldiag.analysis.runtime import part_fold
    from kldiag.format import open_run

    r = open_run(root / "p16")
    th = thresholds(AnalysisConfig(), r.manifest)
    proto = part_fold.partial_of(r.parts()[0], th, 1 << 20)

    @dataclass
    class Listed:  # what Stream reads of a part
        step_min: int
        step_max: int

    def moved(step: int, seq0: int) -> partials.Partial:
        steps = {**proto.steps, "step": np.full_like(proto.steps["step"], step)}
        seqs = {**proto.seqs, "step": np.full_like(proto.seqs["step"], step),
                "seq": proto.seqs["seq"] - proto.seqs["seq"].min() + seq0}
        return partials.Partial(steps, seqs, proto.top, proto.bad, {}, proto.rows)

    print(f"prefix.Stream, SEAL_EVERY={prefix.SEAL_EVERY}; load {load()}")
    for case in cases.split(","):
        ranks, n = (int(x) for x in case.split("x"))
        listed, ps = [], []
        for block in range(n // ranks):
            for rank in range(ranks):
                s0 = block * 4
                listed.append(Listed(s0, s0 + 3))
                ps.append(partials.merge([moved(s0 + k, ((s0 + k) * ranks + rank) * 64) for k in range(4)], th.top_k))
        t = time.perf_counter()
        stream = prefix.Stream(listed, th.top_k)
        for i, p in enumerate(ps):
            stream.add(i, p)
        got = stream.result()
        stream_s = time.perf_counter() - t
        t = time.perf_counter()
        want = partials.merge(ps, th.top_k)
        merge_s = time.perf_counter() - t
        equal = all(np.array_equal(got.seqs[c], want.seqs[c], equal_nan=True) for c in want.seqs)
        print(f"  R = {ranks:5d}, {len(ps):5d} parts of 4 steps: Stream {stream_s:7.2f} s, one merge {merge_s:5.2f} s, "
              f"equal {equal}; {len(stream.open)} partials open at the end; load {load()}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", type=Path, default=Path("/tmp/kldiag_bench_raymem"))
    ap.add_argument("--parts", default="16,64,256,1024")
    ap.add_argument("--ranks", default="8,64", help="R of the multi-rank runs (per_rank off and on)")
    ap.add_argument("--big", type=Path, action="append", default=[], help="also this run (per_rank off)")
    ap.add_argument("--before", type=Path, help="another checkout, measured interleaved with this one")
    ap.add_argument("--cpus", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--cache", choices=["off", "on", "both"], default="off",
                    help="use_cache=False (off), True on a fresh cache (on), or both")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--stream", metavar="RxN,...", nargs="?", const="1x1024,16x1024,64x1024,256x1024,1024x2048",
                    help="only: prefix.Stream against one merge, R ranks and N parts per case")
    args = ap.parse_args()
    if args.stream:
        make_runs(args.root, [16], [])
        stream_test(args.root, args.stream)
        return
    parts = [int(x) for x in args.parts.split(",") if x]
    ranks = [int(x) for x in args.ranks.split(",") if x]
    runs = make_runs(args.root, sorted({16, *parts}), ranks)
    warmup = runs["p16"][0]
    caches = {"off": [False], "on": [True], "both": [False, True]}[args.cache]
    todo = [(f"p{n}", runs[f"p{n}"][0], False) for n in parts]
    todo += [(f"r{r}", runs[f"r{r}"][0], pr) for r in ranks for pr in (False, True)]
    todo += [(p.name, p.resolve(), False) for p in args.big]
    checkouts = [("after", ROOT)] + ([("before", args.before.resolve())] if args.before else [])
    for label, checkout in checkouts:
        print(f"{label}: {checkout} at {commit(checkout)}")
    print(f"load average at start {load()}; local Ray with {args.cpus} CPUs; warm-up run {warmup}", flush=True)
    results = []
    for name, path, per_rank in todo:
        size = sizes(path, per_rank)
        print(f"\n{name} ({path}), per_rank={per_rank}: {size['rows'] / 1e6:.2f}M rows in {size['parts']} parts; "
              f"partial per part {size['part_bytes'] / 1e3:.0f} kB "
              f"({size['part_bytes'] / (size['rows'] / size['parts']):.2f} B/row; "
              f"top {size['part_top_bytes'] / 1e3:.0f} kB, steps {size['part_steps_bytes'] / 1e3:.1f} kB, "
              f"seqs {size['part_seqs_bytes'] / 1e3:.1f} kB); merged {size['merged_bytes'] / 1e6:.1f} MB "
              f"({size['merged_steps_rows']} per-step rows x "
              f"{size['merged_steps_bytes'] / max(size['merged_steps_rows'], 1):.0f} B, "
              f"{size['merged_seqs_rows']} (step, seq) rows x "
              f"{size['merged_seqs_bytes'] / max(size['merged_seqs_rows'], 1):.0f} B)", flush=True)
        for cache in caches:
            for rep in range(args.repeat):
                for label, checkout in (checkouts if rep % 2 == 0 else checkouts[::-1]):
                    f = drive(checkout, path, args.cpus, cache, per_rank, warmup)
                    f.update(run=name, checkout=label, per_rank=per_rank, cache=cache, repeat=rep, **size)
                    results.append(f)
                    print(f"  {label:6s} cache={cache!s:5s} #{rep + 1}: driver RSS {f['base_mb']:.0f} MB after "
                          f"ray.init and a warm-up (peak so far {f['base_hwm_mb']:.0f}), peak {f['peak_mb']:.0f} MB: "
                          f"+{f['peak_mb'] - f['base_mb']:.0f} MB (sampled every 5 ms: anonymous "
                          f"+{f['sampled']['RssAnon'] - f['base_anon']:.0f}, shared memory (Ray's object store) "
                          f"+{f['sampled']['RssShmem'] - f['base_shmem']:.0f}) in {f['seconds']:.1f} s; "
                          f"sequence rows in chunk files {f.get('chunk_files_mb', 0):.0f} MB; load {f['load']}",
                          flush=True)
    print("\n| run | parts | rows | per_rank | use_cache | merged partial MB (this tree) | " +
          " | ".join(f"{c}: driver peak growth MB (min / median)" for c, _ in checkouts) + " |")
    print("|---|---|---|---|---|---|" + "---|" * len(checkouts))
    for name, _, per_rank in todo:
        for cache in caches:
            rs = [r for r in results if r["run"] == name and r["per_rank"] == per_rank and r["cache"] == cache]
            cells = []
            for c, _ in checkouts:
                growth = [r["peak_mb"] - r["base_mb"] for r in rs if r["checkout"] == c]
                cells.append(f"{min(growth):.0f} / {statistics.median(growth):.0f}")
            r0 = rs[0]
            print(f"| {name} | {r0['parts']} | {r0['rows'] / 1e6:.2f}M | {per_rank} | {cache} | "
                  f"{r0['merged_bytes'] / 1e6:.1f} | " + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=float))


if __name__ == "__main__":
    main()
