"""The Mismatch page's audit section under AppTest, and `kldiag dashboard --logs`: with a metric log
paired to the run, the page lists each audited metric's verdict and overlays logged and recomputed
values per step; without one, the section is absent; an unreadable pairing is refused up front."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

import kldiag.crosswalk as X
from kldiag.cli import build_parser
from kldiag.cli import dashboard as D
from kldiag.errors import KldiagError
from kldiag.views import audit as VA

ROOT = Path(__file__).resolve().parent.parent
MAIN = ROOT / "app" / "main.py"
RUN = ROOT / "sample_logs" / "trl_grpo_tiny"


def _log(tmp_path: Path, off_step: int) -> Path:
    """The TRL run's own kl as TRL would log it, one step off by 10% (a disagreement to show)."""
    rows = X.records(X.crosswalk(RUN, "trl"), reasons=False)
    p = tmp_path / "trainer_log.jsonl"
    p.write_text("\n".join(json.dumps({"step": r["step"], "train/kl": r["kl"] * (1.1 if r["step"] == off_step else 1)})
                           for r in rows if r["kl"] is not None))
    return p


def _page(monkeypatch, logs: dict[str, str] | None) -> AppTest:
    monkeypatch.setenv("KLDIAG_RUNS", str(RUN))
    if logs is None:
        monkeypatch.delenv(VA.LOGS_ENV, raising=False)
    else:
        monkeypatch.setenv(VA.LOGS_ENV, json.dumps(logs))
    at = AppTest.from_file(str(MAIN), default_timeout=120).run()
    at = at.switch_page("app_pages/mismatch.py").run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def test_mismatch_page_overlays_logged_and_recomputed(monkeypatch, tmp_path):
    at = _page(monkeypatch, {str(RUN): str(_log(tmp_path, off_step=3))})
    assert "Logged vs recomputed (audit)" in [h.value for h in at.subheader]
    summary = at.dataframe[-1].value
    assert list(summary["metric"]) == ["kl"]
    assert summary["verdict"].iloc[0] == "disagree" and summary["reason"].iloc[0] == "unexplained"
    spec = at.get("plotly_chart")[-1].proto.spec
    assert "kl: logged vs recomputed" in spec and "logged by the trainer" in spec


def test_mismatch_page_without_logs_has_no_audit(monkeypatch):
    at = _page(monkeypatch, None)
    assert "Logged vs recomputed (audit)" not in [h.value for h in at.subheader]


def test_audit_view_reports_an_unusable_log(tmp_path):
    p = tmp_path / "other.jsonl"
    p.write_text(json.dumps({"step": 1, "train/loss": 0.3}))
    view = VA.audit_view(str(RUN), str(p), "trl")
    assert "none of its 1 metrics" in view.error and view.summary.empty


def test_dashboard_pairs_logs_with_runs(tmp_path):
    log = _log(tmp_path, off_step=-1)
    runs = [RUN]
    assert D.logs_by_run(runs, [str(log)]) == {str(RUN): str(log.resolve())}
    env = D._with_logs({}, D.logs_by_run(runs, [str(log)]))
    assert VA.logs_for(str(RUN), env) == str(log.resolve()) and VA.logs_for("elsewhere", env) is None
    with pytest.raises(KldiagError, match="at most one --logs per RUN,"):
        D.logs_by_run(runs, [str(log), str(log)])
    with pytest.raises(KldiagError, match="unknown log format"):
        D.logs_by_run(runs, [os.fspath(ROOT / "README.md")])
    args = build_parser().parse_args(["dashboard", str(RUN), "--logs", str(log)])
    assert args.logs == [str(log)]
