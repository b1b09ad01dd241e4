"""Dashboard cost on a large synthetic run, server side: where the first render goes and what a
page switch costs once the run is analysed, as ratios to the cold analysis measured in the same run.

    .venv/bin/python bench/dashboard.py [--steps 2000] [--run /tmp/kldiag_bench_dash]

The browser-side figures (what a user waits for, rendering included) come from the browser
test: KLDIAG_BENCH_DASHBOARD=1 pytest -s tests/test_browser_dash.py -k speed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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
MAIN = Path(__file__).resolve().parent.parent / "app" / "main.py"
PAGES = ("distributions", "tokens", "sequence", "estimators", "overview", "tokens", "sequence", "estimators")


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--run", default="/tmp/kldiag_bench_dash")
    args = ap.parse_args()
    run = Path(args.run)
    if not run.exists():
        make_run(run, SynthConfig(steps=args.steps, seqs_per_step=60, seq_len=(150, 350), vocab_size=0,
                                  blowup_step=args.steps * 3 // 4, blowup_frac=0.001, seed=7))
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


if __name__ == "__main__":
    main()
