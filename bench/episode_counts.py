"""Alert counts before and after episodes (issue 16), on the demo pair and a long synthetic blow-up.

    python bench/episode_counts.py

"Before" runs the per-step alert code as it was before episodes (kldiag/analysis/rules/alerts.py at
commit 6fb43df~1, read from git) on the same analysis tables; "after" is Analysis.alerts, one
row per episode. Needs a git checkout.
"""

from __future__ import annotations

import importlib.util
import subprocess
import tempfile
from pathlib import Path

import kldiag
from kldiag.diagnosis import diagnose
from kldiag.tools.synth import SynthConfig, make_run

ROOT = Path(__file__).resolve().parents[1]
OLD = "6fb43df~1:kldiag/analysis/rules/alerts.py"


def old_alerts():
    code = subprocess.run(["git", "show", OLD], cwd=ROOT, check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "old_alerts.py"
    path.write_text(code)
    spec = importlib.util.spec_from_file_location("old_alerts", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.ALERT_COLUMNS = ("step", "kind", "metric", "value", "baseline", "message")
    return mod


def main() -> int:
    old = old_alerts()
    runs = {"demo_k3": ROOT / "sample_logs" / "demo_k3", "demo_k3_is": ROOT / "sample_logs" / "demo_k3_is"}
    synth = Path(tempfile.mkdtemp()) / "synth"
    make_run(synth, SynthConfig(steps=2000, blowup_step=1200))
    runs["synthetic, 2000 steps, blow-up from 1200"] = synth
    for name, path in runs.items():
        a = kldiag.analyze(path, kldiag.AnalysisConfig(use_cache=False))
        before = old.compute_alerts(a.steps, a.flags, a.config).num_rows
        dg = diagnose(a)
        kinds: dict[str, int] = {}
        for e in dg.episodes:
            kinds[e.kind] = kinds.get(e.kind, 0) + 1
        print(f"{name}: {a.steps.num_rows} steps; alerts before {before}, after {a.alerts.num_rows} episodes {kinds}; "
              f"verdict {dg.verdict}; causes {[(c.cause, c.onset, c.severity) for c in dg.causes]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
