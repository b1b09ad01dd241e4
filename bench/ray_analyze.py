"""The Ray engine against the local engine on the bench run, and the cost model of docs/scale.md.

    python bench/ray_analyze.py                        # 50M synthetic tokens (bench/analyze.py's run)
    python bench/ray_analyze.py --tokens 10e6 --workers 1,2 --ray-data

Prints, all measured in this run on this machine:
- the local engine (kldiag.analyze, no cache) in tokens/s;
- per Ray worker count N: Ray's start-up (ray.init, then the first task on a fresh worker),
  the first analysis (workers import kldiag) and the best warm one, in tokens/s and as a
  ratio to local; its result is checked equal to the local engine's (steps, sequences,
  flags); with --ray-data, Ray Data (read_parquet + map_batches, per-batch partials
  pickled back) for the same N;
- the cost model: reduce time per part and per token, partial size per part (pickled and
  cached), merge time of every part's partial against the number of steps and sequences
  (the run's partials repeated with shifted steps and sequence ids), and the time of a
  refresh's merge with the merged prefix (prefix.combine with one new part) at the same sizes.
Each timing is the best of --repeat runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import kldiag
from kldiag.analysis import AnalysisConfig
from kldiag.analysis import protocol as reduce
from kldiag.analysis.cache import prefix
from kldiag.analysis.core import partials
from kldiag.analysis.runtime import part_fold
from kldiag.analysis.pipeline import build, resolved, thresholds
from kldiag.format import open_run

NOCACHE = AnalysisConfig(use_cache=False)


def bench_module():
    """bench/analyze.py, for the run it builds (the same 50M-token run as the other figures)."""
    spec = importlib.util.spec_from_file_location("bench_analyze", Path(__file__).with_name("analyze.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def best(fn, repeat: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return min(times), out


def same(a, b) -> bool:
    return all(getattr(a, n).to_pandas().equals(getattr(b, n).to_pandas()) for n in ("steps", "sequences", "flags"))


def ray_figures(run: Path, workers: int, repeat: int, local, ray_data: bool) -> dict:
    import ray

    t = time.perf_counter()
    ray.init(num_cpus=workers, include_dashboard=False, logging_level="ERROR", log_to_driver=False,
             runtime_env={"worker_process_setup_hook": no_fsspec_http} if ray_data else None)
    init_s = time.perf_counter() - t
    t = time.perf_counter()
    ray.get(ray.remote(lambda: 0).remote())
    first_task_s = time.perf_counter() - t
    cfg = AnalysisConfig(use_cache=False, engine="ray")
    t = time.perf_counter()
    first = kldiag.analyze(run, cfg)
    first_s = time.perf_counter() - t
    warm_s, warm = best(lambda: kldiag.analyze(run, cfg), repeat)
    out = {"workers": workers, "init_s": init_s, "first_task_s": first_task_s, "first_analyze_s": first_s,
           "warm_s": warm_s, "equal_to_local": same(first, local) and same(warm, local)}
    if ray_data:
        out["ray_data_s"] = best(lambda: ray_data_analyze(run), repeat)[0]
    ray.shutdown()
    return out


def no_fsspec_http() -> None:
    """ray 2.60's read_parquet imports fsspec's HTTP filesystem from several threads and
    catches only ModuleNotFoundError: without aiohttp a half-imported module raises ImportError."""
    sys.modules["fsspec.implementations.http"] = None


def ray_data_analyze(run: Path) -> partials.Partial:
    """The alternative: Ray Data reads the parts, map_batches reduces each block to a partial."""
    import pyarrow as pa
    import ray

    from kldiag.analysis.core.batch import COLUMNS
    from kldiag.analysis.core.stats import batch_partials

    r = open_run(run)
    parts = r.parts()
    th = thresholds(AnalysisConfig(), r.manifest)
    rank_of = {p.path: p.rank for p in parts}

    def reduce_block(block: pa.Table) -> dict:
        path = block.column("path")[0].as_py()
        res = batch_partials(block.drop_columns(["path"]).combine_chunks().to_batches()[0], rank_of[path], th)
        p = partials.Partial(keyed_merge(res.steps), keyed_merge(res.seqs), res.top, res.bad, {}, block.num_rows)
        return {"path": [path], "partial": [pickle.dumps(p, protocol=5)]}

    import logging

    logging.getLogger("ray.data").setLevel(logging.WARNING)
    ray.data.DataContext.get_current().enable_progress_bars = False
    no_fsspec_http()
    ds = ray.data.read_parquet([p.path for p in parts], include_paths=True).select_columns([*COLUMNS, "path"])
    rows = ds.map_batches(reduce_block, batch_format="pyarrow", batch_size=None).take_all()
    by_path: dict[str, list] = {}
    for row in rows:
        by_path.setdefault(row["path"], []).append(pickle.loads(row["partial"]))
    return partials.merge([partials.merge(by_path[p.path], th.top_k) for p in parts if p.path in by_path], th.top_k)


def keyed_merge(table):
    from kldiag.analysis.core import keyed

    return keyed.merge([table])


def shifted(p: partials.Partial, dstep: int, dseq: int) -> partials.Partial:
    """p with steps moved by dstep and sequence ids by dseq: the same work on new keys."""
    def move(t):
        t = dict(t)
        if "step" in t:
            t["step"] = t["step"] + dstep
        if "seq" in t:
            t["seq"] = t["seq"] + dseq
        return t
    return partials.Partial(move(p.steps), move(p.seqs), move(p.top), move(p.bad), dict(p.superseded), p.rows)


def merge_point(many: list[partials.Partial], r, th, repeat: int) -> dict:
    """Merge times of `many` partials: all of them, and a refresh (the last one) after a prefix."""
    full_s, merged = best(lambda: partials.merge(many, th.top_k), repeat)
    cut = int(many[-1].steps["step"].min())
    pre = prefix.seal(partials.merge(many[:-1], th.top_k), len(many) - 1, cut)
    opened = [p for p in many[:-1] if p.steps["step"].max() >= cut]
    refresh_s, got = best(lambda: prefix.combine(pre, opened, [many[-1]], th.top_k), repeat)
    assert np.array_equal(got.seqs["sum_k3"], merged.seqs["sum_k3"], equal_nan=True)
    empty = prefix.Prefix(pre.k, cut, partials.Partial())
    tail_s = best(lambda: prefix.combine(empty, opened, [many[-1]], th.top_k), repeat)[0]
    build_s = best(lambda: build(r, resolved(NOCACHE, r.manifest), merged, len(many), 0, [], 0.0), 1)[0]
    return {"parts": len(many), "steps": len(merged.steps["step"]), "sequences": len(merged.seqs["seq"]),
            "merge_all_s": full_s, "refresh_merge_s": refresh_s, "refresh_tail_only_s": tail_s,
            "open_parts": len(opened), "build_tables_s": build_s,
            "merged_bytes": sum(a.nbytes for t in partials.TABLES for a in getattr(merged, t).values())}


def cost_model(run: Path, repeat: int, copies: list[int]) -> dict:
    r = open_run(run)
    parts = r.parts()
    th = thresholds(AnalysisConfig(), r.manifest)
    reduce_s, ps = [], []
    for part in parts:
        t = time.perf_counter()
        ps.append(part_fold.partial_of(part, th, 1 << 20))
        reduce_s.append(time.perf_counter() - t)
    rows = [p.rows for p in ps]
    with tempfile.TemporaryDirectory() as d:
        cached = []
        for i, p in enumerate(ps):
            reduce.save_arrays(Path(d) / f"{i}.part", partials.to_arrays(p))  # the engine's cache format
            cached.append((Path(d) / f"{i}.part").stat().st_size)
    steps = len(np.unique(np.concatenate([p.steps["step"] for p in ps])))
    seqs = sum(len(p.seqs["seq"]) for p in ps)
    max_seq = int(max(p.seqs["seq"].max() for p in ps)) + 1
    merges = [merge_point([shifted(p, j * steps, j * max_seq) for j in range(n) for p in ps], r, th, repeat)
              for n in copies]
    return {"parts": len(parts), "rows_per_part": statistics.mean(rows),
            "reduce_s_per_part": statistics.median(reduce_s), "reduce_ns_per_token": 1e9 * sum(reduce_s) / sum(rows),
            "partial_pickled_bytes": statistics.mean(len(pickle.dumps(p, protocol=5)) for p in ps),
            "partial_cached_bytes": statistics.mean(cached), "steps": steps, "sequences": seqs,
            "merge": merges}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=float, default=50e6)
    ap.add_argument("--workers", default="1,2", help="Ray worker counts (comma list)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--copies", default="1,2,4,8", help="run sizes (x the bench run) of the merge model")
    ap.add_argument("--ray-data", action="store_true", help="also time Ray Data read_parquet + map_batches")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run, _ = bench_module().make(Path(tmp), args.tokens)
        kldiag.analyze(run, NOCACHE)  # warm: numba, page cache
        local_s, local = best(lambda: kldiag.analyze(run, NOCACHE), args.repeat)
        tokens = local.info["rows"]
        f = {"tokens": tokens, "local_s": local_s, "ray": [], "cost": None}
        print(f"local engine: {tokens / local_s / 1e6:.1f} M tokens/s ({local_s:.2f} s)", flush=True)
        for n in [int(x) for x in args.workers.split(",")]:
            r = ray_figures(run, n, args.repeat, local, args.ray_data)
            f["ray"].append(r)
            line = (f"ray, {n} worker(s): start {r['init_s']:.2f} s + first task {r['first_task_s']:.2f} s; "
                    f"first analysis {r['first_analyze_s']:.2f} s; warm {tokens / r['warm_s'] / 1e6:.1f} M tokens/s "
                    f"= {local_s / r['warm_s']:.2f}x local; equal to local: {r['equal_to_local']}")
            if "ray_data_s" in r:
                line += f"; Ray Data {tokens / r['ray_data_s'] / 1e6:.1f} M tokens/s"
            print(line, flush=True)
        c = cost_model(run, args.repeat, [int(x) for x in args.copies.split(",")])
        f["cost"] = c
        print(f"per part: {c['rows_per_part'] / 1e6:.2f} M rows reduced in {c['reduce_s_per_part'] * 1e3:.0f} ms "
              f"({c['reduce_ns_per_token']:.1f} ns/token, one thread); "
              f"partial {c['partial_pickled_bytes'] / 1e3:.0f} kB "
              f"pickled, {c['partial_cached_bytes'] / 1e3:.0f} kB cached")
        for m in c["merge"]:
            print(f"merge of {m['parts']} partials ({m['steps']} steps, {m['sequences'] / 1e6:.2f} M sequences, "
                  f"{m['merged_bytes'] / 1e6:.0f} MB merged): all {m['merge_all_s'] * 1e3:.1f} ms; refresh with the "
                  f"prefix {m['refresh_merge_s'] * 1e3:.1f} ms ({m['open_parts']} open part(s) + 1 new; "
                  f"{m['refresh_tail_only_s'] * 1e3:.1f} ms without appending to the sealed rows); "
                  f"tables from the merge {m['build_tables_s'] * 1e3:.0f} ms")
        if args.json:
            args.json.write_text(json.dumps(f, indent=2))


if __name__ == "__main__":
    sys.exit(main())
