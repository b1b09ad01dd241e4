"""The dashboard's Overview in a real headless Chromium leads with the verdict and the causes
(tests/test_browser.py serves the dashboard the same way; its helpers are reused)."""

from __future__ import annotations

import shutil

import pytest
from playwright.sync_api import sync_playwright
from test_browser import CHROMIUM, CHROMIUM_ARGS, ROOT, SHOTS, _open, _serve

pytestmark = pytest.mark.slow


def test_overview_shows_verdict_causes_and_fix(tmp_path):
    run = shutil.copytree(ROOT / "sample_logs" / "demo_k3", tmp_path / "demo_k3",
                          ignore=shutil.ignore_patterns(".kldiag"))
    with _serve(run) as url, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 2200})
        try:
            _open(page, url, "", ".main-svg")
            SHOTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(SHOTS / "overview_diagnosis.png"), full_page=True)
            assert page.locator('[data-testid="stException"]').count() == 0
            verdict = page.get_by_text("Verdict: UNSTABLE").first
            assert verdict.is_visible()
            main = page.locator('[data-testid="stMain"]').inner_text()
            # the verdict comes before the headline figures, and names the cause and its onset
            assert main.index("Verdict: UNSTABLE") < main.index("Max |k3 weight|")
            assert "k3_weight_blowup from step 36" in main.replace("`", "")
            assert "Fix:" in main and "rho" in main
            assert page.get_by_text("k3_weight_blowup", exact=False).count() >= 2  # banner, cause, chart marks
        finally:
            browser.close()
