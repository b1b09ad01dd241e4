"""Analysis throughput against baselines measured in the same run (docs/metrics.md, "Performance").

    python bench/analyze.py                 # 50M synthetic tokens (about 1 GB in a temp dir)
    python bench/analyze.py --tokens 10e6   # smaller and faster
    python bench/analyze.py --cpus 1,2      # the same figures on 1 and on 2 cores, and a 1-core profile

Prints first the CPU model, its vector extensions and numba's compile target (bench/machine.py), then, for
a run written by kldiag.tools.synth with the recorder's Parquet settings:
- end-to-end `kldiag.analyze` (default threads, no cache) tokens/s, as a ratio to one DuckDB
  query computing the same per-step metrics over the same files (bench/steps.sql: every
  mean, maximum, count and ratio of the steps table, checked equal to kldiag's before it
  is timed; target >= 2x), and to pyarrow reading the columns analysis reads, the faster
  of one reader with Arrow's threads and one reader thread per core over the parts, as
  analysis does (target <= 1.5x the time). A smaller DuckDB query (5 columns, 13 of the
  metrics, no NaN handling) is timed too, for reference;
- the time of an incremental re-analysis after one more part file (cache on);
- peak RSS of an analysis in a fresh process, for a 10M-token prefix and the whole run
  (target: flat).
Each timing is the best of --repeat runs, interleaved, because the machine is shared.

--cpus N[,M...] times every figure on N cores (then M), interleaved, and prints each ratio per
core count, so the scaling is measured: every thread of this process (the analysis's reader
threads, Arrow's decode pool, DuckDB's) runs only on the first N cores this process may use
(os.sched_setaffinity, which kldiag's thread count follows: kldiag.analysis.runtime.worker.cpus), and
the pools are sized to N (pyarrow.set_cpu_count / set_io_thread_count, DuckDB's `threads`; the
numba kernels are not numba-parallel: they start no threads of their own). It also prints where
one analysis's time goes on one core (decode, reduce, per-part finish, merge, tables), from which
a machine with more cores than this one can be projected.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import cores  # bench/cores.py, next to this script
import numpy as np
import pyarrow.parquet as pq

from kldiag.analysis import AnalysisConfig, analyze
from kldiag.analysis.core.batch import COLUMNS
from kldiag.analysis.runtime import worker
from kldiag.format import MANIFEST, TOKENS_DIR, list_parts
from kldiag.tools.synth import SynthConfig, make_run

import machine  # bench/machine.py: the CPU, its vector extensions, numba's target

SEQS, MEAN_LEN = 1000, 500  # per step: 500k tokens

STEPS_SQL = Path(__file__).with_name("steps.sql")
SUBSET_QUERY = """
WITH t AS (
  SELECT step, logp_ref::DOUBLE - logp::DOUBLE AS d,
         COALESCE(logp::DOUBLE - logp_old::DOUBLE, 0) AS x
  FROM read_parquet('{glob}') WHERE mask
)
SELECT step, count(*) AS tokens, avg(-d) AS k1_mean, avg(0.5 * d * d) AS k2_mean,
  avg(exp(d) - d - 1) AS k3_mean, avg(exp(x) * (exp(d) - d - 1)) AS k3_is_mean,
  avg(abs(exp(d) - 1)) AS weight_k3_abs_mean, max(abs(exp(d) - 1)) AS weight_k3_abs_max,
  max(exp(x) * abs(d)) AS weight_k3_is_abs_max, avg(exp(x)) AS rho_mean, min(exp(x)) AS rho_min,
  max(exp(x)) AS rho_max, count(*) FILTER (WHERE d > ln(20)) AS theta_ll_ref_count,
  count(*) FILTER (WHERE abs(exp(d) - 1) > 10) AS weight_blowup_count
FROM t GROUP BY step ORDER BY step
"""


def make(root: Path, tokens: float) -> tuple[Path, int]:
    steps = max(2, int(round(tokens / (SEQS * MEAN_LEN))))
    cfg = SynthConfig(steps=steps, seqs_per_step=SEQS, seq_len=(MEAN_LEN // 2, MEAN_LEN * 3 // 2), vocab_size=0,
                      blowup_step=steps // 2, rows_per_file=1 << 20)
    t = time.perf_counter()
    make_run(root / "run", cfg)
    rows = sum(pq.ParquetFile(p.path).metadata.num_rows for p in list_parts(root / "run"))
    print(f"wrote {rows / 1e6:.1f}M tokens, {len(list_parts(root / 'run'))} parts, "
          f"{sum(p.size for p in list_parts(root / 'run')) / 1e6:.0f} MB in {time.perf_counter() - t:.1f}s")
    return root / "run", steps


def timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process, all threads) of fn()."""
    t, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t, time.process_time() - c


def time_analyze(run: Path) -> tuple[float, float]:
    return timed(lambda: analyze(run, AnalysisConfig(use_cache=False)))


def read_part(path: Path, use_threads: bool) -> None:
    for _ in pq.ParquetFile(path).iter_batches(batch_size=1 << 20, columns=list(COLUMNS), use_threads=use_threads):
        pass


def time_pyarrow(run: Path) -> tuple[float, float]:
    """One reader, Arrow decoding the columns of each batch in its thread pool."""
    return timed(lambda: [read_part(p.path, True) for p in list_parts(run)])


def time_pyarrow_parts(run: Path) -> tuple[float, float]:
    """One reader thread per CPU this process may use, over the parts (what analysis does)."""
    def read() -> None:
        with ThreadPoolExecutor(worker.cpus()) as pool:
            list(pool.map(lambda p: read_part(p.path, False), list_parts(run)))
    return timed(read)


def steps_query(run: Path) -> str:
    cfg = AnalysisConfig()
    return STEPS_SQL.read_text().format(glob=f"{run}/{TOKENS_DIR}/rank-*/part-*.parquet", tau=cfg.tau,
                                        limit=cfg.weight_limit, clamp=cfg.clamp, delta=1e-4, clip_lo=0.8, clip_hi=1.2)


def check_duckdb(run: Path) -> int:
    """Raise unless the DuckDB query gives kldiag's steps table; returns the columns compared."""
    import duckdb

    got = duckdb.connect().sql(steps_query(run)).to_arrow_table()
    want = analyze(run, AnalysisConfig(use_cache=False)).steps
    for name in got.column_names:
        a, b = (np.asarray(t[name].to_numpy(zero_copy_only=False), np.float64) for t in (got, want))
        if not np.allclose(a, b, rtol=1e-9, atol=0, equal_nan=True):
            raise SystemExit(f"DuckDB's {name} differs from kldiag's: the baseline does not compute the same metrics")
    return len(got.column_names)


def time_duckdb(run: Path, query: str | None = None) -> tuple[float, float]:
    import duckdb

    con = duckdb.connect(config={"threads": worker.cpus()})
    query = query or steps_query(run)
    return timed(lambda: con.sql(query).fetchall())


def time_duckdb_subset(run: Path) -> tuple[float, float]:
    return time_duckdb(run, SUBSET_QUERY.format(glob=f"{run}/{TOKENS_DIR}/rank-*/part-*.parquet"))


def peak_rss_mb(run: Path) -> float:
    """Peak RSS of an analysis in a fresh process: its VmHWM. (Its ru_maxrss would report at least this
    process's RSS at fork, which Linux keeps across exec: the figure would be this bench's own size.)"""
    code = ("import re, sys; from kldiag.analysis import analyze, AnalysisConfig; "
            "analyze(sys.argv[1], AnalysisConfig(use_cache=False)); "
            "print(int(re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read()).group(1)) / 1024)")
    out = subprocess.run([sys.executable, "-c", code, str(run)], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def prefix_run(run: Path, dest: Path, rows: float) -> Path:
    """A run holding the first parts of `run` (hard links) up to about `rows` rows."""
    (dest / TOKENS_DIR / "rank-0").mkdir(parents=True)
    shutil.copy(run / MANIFEST, dest / MANIFEST)
    total = 0
    for part in list_parts(run):
        if total >= rows:
            break
        os.link(part.path, dest / TOKENS_DIR / "rank-0" / part.name)
        total += pq.ParquetFile(part.path).metadata.num_rows
    return dest


def s3_figures(run: Path, repeat: int) -> dict:
    """The same run analysed from a local S3 server (moto on 127.0.0.1) and from local disk.

    moto keeps objects in Python memory and serves them through werkzeug: its throughput is
    a floor, not what S3 or MinIO deliver; the figure shows what the remote path costs here.
    """
    import pyarrow.fs as pafs

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from s3util import moto_s3

    out = {}
    with moto_s3() as s3, tempfile.TemporaryDirectory(prefix="kldiag-s3cache-") as cache:
        os.environ["KLDIAG_CACHE_DIR"] = cache
        bucket = s3.bucket("bench")
        dest = pafs.S3FileSystem(endpoint_override=s3.endpoint.split("//")[1], scheme="http", region="us-east-1")
        t = time.perf_counter()
        pafs.copy_files(str(run), f"{bucket}/run", destination_filesystem=dest)
        out["s3_upload_s"] = time.perf_counter() - t
        uri = f"s3://{bucket}/run"
        best = {"local": (1e9, 1e9), "s3": (1e9, 1e9)}
        for _ in range(repeat):
            for name, target in (("local", run), ("s3", uri)):
                wall, cpu = timed(lambda target=target: analyze(target, AnalysisConfig(use_cache=False)))
                best[name] = (min(best[name][0], wall), min(best[name][1], cpu))
        analyze(uri)  # fills the local cache of the remote run
        analyze(run)
        out["s3_cached_s"] = timed(lambda: analyze(uri))[0]
        out["local_cached_s"] = timed(lambda: analyze(run))[0]
        out.update({"s3_analyze_s": best["s3"][0], "s3_analyze_cpu_s": best["s3"][1],
                    "local_analyze_s": best["local"][0], "local_analyze_cpu_s": best["local"][1]})
        os.environ.pop("KLDIAG_CACHE_DIR", None)
    return out


def report_s3(f: dict) -> None:
    print(f"S3 (moto on 127.0.0.1, same run uploaded in {f['s3_upload_s']:.1f}s): analyze "
          f"{f['s3_analyze_s']:.2f}s wall {f['s3_analyze_cpu_s']:.2f}s CPU, local disk {f['local_analyze_s']:.2f}s "
          f"wall {f['local_analyze_cpu_s']:.2f}s CPU: {f['s3_analyze_s'] / f['local_analyze_s']:.2f}x the time; "
          f"{f['tokens'] / f['s3_analyze_s'] / 1e6:.1f} M tokens/s from S3")
    print(f"  cached re-analysis (nothing new): S3 {f['s3_cached_s']:.2f}s, local {f['local_cached_s']:.2f}s")


def timings(run: Path, cpus: list[int], repeat: int) -> dict[int, dict[str, tuple[float, float]]]:
    """{cores: {name: (best wall, best CPU seconds)}}, every run interleaved over names and core counts."""
    runs = {"analyze": time_analyze, "duckdb": time_duckdb, "duckdb_subset": time_duckdb_subset,
            "pyarrow_serial": time_pyarrow, "pyarrow_parts": time_pyarrow_parts}
    best = {n: dict.fromkeys(runs, (1e9, 1e9)) for n in cpus}
    for _ in range(repeat):
        for n in cpus:
            cores.use_cores(n)
            for name, fn in runs.items():
                wall, cpu = fn(run)
                best[n][name] = (min(best[n][name][0], wall), min(best[n][name][1], cpu))
    for b in best.values():
        b["pyarrow"] = min(b["pyarrow_serial"], b["pyarrow_parts"])
    return best


def ratios(best: dict[str, tuple[float, float]], rows: int) -> dict[str, float]:
    f = {f"{k}_s": v[0] for k, v in best.items()}
    f.update({f"{k}_cpu_s": v[1] for k, v in best.items()})
    f.update({f"{k}_mtok_s": rows / v[0] / 1e6 for k, v in best.items()})
    f["analyze_vs_duckdb_speed"] = best["duckdb"][0] / best["analyze"][0]
    f["analyze_vs_duckdb_subset_speed"] = best["duckdb_subset"][0] / best["analyze"][0]
    f["analyze_vs_pyarrow_time"] = best["analyze"][0] / best["pyarrow"][0]
    f["analyze_vs_pyarrow_cpu"] = best["analyze"][1] / best["pyarrow"][1]
    return f


def cpu_list(text: str) -> list[int]:
    try:
        cpus = sorted({int(c) for c in text.split(",")})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: pass core counts such as 1,2") from None
    if cpus[0] < 1 or cpus[-1] > len(cores.ALL_CORES):
        raise argparse.ArgumentTypeError(f"{text}: this process may use {len(cores.ALL_CORES)} core(s) here; "
                                         f"pass counts from 1 to {len(cores.ALL_CORES)}")
    return cpus


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=float, default=50e6)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("--s3", action="store_true", help="also analyse the run from a local S3 server (needs moto)")
    ap.add_argument("--s3-only", action="store_true", help="only the S3 against local disk comparison")
    ap.add_argument("--cpus", type=cpu_list, help="core counts to time on, e.g. 1,2 (default: every core here); "
                    "also prints a 1-core profile")
    args = ap.parse_args()
    print("\n".join(machine.machine_lines()), flush=True)  # timings and sums' last bits depend on these
    with tempfile.TemporaryDirectory(prefix="kldiag-bench-") as tmp:
        root = Path(tmp)
        run, steps = make(root, args.tokens)
        rows = sum(pq.ParquetFile(p.path).metadata.num_rows for p in list_parts(run))
        time_analyze(run)  # warm: imports, page cache
        if args.s3_only:
            report_s3({"tokens": rows, **s3_figures(run, args.repeat)})
            return
        figures = {"tokens": rows, "parts": len(list_parts(run)), "duckdb_columns_checked": check_duckdb(run),
                   "cores_here": len(cores.ALL_CORES), "machine": machine.machine()}
        cpus = args.cpus or [len(cores.ALL_CORES)]
        per = timings(run, cpus, args.repeat)
        figures["scaling"] = {n: ratios(best, rows) for n, best in per.items()}
        figures.update(figures["scaling"][max(cpus)])
        if args.cpus:
            cores.use_cores(1)
            figures["profile_1core"] = cores.profile(run)
        cores.use_cores(len(cores.ALL_CORES))
        analyze(run)  # fills the cache
        make_run(run, SynthConfig(steps=steps + 2, seqs_per_step=SEQS, seq_len=(MEAN_LEN // 2, MEAN_LEN * 3 // 2),
                                  vocab_size=0, blowup_step=steps // 2), steps=range(steps, steps + 2), manifest=False)
        t = time.perf_counter()
        inc = analyze(run)
        figures["incremental_s"] = time.perf_counter() - t
        figures["incremental_files_new"] = inc.files_new
        figures["full_over_incremental"] = figures["analyze_s"] / figures["incremental_s"]
        small = prefix_run(run, root / "prefix", min(10e6, rows / 5))
        figures["rss_mb_small"] = peak_rss_mb(small)
        figures["rss_mb_full"] = peak_rss_mb(run)
        figures["rss_small_tokens"] = sum(pq.ParquetFile(p.path).metadata.num_rows for p in list_parts(small))
        if args.s3:  # last: moto holds the run in this process's memory, and a child's ru_maxrss inherits it
            figures.update(s3_figures(run, args.repeat))
    report(figures)
    if args.cpus:
        report_scaling(figures)
    if args.s3:
        report_s3(figures)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


def report(f: dict) -> None:
    print(f"tokens: {f['tokens'] / 1e6:.1f}M (best of runs; shared machine, expect +-20% noise); this machine "
          f"lets this process use {f['cores_here']} core(s): --cpus times fewer, never more")
    for name, what in (("analyze", "kldiag analyze"),
                       ("duckdb", f"DuckDB, same metrics ({f['duckdb_columns_checked']} cols)"),
                       ("duckdb_subset", "DuckDB, 13-metric subset"),
                       ("pyarrow_serial", f"pyarrow read, {len(COLUMNS)} cols, 1 reader"),
                       ("pyarrow_parts", f"pyarrow read, {len(COLUMNS)} cols, a reader per core")):
        print(f"  {what:40s} {f[name + '_s']:6.2f}s wall  {f[name + '_cpu_s']:6.2f}s CPU  "
              f"{f[name + '_mtok_s']:5.1f} M tokens/s")
    print(f"analyze / DuckDB speed:  {f['analyze_vs_duckdb_speed']:.2f}x   (target >= 2; "
          f"{f['analyze_vs_duckdb_subset_speed']:.2f}x against the subset query)")
    print(f"analyze / pyarrow time (the faster read):  {f['analyze_vs_pyarrow_time']:.2f}x wall, "
          f"{f['analyze_vs_pyarrow_cpu']:.2f}x CPU   (target <= 1.5)")
    print(f"incremental re-analysis after {f['incremental_files_new']} new part(s): {f['incremental_s']:.2f}s "
          f"({f['full_over_incremental']:.1f}x faster than a full analysis)")
    print(f"peak RSS: {f['rss_mb_small']:.0f} MB at {f['rss_small_tokens'] / 1e6:.0f}M tokens, "
          f"{f['rss_mb_full']:.0f} MB at {f['tokens'] / 1e6:.0f}M tokens (target: flat)")



def report_scaling(f: dict) -> None:
    """Each figure per core count, and the 1-core profile with what it projects on more cores."""
    one = f["scaling"][min(f["scaling"])]
    print("per core count (best of runs, interleaved; every pool sized to the cores):")
    print("  cores  analyze  M tok/s  x1 core  DuckDB  analyze/DuckDB  decode  x1 core  analyze/decode (CPU)")
    for n, g in sorted(f["scaling"].items()):
        print(f"  {n:5d}  {g['analyze_s']:6.2f}s  {g['analyze_mtok_s']:7.1f}  {one['analyze_s'] / g['analyze_s']:6.2f}x"
              f"  {g['duckdb_s']:5.2f}s  {g['analyze_vs_duckdb_speed']:13.2f}x  {g['pyarrow_s']:5.2f}s"
              f"  {one['pyarrow_s'] / g['pyarrow_s']:6.2f}x  {g['analyze_vs_pyarrow_time']:.2f}x "
              f"({g['analyze_vs_pyarrow_cpu']:.2f}x)")
    cores.report_profile(f["profile_1core"], one["analyze_s"], f["tokens"], f["parts"])


if __name__ == "__main__":
    main()
