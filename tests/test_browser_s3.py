"""The dashboard on a run in object storage (`kldiag dashboard s3://...`), in headless Chromium.

The run is recorded by kldiag.Recorder straight into a real S3 server (moto, 127.0.0.1);
the dashboard process gets the endpoint and credentials from the standard AWS environment.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_browser import PAGES, SHOTS, _open, _serve, page  # noqa: F401 - page is a fixture

import kldiag
from kldiag.diagnosis import diagnose
from kldiag.record.recorder import Recorder
from kldiag.views import dashboard

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def s3_server(s3, tmp_path_factory):
    uri = f"s3://{s3.bucket('dash')}/runs/k3"
    rng = np.random.default_rng(0)
    with Recorder(uri, beta=0.04, estimator="k3", tokenizer=[f"tok{i} " for i in range(32)], rotate_steps=4) as rec:
        for step in range(10):
            logp = -rng.exponential(1.0, (6, 12)).astype(np.float32)
            d = rng.normal(0, 0.3, (6, 12)) + (6.0 if step >= 6 else 0.0) * (rng.random((6, 12)) < 0.05)
            rec.record(step=step, logp=logp, logp_ref=(logp + d).clip(max=0).astype(np.float32),
                       advantages=rng.normal(size=6).astype(np.float32),
                       token_ids=rng.integers(0, 32, (6, 12)), group_ids=np.arange(6) // 3)
    # The kernels this run's columns need, compiled into numba's disk cache before the server starts: in a
    # fresh checkout its first render would compile them (tens of seconds on a 2-core machine) inside the
    # page's wait. No analysis cache is written: the server still reads the run from S3, cold.
    diagnose(kldiag.analyze(uri, kldiag.AnalysisConfig(use_cache=False), dashboard.reducers()))
    with _serve(uri) as url:
        yield url


@pytest.mark.parametrize("path", ["", "tokens", "sequence"], ids=["overview", "tokens", "sequence"])
def test_s3_run_pages_render(s3_server, page, path):  # noqa: F811 - the fixture
    _open(page, s3_server, path, PAGES[path])
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"s3_{path or 'overview'}.png"), full_page=True)
    assert page.locator('[data-testid="stException"]').count() == 0
    assert page.locator(PAGES[path]).count() >= 1
    assert page.get_by_text("Cannot analyse").count() == 0
