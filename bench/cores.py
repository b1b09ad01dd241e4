"""Core counts for the benches: run this process on N cores, and profile one analysis on one core.

`use_cores(n)` pins every thread of this process to the first n cores it may use and sizes the
pools to n: Arrow's CPU and I/O pools (pyarrow.set_cpu_count / set_io_thread_count); kldiag's
reader threads follow the affinity (kldiag.analysis.runtime.worker.cpus); DuckDB's `threads` is set per
connection by the caller from the same count. New threads inherit the affinity of the thread
that starts them, threads already running are pinned one by one (/proc/self/task).

`profile(run)` times the steps of one analysis done one after the other in this thread, on
one core: decode (pyarrow, the columns analysis reads, a batch at a time), reduce (the analysis
reducer's add of each batch: the compiled kernel and the per-batch work around it: sequence
boundaries, top-k candidates), finish (each part's partial), merge (the streaming merge in part
order), tables (the steps, sequences and flags tables). Decode, reduce and finish run per part
in the reader threads, one part per core; merge and tables run in the calling thread. The reduce
step is split into its compiled functions (numba, GIL released: fused.fused_pass and the row scans)
and the numpy and Python work around them, which holds the GIL at least in part: threads on
more cores queue for it there.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import pyarrow as pa

from kldiag.analysis import AnalysisConfig

from kldiag.analysis.runtime import part_fold
from kldiag.analysis import pipeline as engine
from kldiag.analysis.cache import prefix
from kldiag.analysis.core import partials
from kldiag.analysis.kernels import fused, scans
from kldiag.analysis.runtime import runner, worker
from kldiag.format import open_run

ALL_CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def use_cores(n: int) -> None:
    """Run every thread of this process on the first n of ALL_CORES; Arrow's pools sized to n."""
    if not 1 <= n <= len(ALL_CORES):
        raise SystemExit(f"--cpus {n}: this process may use {len(ALL_CORES)} core(s) here ({ALL_CORES}); "
                         f"pass 1 to {len(ALL_CORES)}")
    cores = set(ALL_CORES[:n])
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:  # a thread that ended meanwhile
            pass
    pa.set_cpu_count(n)
    pa.set_io_thread_count(n)
    assert worker.cpus() == n, (worker.cpus(), n)


@contextlib.contextmanager
def timing_compiled(spent: list[float]):
    """Add to spent[0] the seconds spent in the compiled functions the analysis calls from Python
    (the module attributes are wrapped, then restored; call after they were compiled)."""
    saved = [(fused, "fused_pass", fused.fused_pass)]
    saved += [(scans, name, f) for name, f in vars(scans).items() if hasattr(f, "py_func")]

    def timed(f):
        def call(*args, **kw):
            t = time.perf_counter()
            try:
                return f(*args, **kw)
            finally:
                spent[0] += time.perf_counter() - t
        return call

    for mod, name, f in saved:
        setattr(mod, name, timed(f))
    try:
        yield
    finally:
        for mod, name, f in saved:
            setattr(mod, name, f)


def profile(run: Path) -> dict[str, float]:
    """Seconds per step of one analysis of `run` (see the module docstring), in this thread."""
    r = open_run(run)
    parts = r.parts()
    cfg = AnalysisConfig(use_cache=False)
    th = engine.thresholds(cfg, r.manifest)
    red = partials.AnalysisReducer(th)
    columns = part_fold.union_columns([red])
    size = min(cfg.batch_size, runner.KERNEL_ROWS)
    stream = prefix.Stream(parts, th.top_k)
    t = dict.fromkeys(("decode", "reduce", "finish", "merge", "tables"), 0.0)
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        t[name] += now - clock
        clock = now

    def one_part(i: int, part) -> None:
        fold = part_fold.PartFold(part, [red])
        batches = part_fold.part_batches(part, columns, size)
        lap("decode")
        while (batch := next(batches, None)) is not None:  # one batch at a time, as the engine reads
            lap("decode")
            fold.add(batch)
            lap("reduce")
        lap("decode")
        arrays = fold.finish()[red.name]
        lap("finish")
        stream.add(i, partials.from_arrays(arrays))
        lap("merge")

    compiled = [0.0]
    with timing_compiled(compiled):
        for i, part in enumerate(parts):
            one_part(i, part)
    merged = stream.result()
    lap("merge")
    engine.build(r, engine.resolved(cfg, r.manifest), merged, len(parts), len(parts), [], 0.0)
    lap("tables")
    return {"decode": t["decode"], "reduce: compiled": compiled[0], "reduce: around": t["reduce"] - compiled[0],
            **{k: t[k] for k in ("finish", "merge", "tables")}}


def report_profile(t: dict[str, float], one_core_s: float, tokens: int, parts: int,
                   cores: tuple[int, ...] = (16, 64)) -> None:
    """The 1-core profile, and the wall it projects on more cores. A part is the unit of work: on
    n cores the per-part steps take ceil(parts / n) rounds of one part's time (parts taken as equal);
    merge and tables do not divide, and overlap the per-part steps (the wall lies between the larger
    of the two and their sum). Memory bandwidth and the GIL are not modelled."""
    total = sum(t.values())
    print(f"one analysis on 1 core, step by step in one thread: {total:.2f}s "
          f"(the engine on 1 core: {one_core_s:.2f}s, its reader thread decoding ahead)")
    for name, s in t.items():
        print(f"  {name:16s} {s:6.2f}s  {100 * s / total:5.1f}%  {1e9 * s / tokens:5.1f} ns/token")
    per_part = (total - t["merge"] - t["tables"]) / parts
    serial = t["merge"] + t["tables"]
    print(f"  CPU work of the analysis / the decode's: {total / t['decode']:.2f}x (the wall ratio on any number "
          "of cores, if both scale perfectly)")
    print(f"  the work around the compiled functions holds the GIL at least in part: if all of it did, {parts} parts "
          f"would take at least {t['reduce: around']:.2f}s however many cores")
    for n in cores:
        rounds = -(-parts // n)
        lo, hi = max(rounds * per_part, serial), rounds * per_part + serial
        decode = rounds * t["decode"] / parts
        print(f"  projected on {n} cores ({parts} parts: {rounds} round(s)): {lo:.2f}-{hi:.2f}s "
              f"({tokens / hi / 1e6:.0f}-{tokens / lo / 1e6:.0f} M tokens/s), the decode {decode:.2f}s "
              f"in as many rounds: {lo / decode:.2f}-{hi / decode:.2f}x")
