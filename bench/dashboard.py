"""Dashboard cost on a large synthetic run, server side: where the first render goes and what a
page switch costs once the run is analysed, as ratios to the cold analysis measured in the same run.

    .venv/bin/python bench/dashboard.py [--steps 2000] [--run /tmp/kldiag_bench_dash]
    .venv/bin/python bench/dashboard.py --scale                                   # 30M rows, the figures below
    .venv/bin/python bench/dashboard.py --scale --seqs-per-step 600 --run /tmp/kldiag_bench_dash_300m  # 300M

The run (2,000 steps of --seqs-per-step sequences of 150-349 tokens: 30M rows at 60, 300M at 600;
kldiag.tools.synth, so the recorder's Parquet settings, about 17.6 bytes a row) is written once
and kept: later invocations reuse it.

Default mode: a cold `kldiag.analyze` and `diagnose` in a fresh process (the baseline), then, in
this process, the Overview's cold first render (AppTest of app/main.py, KLDIAG_RUNS set) and page
switches.

--scale, every figure in a fresh process, --repeat times, the cold ones interleaved ("cold": no kldiag cache
or a fresh one, in a fresh process; the run's parts are read once before, so that every measurement finds
them in the OS's page cache, not only those after the first):
- cold `analyze` alone (no reducers, use_cache=False); what the `kldiag analyze` command computes
  before it prints (kldiag.report.summary.analyze_run: the diagnosis's reducers and the top-k one in
  the same pass, then `diagnose`); and cold `analyze` with the dashboard's reducers
  (kldiag.views.dashboard.reducers()) followed by `diagnose`. The ratios are the dashboard's first
  open against the bare analysis (target <= 1.3x) and against the command. All three also with a
  fresh cache (RUN/.kldiag deleted, use_cache=True: what `kldiag dashboard` does on a run never opened);
- the Estimators page's first visit ever (its reducer is in the dashboard's first pass: it reads no part;
  before it was, one more pass over every part);
- with the run's cache warm: a fresh app process per page (Overview, Distributions, Tokens, Sequence,
  Estimators, Mismatch), that page its first render (target <= 1.5 s each); then one process that
  renders Overview, turns Live on (as a dashboard that refreshes has it) and switches through every page,
  publishes one more part (one more step, written by another process, as a recorder's is), and reruns
  the Overview (the refresh, target <= 0.5 s); the part is removed afterwards;
- peak RSS (VmHWM) of each process (target: the same at 30M and 300M rows).
--scale --cold-only: only the cold figures and their ratio.
--scale --warm-only --first-visit: each page's fresh process finds the run's analysis cache warm and what
the dashboard's first open (one Overview render) stored, nothing more (RUN/.kldiag/results and the sequence
pieces' kept top rows put back as that open left them before each): that page's first visit after the
first open (the Sequence page's first sequence, its step's sequences, its tokens and its group's).
--shape grpo: the run written (when --run does not exist) has a GRPO run's shape instead of the short
completions of the default (SHAPES); the ratios on both say how much the run's shape moves them.
--scale --warm-only: only those warm figures (the cache filled first: the cold pass if it has no reducer
states, then one app process through every page, which stores what the pages derive in RUN/.kldiag/results:
kldiag.analysis.cache.store; a change of kldiag's code makes those entries misses).
--breakdown, instead: one thread, part by part (wall and this thread's CPU time, each the least of
--repeat runs: the CPU figure holds on a loaded machine), the read of the analysis's columns and of the
first pass's (the analysis and kldiag.views.dashboard.reducers()), each reducer's read + reduce
alone (the Estimators page's too), the analysis with the Estimators reducer riding in its pass, the first
pass without it (the difference: its marginal cost), the first pass in one read, and it with the Estimators
reducer, in ns per row.
--diagnose, instead: diagnose() alone on the warm cache, a fresh process each --repeat (wall and CPU s).
--profile PAGE (or refresh), instead: a cProfile of that page's warm first render in a fresh process
(or of the refresh), written to /tmp/kldiag_dash_<PAGE>.prof, its top functions printed.

The browser-side figures (what a user waits for, rendering included) come from the browser
test: KLDIAG_BENCH_DASHBOARD=1 pytest -s tests/test_browser_dash.py -k speed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from kldiag.tools.synth import SynthConfig, make_run

BASELINE = """
import json, sys, time
import kldiag
from kldiag.diagnosis import diagnose
t0 = time.perf_counter(); a = kldiag.analyze(sys.argv[1], kldiag.AnalysisConfig(use_cache=False))
t1 = time.perf_counter(); diagnose(a); t2 = time.perf_counter()
print(json.dumps([a.steps.num_rows, a.info.get("rows", 0), t1 - t0, t2 - t1]))
"""
# One cold measurement in a fresh process: argv run, "alone"|"command"|"dashboard", "nocache"|"freshcache".
COLD = """
import json, os, re, shutil, sys, time
import kldiag

def peak_mb():  # VmHWM: ru_maxrss would include the parent's RSS at fork (kept across exec)
    return int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) / 1024

from kldiag.diagnosis import diagnose
from kldiag.report.summary import analyze_run
from kldiag.views import dashboard
run, mode, cache = sys.argv[1], sys.argv[2], sys.argv[3] == "freshcache"
if cache:
    shutil.rmtree(os.path.join(run, ".kldiag"), ignore_errors=True)
cfg = kldiag.AnalysisConfig(use_cache=cache)
os.sync()  # the previous measurement's cache files written back now, not during this one
t0 = time.perf_counter()
if mode == "command":  # what the `kldiag analyze` command computes before it prints
    a = analyze_run(run, cfg)
else:
    a = kldiag.analyze(run, cfg, dashboard.reducers() if mode == "dashboard" else ())
t1 = time.perf_counter()
if mode != "alone":
    diagnose(a)
t2 = time.perf_counter()
print(json.dumps({"analyze_s": t1 - t0, "diagnose_s": t2 - t1, "total_s": t2 - t0, "rows": a.info["rows"],
                  "steps": a.steps.num_rows, "sequences": a.sequences.num_rows,
                  "rss_mb": peak_mb()}))
"""
# diagnose() on a warm cache in a fresh process: argv run. Prints JSON: wall and CPU seconds, the fit's tokens.
DIAGNOSE = """
import json, sys, time
import kldiag
from kldiag.diagnosis import diagnose
from kldiag.mismatch import parity
from kldiag.views import dashboard
a = kldiag.analyze(sys.argv[1], kldiag.AnalysisConfig(), dashboard.reducers())
t0, c0 = time.perf_counter(), time.process_time()
d = diagnose(a)
t1, c1 = time.perf_counter(), time.process_time()
ts = parity.tokens_for(a)
print(json.dumps({"wall_s": t1 - t0, "cpu_s": c1 - c0, "causes": [c.cause for c in d.causes],
                  "fit_tokens": len(ts) if ts is not None else 0}))
"""
# One more step's part published into a run: argv run, synth config (JSON). Prints the new files (JSON).
PUBLISH = """
import json, sys
from kldiag.tools.synth import SynthConfig, make_run
cfg = json.loads(sys.argv[2])
cfg["seq_len"] = tuple(cfg["seq_len"])
n = cfg["steps"]
print(json.dumps([str(p) for p in make_run(sys.argv[1], SynthConfig(**{**cfg, "steps": n + 1}), steps=range(n, n + 1),
                                           manifest=False)]))
"""
# The app in a fresh process: argv main.py, JSON {"first": page, "then": [pages], "refresh": synth
# config or null, "profile": page or "refresh" or null}. Prints one JSON line of timings.
APP = """
import cProfile, json, os, re, sys, time
from pathlib import Path

def peak_mb():  # VmHWM: ru_maxrss would include the parent's RSS at fork (kept across exec)
    return int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) / 1024

from streamlit.testing.v1 import AppTest
main, spec = sys.argv[1], json.loads(sys.argv[2])

def page_of(at):
    titles = [t.value for t in at.title]
    return titles[0] if titles else "?"

PROF = {}
if spec.get("profile"):  # the script runs in AppTest's script thread: profile inside it
    from streamlit.runtime.scriptrunner import script_runner as SR
    real = SR.ScriptRunner._run_script_thread
    def profiled(self):
        prof = PROF.get("active")
        if prof is None:
            return real(self)
        prof.enable()
        try:
            return real(self)
        finally:
            prof.disable()
    SR.ScriptRunner._run_script_thread = profiled

def timed_run(at, label):
    if spec.get("profile") == label:
        PROF["active"] = cProfile.Profile()
    t, c = time.perf_counter(), time.process_time()
    at.run()
    s = time.perf_counter() - t
    CPU[label] = time.process_time() - c  # CPU seconds of the process (every thread): less noisy under load
    if PROF.get("active"):
        PROF.pop("active").dump_stats(f"/tmp/kldiag_dash_{label}.prof")
    return s

CPU = {}

at = AppTest.from_file(main, default_timeout=3600)
out = {"renders": []}
# AppTest scans every installed package for Streamlit components on its first run (about 0.5 s here);
# a server does that once when it starts, so it is done before the clock starts.
try:
    from streamlit.components.v2.component_manager import BidiComponentManager
    t = time.perf_counter()
    at._bidi_component_manager = BidiComponentManager()
    at._bidi_component_manager.discover_and_register_components(start_file_watching=False)
    out["component_scan_s"] = time.perf_counter() - t
except Exception:  # another Streamlit: the scan stays inside the first render
    out["component_scan_s"] = None
first = spec["first"]
if first != "overview":  # before the first run a page is found by its file name (= its url_path here)
    at.switch_page(f"app_pages/{first}.py")
s = timed_run(at, first)
out["renders"].append([first, s, page_of(at), [str(e.value)[:200] for e in at.exception]])
if spec.get("live"):  # the sidebar's Live turned on (from the next run), as a dashboard that refreshes has it
    at.toggle(key="live").set_value(True)
for page in spec.get("then", []):
    at.switch_page(f"app_pages/{page}.py")
    s = timed_run(at, page)
    out["renders"].append([page, s, page_of(at), [str(e.value)[:200] for e in at.exception]])
if spec.get("refresh"):
    # the new part is written by another process, as a recorder's is: its memory is not the app's
    import subprocess
    new = json.loads(subprocess.run([sys.executable, "-c", __PUBLISH__, os.environ["KLDIAG_RUNS"],
                                     json.dumps(spec["refresh"])], check=True, capture_output=True, text=True).stdout)
    try:
        s = timed_run(at, "refresh")
        out["refresh"] = [s, page_of(at), [str(e.value)[:200] for e in at.exception], len(new)]
    finally:
        for p in new:
            Path(p).unlink()
out["rss_mb"] = peak_mb()
out["cpu"] = CPU
out["numba"] = "numba" in sys.modules  # imported only when a compiled kernel ran (kldiag.jit)
print(json.dumps(out))
"""
APP = APP.replace("__PUBLISH__", repr(PUBLISH))
# A warm analyze with the dashboard's reducers in a fresh process: its seconds and the cache files it opens.
WARM = """
import json, sys, time
import kldiag
from kldiag.analysis import protocol as reduce
from kldiag.analysis.runtime import part_fold
from kldiag.views import dashboard
opened, load = [], reduce.load_arrays
reduce.load_arrays = lambda path, **kw: opened.append(str(path)) or load(path, **kw)
t = time.perf_counter()
a = kldiag.analyze(sys.argv[1], kldiag.AnalysisConfig(), dashboard.reducers())
merged = {name: a.reduced[name] for name in a.reduced}
print(json.dumps({"analyze_s": time.perf_counter() - t, "files": len(opened), "parts_read": a.files_new}))
"""
MAIN = Path(__file__).resolve().parent.parent / "app" / "main.py"
PAGES = ("distributions", "tokens", "sequence", "estimators", "overview", "tokens", "sequence", "estimators")
SCALE_PAGES = ("overview", "distributions", "tokens", "sequence", "estimators", "mismatch")


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


# --shape: "bench", short completions without token ids and 5% of tokens outside the loss, one at a time (a
# mask hole splits a turn: about 12 turns a sequence); "grpo", the shape of a GRPO run of a 7B-30B model,
# 1,000-2,750 tokens a completion, token ids of a 151,936-token vocabulary, one contiguous loss span a sequence.
SHAPES = {"bench": dict(seq_len=(150, 350), vocab_size=0),
          "grpo": dict(seq_len=(1000, 2750), vocab_size=151_936, unmasked_frac=0.0)}


def synth_config(args) -> SynthConfig:
    return SynthConfig(steps=args.steps, seqs_per_step=args.seqs_per_step, **SHAPES[args.shape],
                       blowup_step=args.steps * 3 // 4, blowup_frac=0.001, seed=7)


def load() -> str:
    return " ".join(open("/proc/loadavg").read().split()[:3]) if os.path.exists("/proc/loadavg") else "?"


def child(code: str, *argv: str, env: dict | None = None) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                         env={**os.environ, **(env or {})})
    if out.returncode:
        raise SystemExit(f"child failed ({out.returncode}): {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def classic(run: Path) -> None:
    shutil.rmtree(run / ".kldiag", ignore_errors=True)
    # The baseline in a fresh process: the app's process keeps analysis state in memory.
    out = subprocess.run([sys.executable, "-c", BASELINE, str(run)], check=True, capture_output=True, text=True)
    steps, rows, analysis, diagnosis = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"run: {steps} steps, {rows / 1e6:.1f}M rows; load average {os.getloadavg()[0]:.1f}")
    print(f"baseline kldiag.analyze cold (fresh process): {analysis:.2f} s; then diagnose: {diagnosis:.2f} s "
          f"({diagnosis / analysis:.2f}x the analysis)")

    from streamlit.testing.v1 import AppTest

    os.environ["KLDIAG_RUNS"] = str(run)
    shutil.rmtree(run / ".kldiag", ignore_errors=True)
    at = AppTest.from_file(str(MAIN), default_timeout=1800)
    _, first = timed(at.run)
    print(f"Overview first render (cold, server side): {first:.2f} s = {first / analysis:.2f}x the analysis")
    seen = set()
    for page in PAGES:
        at.switch_page(f"app_pages/{page}.py")
        _, t = timed(at.run)
        label = page if page not in seen else f"{page} again"
        seen.add(page)
        print(f"  switch to {label:18s} {t:6.2f} s = {t / analysis:.3f}x the analysis"
              + ("  (exception)" if at.exception else ""))


def tree() -> str:
    """This checkout's commit, and whether its kldiag/ or app/ has uncommitted changes (read-only git)."""
    root = MAIN.parent.parent
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "kldiag", "app"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"
    return head + (" + uncommitted kldiag/ or app/ changes" if dirty else "")


def breakdown(run: Path, args) -> None:
    """One thread, part by part: each reducer's read + reduce alone, and all in one read, per row."""
    from kldiag.analysis import AnalysisConfig
    from kldiag.analysis.core import partials
    from kldiag.analysis.pipeline import thresholds
    from kldiag.analysis.runtime import part_fold, runner
    from kldiag.format import open_run
    from kldiag.views import dashboard

    r = open_run(run)
    parts = r.parts()[:args.parts] if args.parts else r.parts()
    th = thresholds(AnalysisConfig(), r.manifest)
    first = [partials.AnalysisReducer(th)] + [runner.bound(x, r.parts()) for x in dashboard.reducers()]
    estimators = getattr(dashboard, "estimator_reducer", None)  # its own pass since cfbbec2
    extra = [estimators()] if estimators else []
    reds = first + [x for x in extra if x.name not in {y.name for y in first}]
    print(f"{run}: {len(parts)} parts; one thread; the least of {max(args.repeat, 1)} runs each; kldiag {tree()}; "
          f"load {load()}")

    def least(run) -> tuple[float, float]:  # (wall, CPU) of `run`, each the least of --repeat runs
        times = []
        for _ in range(max(args.repeat, 1)):
            t, c = time.perf_counter(), time.thread_time()
            run()
            times.append((time.perf_counter() - t, time.thread_time() - c))
        return min(w for w, _ in times), min(c for _, c in times)

    def read(columns) -> tuple[float, float]:
        def run():
            for p in parts:
                for _ in part_fold.part_batches(p, columns, runner.KERNEL_ROWS):
                    pass
        return least(run)

    n = sum(open_part_rows(p) for p in parts)
    read(part_fold.union_columns(reds))  # warm-up, not timed: the page cache, imports, numba's kernels
    part_fold.compute_part(parts[0], reds, runner.KERNEL_ROWS)
    base = None
    for label, columns in (("read the analysis's columns", part_fold.union_columns(reds[:1])),
                           ("read the first pass's columns", part_fold.union_columns(first))):
        s, c = read(columns)
        print(f"  {label:48s} {s:7.2f} s  {s / n * 1e9:6.1f} ns/row  CPU {c / n * 1e9:6.1f} ns/row  "
              f"({len(columns)} columns)")
    groups = [(f"{red.name} alone (read + reduce)", [red]) for red in reds]
    est = [x for x in reds if x.name == "estimators"]
    groups += [("the analysis and the Estimators reducer (riding)", reds[:1] + est),
               ("the first pass but the Estimators reducer", [x for x in first if x.name != "estimators"]),
               ("the dashboard's first pass, one read", first),
               ("the same and the Estimators reducer, one read", reds)]
    for label, group in groups:
        s, c = least(lambda: [part_fold.compute_part(p, group, runner.KERNEL_ROWS) for p in parts])
        base = base or c
        print(f"  {label:48s} {s:7.2f} s  {s / n * 1e9:6.1f} ns/row  CPU {c / n * 1e9:6.1f} ns/row  "
              f"{c / base:5.2f}x the analysis's CPU")


def open_part_rows(part) -> int:
    from kldiag.format import open_part

    return open_part(part, ["step"]).metadata.num_rows


def stats(xs: list[float]) -> str:
    return f"min {min(xs):.2f} / median {statistics.median(xs):.2f}"


def profile(run: Path, args) -> None:
    """One fresh app process on a warm cache: cProfile of `args.profile`'s first render (or of the refresh)."""
    import pstats

    env = {"KLDIAG_RUNS": str(run)}
    if not list(run.glob(".kldiag/prefix/*.json")):
        child(COLD, str(run), "dashboard", "freshcache")
    if args.profile == "refresh":
        # the scale figure's flow: every page visited, then one part published and the Overview rerun
        spec = {"first": "overview", "then": [*SCALE_PAGES[1:], "overview"], "refresh": dict(synth_config(args).__dict__),
                "profile": "refresh", "live": True}
    else:
        spec = {"first": args.profile, "profile": args.profile}
    f = child(APP, str(MAIN), json.dumps(spec), env=env)
    s = f["refresh"][0] if args.profile == "refresh" else f["renders"][0][1]
    path = f"/tmp/kldiag_dash_{args.profile}.prof"
    print(f"{args.profile}: {s:.2f} s (profiled); load {load()}; {path}; by cumulative time, the functions of "
          "kldiag and app/ (imports: importlib's _find_and_load):")
    pstats.Stats(path).sort_stats("cumulative").print_stats(r"kldiag/|/app/|_find_and_load\b", 45)


def diagnose_only(run: Path, args) -> None:
    """diagnose() alone on a warm cache (the Overview's detectors, the sample-based ones included), a fresh
    process per repeat."""
    if not list(run.glob(".kldiag/reducers/*.json")):
        child(COLD, str(run), "dashboard", "freshcache")
    for r in range(args.repeat):
        f = child(DIAGNOSE, str(run))
        print(f"diagnose #{r + 1}: {f['wall_s']:.3f} s, CPU {f['cpu_s']:.3f} s (fit on {f['fit_tokens']:,} tokens; "
              f"causes {', '.join(f['causes']) or 'none'}); load {load()}", flush=True)


def scale(run: Path, args) -> None:
    print(f"kldiag {tree()}")
    print(f"run {run}: {sum(p.stat().st_size for p in run.glob('tokens/rank-*/*.parquet')) / 1e9:.2f} GB in "
          f"{len(list(run.glob('tokens/rank-*/*.parquet')))} parts; load average at start {load()}", flush=True)
    env = {"KLDIAG_RUNS": str(run)}
    if args.warm_only:  # the warm figures only, on the cache as the dashboard leaves it
        if not list(run.glob(".kldiag/reducers/*.json")):
            child(COLD, str(run), "dashboard", "freshcache")
        child(APP, str(MAIN), json.dumps({"first": "overview", "then": list(SCALE_PAGES[1:])}), env=env)  # the store
        return warm(run, args, env)
    # "cold" is kldiag's cache and a fresh process, not the disk: the first measurement would otherwise be the
    # only one that reads the run from disk (15.3 s against 10.6 s at 300M rows for the same bare analysis)
    s = page_cache_warm(run)
    print(f"the run's parts read once into the page cache: {s:.1f} s", flush=True)
    cold: dict[tuple[str, str], list[dict]] = {}
    for r in range(args.repeat):  # interleaved: alone, dashboard, alone, dashboard, ...
        for cache in ("nocache", "freshcache"):
            for mode in ("alone", "command", "dashboard"):
                f = child(COLD, str(run), mode, cache)
                f["load"] = load()
                cold.setdefault((mode, cache), []).append(f)
                print(f"  cold {mode:9s} {cache:10s} #{r + 1}: analyze {f['analyze_s']:.2f} s + diagnose "
                      f"{f['diagnose_s']:.2f} s = {f['total_s']:.2f} s; peak RSS {f['rss_mb']:.0f} MB; "
                      f"load {f['load']}", flush=True)
    cold_summary(cold)
    if args.cold_only:
        return
    # warm the cache the way the dashboard leaves it once every page was visited: its first pass, then
    # the Estimators page's first visit (timed: a tree whose first pass lacks its reducer reads every part)
    # and the Mismatch page's (its view stored: kldiag.analysis.cache.store)
    child(COLD, str(run), "dashboard", "freshcache")
    f = child(APP, str(MAIN), json.dumps({"first": "overview", "then": ["estimators", "mismatch"]}), env=env)
    print(f"\nafter a cold first pass: Overview {f['renders'][0][1]:.2f} s, then the Estimators page's first visit "
          f"ever {f['renders'][1][1]:.2f} s; "
          f"peak RSS {f['rss_mb']:.0f} MB; load {load()}", flush=True)
    warm(run, args, env)


def derived(run: Path) -> list[Path]:
    """What the pages derive and keep: the result store's entries, the sequence pieces' top rows."""
    return [*run.glob(".kldiag/results/*"), *run.glob(".kldiag/prefix/seqs/*.top*.parquet")]


def first_open(run: Path, env: dict) -> Path:
    """Nothing derived kept, then one Overview render (the dashboard's first open): a copy of what it kept."""
    for path in derived(run):
        path.unlink()
    child(APP, str(MAIN), json.dumps({"first": "overview"}), env=env)
    saved = Path(os.environ.get("TMPDIR", "/tmp")) / f"kldiag_first_open_{os.getpid()}"
    shutil.rmtree(saved, ignore_errors=True)
    for path in derived(run):
        (saved / path.parent.relative_to(run)).mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, saved / path.relative_to(run))
    return saved


def put_back(run: Path, saved: Path) -> None:
    """What the first open kept, and nothing else."""
    for path in derived(run):
        path.unlink()
    for path in saved.rglob("*"):
        if path.is_file():
            shutil.copy2(path, run / path.relative_to(saved))


def page_cache_warm(run: Path) -> float:
    """Read every part file of `run` once (its pages cached by the OS); the seconds it took."""
    t = time.perf_counter()
    for path in sorted(run.glob("tokens/rank-*/*.parquet")):
        with open(path, "rb") as f:
            while f.read(16 << 20):
                pass
    return time.perf_counter() - t


def cold_summary(cold: dict) -> None:
    f0 = cold[("alone", "nocache")][0]
    print(f"\nrun: {f0['rows'] / 1e6:.1f}M rows, {f0['steps']} steps, {f0['sequences'] / 1e6:.2f}M sequences")
    for cache in ("nocache", "freshcache"):
        alone, command, dash = ([f["total_s"] for f in cold[(m, cache)]] for m in ("alone", "command", "dashboard"))
        print(f"cold ({cache}): analyze alone {stats(alone)} s; analyze + dashboard reducers + diagnose "
              f"{stats(dash)} s: {min(dash) / min(alone):.2f}x (min/min), "
              f"{statistics.median(dash) / statistics.median(alone):.2f}x (median/median)  (target <= 1.3x)")
        print(f"  against the `kldiag analyze` command (its reducers and diagnose) {stats(command)} s: "
              f"{min(dash) / min(command):.2f}x (min/min), "
              f"{statistics.median(dash) / statistics.median(command):.2f}x (median/median)")


def warm(run: Path, args, env: dict) -> None:
    """Each page's first render in a fresh app process on a warm cache, then the refresh."""
    f = child(WARM, str(run))
    print(f"\nwarm analyze with the dashboard's reducers (fresh process, every reducer merged): {f['analyze_s']:.2f} s, "
          f"{f['files']} cache files opened, {f['parts_read']} parts read; load {load()}", flush=True)
    print("\nwarm cache, a fresh app process per page, that page rendered first (target <= 1.5 s)"
          + (", each its first visit after the first open:" if args.first_visit else ":"))
    firsts: dict[str, list[float]] = {}
    cpus: dict[str, list[float]] = {}
    opened = first_open(run, env) if args.first_visit else None
    for r in range(args.repeat):
        for page in SCALE_PAGES:
            if opened is not None:
                put_back(run, opened)
            f = child(APP, str(MAIN), json.dumps({"first": page}), env=env)
            name, s, title, exc = f["renders"][0]
            firsts.setdefault(page, []).append(s)
            cpus.setdefault(page, []).append(f["cpu"][page])
            print(f"  {page:14s} #{r + 1}: {s:6.2f} s, CPU {f['cpu'][page]:5.2f} s  ({title}"
                  f"{'; EXCEPTION ' + str(exc) if exc else ''}); "
                  f"peak RSS {f['rss_mb']:.0f} MB; numba {'imported' if f.get('numba') else 'not imported'}; "
                  f"load {load()}", flush=True)
    if opened is not None:
        shutil.rmtree(opened, ignore_errors=True)
    print("\nwarm cache, one fresh app process: Overview, every page, Overview again, one part published, refresh:")
    cfg = synth_config(args).__dict__
    for r in range(args.repeat):
        spec = {"first": "overview", "then": [*SCALE_PAGES[1:], "overview"], "refresh": dict(cfg), "live": True}
        f = child(APP, str(MAIN), json.dumps(spec), env=env)
        line = ", ".join(f"{name} {s:.2f}" + (" (EXCEPTION)" if exc else "") for name, s, _, exc in f["renders"])
        s, title, exc, n = f["refresh"]
        print(f"  #{r + 1}: {line}; refresh after {n} new part: {s:.2f} s, CPU {f['cpu']['refresh']:.2f} s ({title}"
              f"{'; EXCEPTION ' + str(exc) if exc else ''}); peak RSS {f['rss_mb']:.0f} MB; load {load()}",
              flush=True)
    print("\nsummary (s):")
    for page in SCALE_PAGES:
        print(f"  {page:14s} first render (fresh process, warm cache): {stats(firsts[page])}; "
              f"CPU {stats(cpus[page])}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--seqs-per-step", type=int, default=60,
                    help="60: 30M rows at 2,000 steps; 600: 300M (--shape grpo: 8 and 80)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="bench",
                    help="the synthetic run written when --run does not exist (SHAPES)")
    ap.add_argument("--run", default="/tmp/kldiag_bench_dash")
    ap.add_argument("--scale", action="store_true", help="the fresh-process figures above instead of the default")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--warm-only", action="store_true",
                    help="with --scale: only the warm first renders and the refresh (no cold analyses)")
    ap.add_argument("--first-visit", action="store_true",
                    help="with --scale --warm-only: each page timed as its first visit after the first open")
    ap.add_argument("--cold-only", action="store_true",
                    help="with --scale: only the cold analyses and their ratio (no Estimators visit, no warm renders)")
    ap.add_argument("--breakdown", action="store_true",
                    help="only: each reducer's read + reduce time per row, one thread (--parts N: the first N)")
    ap.add_argument("--parts", type=int, default=0)
    ap.add_argument("--profile", choices=[*SCALE_PAGES, "refresh"],
                    help="only a cProfile of this page's warm first render in a fresh process (or of the refresh)")
    ap.add_argument("--diagnose", action="store_true",
                    help="only: diagnose() on a warm cache in a fresh process, --repeat times (wall and CPU)")
    args = ap.parse_args()
    run = Path(args.run)
    if not run.exists():
        t = time.perf_counter()
        make_run(run, synth_config(args))
        print(f"wrote {run} in {time.perf_counter() - t:.0f} s")
    if args.breakdown:
        breakdown(run, args)
    elif args.diagnose:
        diagnose_only(run, args)
    elif args.profile:
        profile(run, args)
    elif args.scale:
        scale(run, args)
    else:
        classic(run)


if __name__ == "__main__":
    main()
