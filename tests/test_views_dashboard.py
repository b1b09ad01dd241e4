"""kldiag/views/dashboard.py's prepare_refresh: a live dashboard's first refresh finds the analysis pass's
compiled kernels loaded, from a few rows of the run's last part in a temporary run; the run's parts untouched."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from kldiag.tools.synth import SynthConfig, make_run

ROOT = Path(__file__).resolve().parents[1]


def test_prepare_refresh_loads_the_passs_kernels_and_leaves_the_parts_alone(tmp_path):
    run = tmp_path / "run"
    make_run(run, SynthConfig(steps=4, seqs_per_step=6, seq_len=(5, 30), vocab_size=0, rows_per_file=200))
    before = sorted((p.relative_to(run), p.stat().st_mtime_ns) for p in run.glob("tokens/**/*"))
    code = f"""
        import sys
        from kldiag.analysis.kernels import ride as fused_ride
        from kldiag.views import dashboard as VD
        assert "numba" not in sys.modules
        VD.prepare_refresh_in_background({str(run)!r}).join()
        assert VD.prepare_refresh_in_background({str(run)!r}) is VD._PREPARING[{str(run)!r}]  # once a run
        # a signature compiled (loaded) for the pass's batches: the analysis's, the Estimators reducer riding
        print(len(fused_ride.fused_pass_est.signatures))
    """
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT).stdout
    assert int(out.strip()) >= 1
    assert sorted((p.relative_to(run), p.stat().st_mtime_ns) for p in run.glob("tokens/**/*")) == before  # no part


def test_prepare_refresh_of_a_run_without_parts_does_nothing(tmp_path):
    from kldiag.format import write_manifest
    from kldiag.tools.synth import make_manifest
    from kldiag.views import dashboard as VD

    write_manifest(tmp_path, make_manifest(SynthConfig()))
    VD.prepare_refresh(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json"]
