"""Every dashboard page on the tiny-MoE truth runs (no logp_ref, no advantages; kldiag.tools.truth_moe) in a real
headless Chromium: never a green all-clear beside their non-healthy verdict, never a `nan` tile, never a chart
with nothing drawn (with a legend of lines never drawn, or none), never a page opening on an unmeasured metric; the Mismatch page opens on routing and names the broken layer and the 1% limit.
The dashboard is served as tests/test_browser.py serves it (its helpers are reused)."""

from __future__ import annotations

import time

import pytest
from playwright.sync_api import sync_playwright
from test_browser import CHROMIUM, CHROMIUM_ARGS, SHOTS, _serve

from kldiag.tools.truth_moe import MOE_SCENARIOS, make_run

pytestmark = pytest.mark.slow

RUNS = ("moe_no_replay", "moe_replay_broken_layer1")
PAGES = ("", "distributions", "tokens", "sequence", "estimators", "compare", "mismatch")
# per chart: its title, how many legend entries it shows, whether any of its traces draws a finite value
CHARTS_JS = """() => Array.from(document.querySelectorAll('.js-plotly-plot')).map(el => {
  const data = el._fullData || [];
  const ok = v => v !== null && v !== undefined && Number.isFinite(Number(v));
  const values = t => Array.from(t.type === 'heatmap' ? Array.from(t.z || []).flatMap(r => Array.from(r || [])) : (t.y || []));
  const legend = (el._fullLayout || {}).showlegend === false ? [] : data.filter(t => t.showlegend !== false && t.name);
  return {title: ((el._fullLayout || {}).title || {}).text || '', legend: legend.length,
          drawn: data.some(t => values(t).some(ok))};
})"""


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_runs")
    for name in RUNS:
        make_run(root / name, MOE_SCENARIOS[name])
    with _serve(*(root / name for name in RUNS)) as url:
        yield url


@pytest.fixture(scope="module")
def browser_page():
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser.new_page(viewport={"width": 1400, "height": 2200})
        browser.close()


def _open(page, url: str, path: str, run: str) -> str:
    """The page of `run` (a deep link's run label), drawn: its charts rendered, the script run finished."""
    page.goto(f"{url}/{path}?run={run}")
    main = page.locator('[data-testid="stMain"]')
    page.locator('[data-testid="stMain"] h1').first.wait_for(timeout=60_000)
    text, deadline = None, time.monotonic() + 90
    while time.monotonic() < deadline:  # the script has run to its end: no status widget, the text settled
        page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')", timeout=60_000)
        page.wait_for_timeout(700)
        now = main.inner_text()
        if now == text:
            break
        text = now
    page.wait_for_function("() => Array.from(document.querySelectorAll('.js-plotly-plot'))"
                           ".every(el => el._fullLayout)", timeout=30_000)
    return text


@pytest.mark.parametrize("run", RUNS)
def test_no_page_is_silent_about_what_the_run_did_not_record(moe_server, browser_page, run):
    page, problems = browser_page, []  # every page's problems, said together
    for path in PAGES:
        name = path or "overview"
        main = _open(page, moe_server, path, run)
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOTS / f"moe_{run}_{name}.png"), full_page=True)
        assert page.locator('[data-testid="stException"]').count() == 0, name
        greens = page.locator('[data-testid="stAlertContentSuccess"]').all_inner_texts()
        problems += [f"{name}: a green all-clear beside a non-healthy verdict: {g!r}" for g in greens]
        tiles = [t.strip() for t in page.locator('[data-testid="stMetricValue"]').all_inner_texts()]
        problems += [f"{name}: a tile reads {t!r}" for t in tiles if "nan" in t.lower().replace("%", " ").split()]
        problems += [f"{name}: chart {c['title']!r} " + ("has a legend and nothing drawn" if c["legend"] else "is empty")
                     for c in page.evaluate(CHARTS_JS) if not c["drawn"]]
        if "No finite values" in main:  # a page that opens on what the run did not measure
            problems.append(f"{name}: opens on a metric the run did not measure")
        if path == "mismatch" and not main.find("MoE routing") < main.find("Engine vs trainer parity"):
            problems.append("mismatch: the page does not open on routing")
        if path == "mismatch" and run == "moe_replay_broken_layer1" and not all(
                s in main for s in ("routing_replay_broken", "layers 1", "limit 1%")):
            problems.append("mismatch: the verdict's finding (replay, layer 1, the 1% limit) is not on the page")
        if path == "tokens" and not all(s in main for s in ("Tokens routed to other experts", "largest engine mismatch",
                                                            "logp_ref, which this run did not record")):
            problems.append("tokens: no list of the routed-differently and highest-mismatch tokens, or no word on flags")
    assert not problems, "\n".join(problems)
