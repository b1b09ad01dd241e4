"""Every chart of every page reads without hovering, and the dashboard works offline, in a real
headless Chromium at 1400 px on the demo's two runs (sample_logs/demo_k3, demo_k3_is: what
`kldiag demo` writes):

- in each chart the text (title, subtitle, axis titles, tick labels, legend entries, onset labels)
  does not overlap, no title is cut at the chart's edge, and every axis has a title;
- every log axis has at least two labelled ticks, all at decades;
- every request a page makes goes to 127.0.0.1 (no favicon or font from the internet).

One `kldiag dashboard` serves both runs for the whole module. Screenshots of every page land in
artifacts/screenshots/charts_<run>_<page>.png (docs/img has the Overview's and the Mismatch page's).
"""

from __future__ import annotations

import shutil
from urllib.parse import urlsplit

import pytest
from playwright.sync_api import Page, sync_playwright
from test_browser import CHROMIUM, CHROMIUM_ARGS, ROOT, SHOTS, _serve

pytestmark = pytest.mark.slow

RUNS = ("demo_k3", "demo_k3_is")
PAGES = {"overview": ".main-svg", "distributions": ".main-svg", "tokens": '[data-testid="stDataFrame"]',
         "sequence": ".main-svg", "estimators": ".main-svg", "compare": ".main-svg", "mismatch": ".main-svg"}
WIDTH = 1400
LOCAL = {"127.0.0.1"}

# Per chart: every text box that must not overlap another, the title's and the plot's boxes, the axes.
TEXTS = """() => [...document.querySelectorAll('.js-plotly-plot')].filter(p => p.getBoundingClientRect().width > 0)
  .map((p, i) => {
    const box = e => { const r = e.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
    const kinds = {title: '.gtitle', subtitle: '.gtitle-subtitle', xtitle: '.g-xtitle text', ytitle: '.g-ytitle text',
                   xtick: '.xtick text', ytick: '.ytick text', legend: '.legendtext', onset: '.annotation-text',
                   cbtitle: '.cbtitle text', cbtick: '.cbaxis text'};
    const texts = [];
    for (const [kind, sel] of Object.entries(kinds)) {
      for (const e of p.querySelectorAll(sel)) {
        const t = (e.textContent || '').trim();
        const r = e.getBoundingClientRect();
        if (t && r.width > 0 && r.height > 0 && getComputedStyle(e).visibility !== 'hidden' &&
            e.closest('[display="none"]') === null) texts.push({kind, text: t, box: box(e)});
      }
    }
    const fl = p._fullLayout;
    const axes = Object.keys(fl).filter(k => /^[xy]axis\\d*$/.test(k) && fl[k].visible !== false)
      .map(k => ({name: k, type: fl[k].type, title: (fl[k].title && fl[k].title.text) || ''}));
    const logTicks = {};
    for (const a of axes.filter(a => a.type === 'log')) {
      const sel = a.name[0] === 'x' ? '.xtick text' : '.ytick text';
      logTicks[a.name] = [...p.querySelectorAll(sel)].map(e => e.textContent.trim()).filter(t => t);
    }
    const svg = p.querySelector('.main-svg');
    return {i, title: (fl.title && fl.title.text) || '', plot: box(svg), texts, axes, logTicks};
  })"""


def overlaps(a: list[float], b: list[float], slack: float = 1.0) -> bool:
    """Two boxes [left, top, right, bottom] share more than `slack` px in both directions."""
    return min(a[2], b[2]) - max(a[0], b[0]) > slack and min(a[3], b[3]) - max(a[1], b[1]) > slack


def chart_problems(chart: dict) -> list[str]:
    """What a reader would stumble on in one chart: overlapping text, a cut title, an untitled axis,
    a log axis without two decade labels."""
    out, texts, name = [], chart["texts"], chart["title"] or f"chart {chart['i']}"
    for i, a in enumerate(texts):
        for b in texts[i + 1:]:
            if overlaps(a["box"], b["box"]):
                out.append(f"{name}: {a['kind']} {a['text']!r} overlaps {b['kind']} {b['text']!r}")
    left, _, right, _ = chart["plot"]
    for t in texts:
        if t["kind"] in ("title", "subtitle") and (t["box"][0] < left - 1 or t["box"][2] > right + 1):
            out.append(f"{name}: {t['kind']} {t['text']!r} is cut at the chart's edge")
    for axis in chart["axes"]:
        if not axis["title"].strip():
            out.append(f"{name}: {axis['name']} has no title")
    for axis, labels in chart["logTicks"].items():
        if len(labels) < 2:
            out.append(f"{name}: log {axis} has {len(labels)} labelled tick(s): {labels}")
        bad = [t for t in labels if not (t in ("1", "10") or t.startswith("10"))]
        if bad:
            out.append(f"{name}: log {axis} labels {bad} between decades")
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo_runs")
    runs = [shutil.copytree(ROOT / "sample_logs" / name, root / name, ignore=shutil.ignore_patterns(".kldiag"))
            for name in RUNS]
    with _serve(*runs) as url:
        yield url


@pytest.fixture(scope="module")
def browser_page():
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": WIDTH, "height": 1200})
        page.requests = []
        page.on("request", lambda r: page.requests.append(r.url))
        yield page
        browser.close()


def _shoot(page: Page, url: str, run: str, name: str) -> None:
    page.set_viewport_size({"width": WIDTH, "height": 1200})
    page.goto(f"{url}/{name}?run={run}")
    page.locator(PAGES[name]).first.wait_for(timeout=180_000)  # the Estimators page reads every part on its first visit
    page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')", timeout=180_000)
    height = page.evaluate("() => Math.max(...[...document.querySelectorAll('[data-testid=\"stMain\"], "
                           "[data-testid=\"stMainBlockContainer\"]')].map(e => e.scrollHeight), 800)")
    page.set_viewport_size({"width": WIDTH, "height": min(height + 40, 9000)})  # the whole page, charts drawn
    page.wait_for_timeout(800)
    page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')", timeout=180_000)
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"charts_{run}_{name}.png"), full_page=True)


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("name", list(PAGES))
def test_charts_read_without_hovering_and_stay_offline(served, browser_page, run, name):
    page = browser_page
    page.requests.clear()
    _shoot(page, served, run, name)
    assert page.locator('[data-testid="stException"]').count() == 0
    assert page.get_by_text("Page not found").count() == 0
    charts = page.evaluate(TEXTS)
    if PAGES[name] == ".main-svg":
        assert charts, f"{name} drew no chart"
    problems = [p for chart in charts for p in chart_problems(chart)]
    assert problems == [], "\n".join(problems)
    outside = sorted({u for u in page.requests if urlsplit(u).scheme in ("http", "https", "ws", "wss")
                      and urlsplit(u).hostname not in LOCAL})
    assert outside == [], f"{name} requested {outside}"


def test_deep_links_say_where_they_went(served, browser_page):
    page = browser_page
    page.goto(f"{served}/overview?run=demo_k3_is")  # the Overview by its name, not only at the root
    page.locator(".main-svg").first.wait_for(timeout=60_000)
    assert page.get_by_text("Page not found").count() == 0
    assert page.get_by_text("Verdict:", exact=False).count() >= 1
    page.goto(f"{served}/?run=nosuch")
    page.get_by_text("does not show", exact=False).first.wait_for(timeout=60_000)
    assert page.get_by_text("nosuch", exact=False).count() >= 1
    page.goto(f"{served}/sequence?run=demo_k3&step=9999&seq=1")
    notice = page.get_by_text("the run has no step 9999", exact=False).first
    notice.wait_for(timeout=60_000)
    assert "showing the worst sequence instead" in notice.inner_text()
