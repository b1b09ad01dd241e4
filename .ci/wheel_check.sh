#!/usr/bin/env bash
# The wheel is the whole tool: build it with the standard front end, install it (not editable) into a fresh
# virtual environment OUTSIDE the checkout, and run the demo, a report, the Grafana files and the dashboard
# from it, one dashboard page rendered in headless Chromium. Called by `make test`; about 2-3 minutes.
#
#   .ci/wheel_check.sh [PYTHON]    # PYTHON: the interpreter with `build` and playwright (default .venv/bin/python)
#   BUILD_PY=/other/python .ci/wheel_check.sh   # build with another interpreter's `build`
#   KEEP=1 .ci/wheel_check.sh                    # keep the work folder (the venv, the demo runs) and say where
set -euo pipefail
cd "$(dirname "$0")/.."
CHECKOUT=$PWD
PY=${1:-$CHECKOUT/.venv/bin/python}
case $PY in /*) ;; *) PY=$CHECKOUT/$PY ;; esac  # `make test` passes .venv/bin/python; the script leaves the checkout
BUILD_PY=${BUILD_PY:-$PY}
case $BUILD_PY in /*) ;; *) BUILD_PY=$CHECKOUT/$BUILD_PY ;; esac
WORK=$(mktemp -d /tmp/kldiag-wheel-check.XXXXXX)
PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
SERVER=""
cleanup() {
  if [ -n "$SERVER" ]; then kill "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true; fi
  if [ -n "${KEEP:-}" ]; then echo "wheel-check: kept $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
t0=$SECONDS
step() { echo "wheel-check [$((SECONDS - t0))s] $*"; }

step "build: $BUILD_PY -m build --outdir $WORK/dist"
"$BUILD_PY" -m build --outdir "$WORK/dist" "$CHECKOUT" >"$WORK/build.log" 2>&1 || { cat "$WORK/build.log"; exit 1; }
rm -rf "$CHECKOUT/build" "$CHECKOUT"/kldiag.egg-info  # the build's own by-products, not the checkout's
WHEEL=$(ls "$WORK"/dist/kldiag-*.whl)
step "built $(basename "$WHEEL") and $(basename "$(ls "$WORK"/dist/kldiag-*.tar.gz)")"

step "fresh venv $WORK/venv; torch first (the CPU build), then the wheel"
python3 -m venv "$WORK/venv"
VPY=$WORK/venv/bin/python
# --no-compile: no bytecode for torch's thousands of modules up front (what runs compiles its own)
"$VPY" -m pip install -q --no-compile -c "$CHECKOUT/constraints.txt" torch==2.13.0
"$VPY" -m pip install -q --no-compile -c "$CHECKOUT/constraints.txt" "$WHEEL"
cd "$WORK"  # nothing of the checkout is importable from here
"$VPY" - <<'PY'
import kldiag, pathlib
where = pathlib.Path(kldiag.__file__).resolve()
assert "site-packages" in str(where), where  # the installed copy, not the checkout
assert (where.parent / "_app" / "main.py").is_file() and (where.parent / "_grafana" / "kldiag.json").is_file()
print("kldiag imported from", where.parent)
PY
KL=$WORK/venv/bin/kldiag

step "kldiag --version"
"$KL" --version
step "kldiag demo --no-dashboard --quiet --out runs"
"$KL" demo --no-dashboard --quiet --out runs
step "kldiag report runs/demo_k3 -o k3.html --fail-on blowup (exits 1: it blows up)"
rc=0; "$KL" report runs/demo_k3 -o k3.html --fail-on blowup >report.txt || rc=$?
head -3 report.txt
[ "$rc" = 1 ] && grep -q "kldiag report:" k3.html
step "kldiag grafana --out grafana"
"$KL" grafana --out grafana
"$VPY" -c 'import json; json.load(open("grafana/kldiag.json"))'
step "kldiag dashboard runs/demo_k3 runs/demo_k3_is --port $PORT"
"$KL" dashboard runs/demo_k3 runs/demo_k3_is --port "$PORT" >dashboard.log 2>&1 &
SERVER=$!
"$PY" - "$PORT" <<'PY'
import sys, time, urllib.request
from playwright.sync_api import sync_playwright

url = f"http://127.0.0.1:{sys.argv[1]}"
for _ in range(120):  # the app starts in a few seconds
    try:
        urllib.request.urlopen(url + "/_stcore/health", timeout=2).read()
        break
    except OSError:
        time.sleep(0.5)
else:
    sys.exit("the dashboard did not answer in 60 s")
with sync_playwright() as p:
    b = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--headless", "--no-sandbox", "--disable-gpu"])
    page = b.new_page()
    page.goto(url, timeout=60_000)
    page.get_by_text("Verdict: UNSTABLE").first.wait_for(timeout=90_000)  # the Overview's verdict of demo_k3
    body = page.inner_text("body")
    assert "k3_weight_blowup" in body and "Traceback" not in body and "Error" not in body, body[:3000]
    b.close()
print("dashboard page rendered in Chromium: Overview, 'Verdict: UNSTABLE', cause k3_weight_blowup")
PY
step "done"
