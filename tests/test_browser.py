"""The dashboard in a real headless Chromium: `kldiag dashboard` serves two sample runs,
every page loads without a Streamlit exception and draws its charts, hostile token text
stays text, and the live toggle shows a part published while the app runs.

Uses Debian's chromium (`make browser` installs it); playwright downloads nothing.
Screenshots land in artifacts/screenshots/ (gitignored).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import APP_EVIL_PIECE, app_make_runs
from playwright.sync_api import Page, expect, sync_playwright

from kldiag.tools.synth import SynthConfig, make_run

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
SHOTS = ROOT / "artifacts" / "screenshots"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
# url_path -> what proves the page drew: plotly charts, or the flags table's grid.
# Overview is the default page: Streamlit serves it at the root, not under its url_path.
PAGES = {"": ".main-svg", "distributions": ".main-svg", "tokens": '[data-testid="stDataFrame"]',
         "sequence": ".main-svg", "estimators": ".main-svg", "compare": ".main-svg", "mismatch": ".main-svg"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kldiag dashboard exited with {proc.returncode}: {log.read_text()}")
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"the dashboard did not answer on {url} within {timeout:.0f} s")


@contextlib.contextmanager
def _serve(*runs: Path):
    """`kldiag dashboard RUN...` on a free loopback port, as a user starts it."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("KLDIAG_RUNS", None)
    log = (runs[0].parent if isinstance(runs[0], Path) else Path(tempfile.gettempdir())) / f"dashboard-{port}.log"
    # A log file, not a pipe: nobody reads a pipe while the tests run, and a full pipe
    # blocks the server. Its own session, so that cleanup reaches every process of it.
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kldiag", "dashboard", *map(str, runs), "--port", str(port)],
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc, log)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    runs = app_make_runs(tmp_path_factory.mktemp("browser_runs"))
    with _serve(runs["k3"], runs["k3_is"]) as url:
        yield url, runs


@pytest.fixture(scope="module")
def sample_server(tmp_path_factory):
    """The shipped demo pair (sample_logs/), copied so the analysis cache stays out of the repo."""
    root = tmp_path_factory.mktemp("sample_runs")
    runs = [shutil.copytree(ROOT / "sample_logs" / name, root / name,
                            ignore=shutil.ignore_patterns(".kldiag")) for name in ("demo_k3", "demo_k3_is")]
    with _serve(*runs) as url:
        yield url


@pytest.fixture(scope="module")
def page():
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        pg = browser.new_page(viewport={"width": 1400, "height": 2200})
        pg.dialogs = []
        pg.on("dialog", lambda d: (pg.dialogs.append(d.message), d.dismiss()))
        yield pg
        browser.close()


def _open(page: Page, url: str, path: str, ready: str) -> None:
    page.goto(f"{url}/{path}")
    # A page's first render on a clean clone may compile kernels no earlier test used (a cold numba cache, the
    # other core busy with a second test worker): over 30 s seen, so a wide limit; a render that works waits less.
    page.locator(ready).first.wait_for(timeout=120_000)
    # Streamlit keeps adding elements while the script runs; wait for the run to finish.
    page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')", timeout=120_000)


@pytest.mark.parametrize("path", list(PAGES), ids=[p or "overview" for p in PAGES])
def test_page_renders_charts_without_exception(server, page, path):
    url, _ = server
    _open(page, url, path, PAGES[path])
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{path or 'overview'}.png"), full_page=True)
    assert page.locator('[data-testid="stException"]').count() == 0
    assert page.locator(PAGES[path]).count() >= 1
    assert page.get_by_text("Page not found").count() == 0


def test_sequence_shows_hostile_piece_as_text(server, page):
    url, _ = server
    _open(page, url, "sequence", ".kldiag-seq")
    seq = page.locator(".kldiag-seq")  # one block per turn when the sequence has several
    assert APP_EVIL_PIECE in " ".join(seq.all_inner_texts())
    assert page.locator(".kldiag-seq img").count() == 0
    assert page.dialogs == []


def test_live_toggle_shows_new_step(server, page):
    url, runs = server
    _open(page, url, "", ".main-svg")
    steps = page.locator('[data-testid="stMetric"]').filter(has_text="Steps").first
    expect(steps).to_contain_text("12")
    page.get_by_text("Live", exact=True).click()
    make_run(runs["k3"], SynthConfig(steps=13, seqs_per_step=16, seq_len=(8, 24), vocab_size=64, seed=1),
             steps=range(12, 13), manifest=False)
    expect(steps).to_contain_text("13", timeout=45_000)
    assert page.locator('[data-testid="stException"]').count() == 0


def test_mismatch_sections_below_the_fold_open(sample_server, page):
    """The what-if and the crosswalk run only once their expanders are opened: closed, no figure of theirs; a
    click reruns the page and draws them."""
    _open(page, sample_server, "mismatch", ".main-svg")
    main = page.locator('[data-testid="stMain"]')
    assert main.get_by_text("Tokens masked or clipped").count() == 0
    assert main.locator('[data-testid="stDataFrame"]').count() == 0
    page.get_by_text("What if: corrections replayed").first.click()
    # each section's first computation may compile kernels (_open): CI saw the crosswalk's table take over 30 s
    expect(main.get_by_text("Tokens masked or clipped").first).to_be_visible(timeout=120_000)
    page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')", timeout=120_000)
    page.get_by_text("The framework's own metrics (crosswalk)").first.click()
    expect(main.locator('[data-testid="stDataFrame"]').first).to_be_visible(timeout=120_000)  # the framework's table
    page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')", timeout=30_000)
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / "sample_mismatch_opened.png"), full_page=True)
    assert page.locator('[data-testid="stException"]').count() == 0


@pytest.mark.parametrize("path", list(PAGES), ids=[p or "overview" for p in PAGES])
def test_sample_run_pages_render(sample_server, page, path):
    _open(page, sample_server, path, PAGES[path])
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"sample_{path or 'overview'}.png"), full_page=True)
    assert page.locator('[data-testid="stException"]').count() == 0
    assert page.locator(PAGES[path]).count() >= 1
    if path == "":  # the demo's K3 run blows up: the Overview says so
        assert page.get_by_text("weight_blowup", exact=False).count() >= 1
