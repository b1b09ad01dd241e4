"""`kldiag report` and `kldiag analyze` on what the run recorded: the staleness section (issue 47 edge 6), the
coverage lines, "flagged: not measured" without logp_ref, the MoE routing before the parity line, and no
"agree up to float noise" under a routing verdict (edge 5)."""

from __future__ import annotations

import numpy as np

from kldiag.cli import main
from kldiag.tools.routing_runs import B, batches, write


def _run(tmp_path, versions: bool, ref: bool = True, config=None):
    data = batches(gap=1.5)
    for d in data:
        if versions:
            d["policy_version"] = np.maximum(d["step"] - np.arange(B) % 3, 0)
        if not ref:
            d.pop("logp_ref")
    return write(tmp_path / "run", data, config=config)


def test_report_has_a_staleness_section(tmp_path, capsys):
    run = _run(tmp_path, versions=True)
    assert main(["report", str(run), "-o", str(tmp_path / "r.html")]) == 0
    out = capsys.readouterr().out
    assert "staleness (updates between the weights" in out and "staleness 2:" in out
    page = (tmp_path / "r.html").read_text()
    assert "<h2>Staleness</h2>" in page and "<h2>What this run recorded</h2>" in page
    assert main(["analyze", str(run)]) == 0
    out = capsys.readouterr().out
    assert "staleness_mean" in out.split("alerts")[0]  # a column of the step table


def test_report_without_versions_or_ref_says_so(tmp_path, capsys):
    run = _run(tmp_path, versions=False, ref=False, config={"routing_replay": "R3"})
    assert main(["report", str(run), "-o", str(tmp_path / "r.html")]) == 0
    out = capsys.readouterr().out
    assert "staleness: not measured: the staleness section needs policy_version" in out
    assert "flagged: not measured" in out and "flagged: 0 of" not in out
    assert "agree up to float noise" not in out and "carried by MoE routing" in out
    assert out.index("routing: agreement") < out.index("mismatch: |log pi_theta/pi_old|")
    assert "not recorded: reference log-probs (logp_ref)" in out
    page = (tmp_path / "r.html").read_text()
    assert "needs logp_ref" in page and "nan%" not in page
