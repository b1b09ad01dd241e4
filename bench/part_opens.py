"""How many times `kldiag report RUN` opens each part file, cold (no RUN/.kldiag) and warm (run again),
counted by the kernel: `strace -ff -e trace=openat` around the CLI, only successful opens of the run's
part files (tokens/rank-*/part-*.parquet) counted.

    .venv/bin/python bench/part_opens.py                         # sample_logs/demo_k3 (copied without .kldiag)
    .venv/bin/python bench/part_opens.py /tmp/kldiag_bench_dash  # any run; its .kldiag is deleted first
    .venv/bin/python bench/part_opens.py --before /tmp/kl_before # also the checkout at that path

Each checkout runs as `PYTHONPATH=CHECKOUT python -m kldiag report RUN -o OUT` from a neutral working
directory (the import is checked: kldiag.__file__ must lie in CHECKOUT). strace runs with -ff (one
log per thread), so no call is split over two lines by another thread. Without strace (Debian:
apt-get install strace) it says so and counts nothing. tests/test_part_opens.py checks the same rule
in-process (PartInfo.open); strace also sees opens that bypass it (pyarrow, a metadata read, ...).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OPEN_RE = re.compile(r'openat\([^,]+, "([^"]+)", [^)]*\)\s*=\s*(-?\d+)')


def checkout_kldiag(checkout: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    out = subprocess.run([sys.executable, "-c", "import kldiag; print(kldiag.__file__)"], env=env, cwd="/",
                         capture_output=True, text=True, check=True)
    return out.stdout.strip()


def traced_report(checkout: Path, run: Path, out_html: Path, log: Path) -> tuple[Counter, Counter, float]:
    """(opens per part file, opens of cache files under RUN/.kldiag, seconds) of one `kldiag report`."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    # -ff: one output file per thread (LOG.<tid>). With -f alone, a call that another thread interrupts
    # is printed as "openat(... <unfinished ...>" then "<... openat resumed>) = fd": the path and the
    # result on two lines, which a line-by-line count misses.
    for old in log.parent.glob(f"{log.name}.*"):
        old.unlink()
    cmd = ["strace", "-ff", "-qq", "-e", "trace=openat", "-o", str(log),
           sys.executable, "-m", "kldiag", "report", str(run), "-o", str(out_html)]
    t = time.perf_counter()
    done = subprocess.run(cmd, env=env, cwd="/", capture_output=True, text=True)
    seconds = time.perf_counter() - t
    if done.returncode != 0 or not out_html.exists():  # exit 1 only with --fail-on, which is not given
        raise SystemExit(f"kldiag report failed ({done.returncode}): {done.stderr[-2000:]}")
    out_html.unlink()
    parts, cache = Counter(), Counter()
    tokens, kldiag_dir = f"{run}/tokens/", f"{run}/.kldiag/"
    logs = sorted(log.parent.glob(f"{log.name}.*"))
    for line in (line for f in logs for line in f.read_text(errors="replace").splitlines()):
        m = OPEN_RE.search(line)
        if not m or int(m.group(2)) < 0:
            continue
        path = m.group(1)
        if path.startswith(tokens) and path.endswith(".parquet"):
            parts[path] += 1
        elif path.startswith(kldiag_dir):
            cache[path] += 1
    return parts, cache, seconds


def row(label: str, n_parts: int, opens: Counter, cache: Counter, seconds: float) -> str:
    counts = [opens.get(p, 0) for p in opens] + [0] * (n_parts - len(opens))
    return (f"| {label} | {n_parts} | {sum(counts)} | {min(counts)} | {max(counts)} | {sum(cache.values())} "
            f"| {seconds:.1f} |")


def commit(checkout: Path) -> str:
    """The checkout's commit, and whether its kldiag/ has uncommitted changes (read-only git)."""
    try:
        head = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(checkout), "status", "--porcelain", "--", "kldiag"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "commit unknown"
    return head + (" + uncommitted kldiag/ changes" if dirty else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="*", type=Path, default=[ROOT / "sample_logs" / "demo_k3"],
                    help="run directories; one under sample_logs/ is copied first (without its .kldiag)")
    ap.add_argument("--before", type=Path, help="another checkout to count too (e.g. /tmp/kl_before)")
    args = ap.parse_args()
    if shutil.which("strace") is None:
        print("strace is not installed (Debian: apt-get install strace): no opens counted")
        return
    checkouts = [("this tree", ROOT)] + ([("before", args.before.resolve())] if args.before else [])
    for name, checkout in checkouts:
        where = checkout_kldiag(checkout)
        if not where.startswith(str(checkout) + "/"):
            raise SystemExit(f"{name}: PYTHONPATH={checkout} imports {where}, not that checkout")
        print(f"{name}: kldiag from {where} ({commit(checkout)})")
    print(f"load average {os.getloadavg()[0]:.2f}")
    print("\n| run / checkout / cache | part files | opens | min per part | max per part | opens under RUN/.kldiag "
          "(reads and writes) | s |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="kldiag-opens-") as tmp:
        tmp = Path(tmp)
        for src in args.runs:
            src = src.resolve()
            run = src
            if (ROOT / "sample_logs") in src.parents:  # never touch the repository's sample: copy it
                run = tmp / src.name
                shutil.copytree(src, run, ignore=shutil.ignore_patterns(".kldiag"))
            n_parts = len(list((run / "tokens").glob("rank*/part-*.parquet")))
            for name, checkout in checkouts:
                shutil.rmtree(run / ".kldiag", ignore_errors=True)
                for state in ("cold", "warm"):
                    opens, cache, s = traced_report(checkout, run, tmp / "out.html", tmp / "strace.log")
                    print(row(f"{src.name} / {name} / {state}", n_parts, opens, cache, s), flush=True)
            shutil.rmtree(run / ".kldiag", ignore_errors=True)


if __name__ == "__main__":
    main()
