"""Two ranks under torchrun (gloo, CPU): each writes its parts, rank 0 the one manifest."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

import kldiag
from kldiag import format as F

REPO = Path(__file__).resolve().parents[1]

SCRIPT = """
import sys
import torch
import torch.distributed as dist
import kldiag

dist.init_process_group("gloo")
rank = dist.get_rank()
rec = kldiag.Recorder(sys.argv[1], beta=0.04, estimator="k3_is", trainer="torchrun-test")
for step in range(3):
    for micro in range(2):
        logp = torch.full((4, 6), -0.5 - rank, dtype=torch.bfloat16)
        rec.record(step=step, micro=micro, logp=logp, logp_ref=logp.float() - 1, mask=torch.ones(4, 6))
# rank 1 closes first, so rank 0's manifest sums both ranks' writer statistics
if rank == 1:
    rec.close()
dist.barrier()
if rank == 0:
    rec.close()
dist.destroy_process_group()
"""


def test_two_ranks_under_torchrun(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(script), str(run)], check=False, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    parts = F.list_parts(run)
    assert sorted({p.rank for p in parts}) == [0, 1]
    r = kldiag.open_run(run)
    assert r.manifest.world_size == 2 and r.manifest.trainer == {"name": "torchrun-test"}
    assert r.manifest.writer["ranks_reported"] == [0, 1] and r.manifest.writer["rows"] == 2 * 3 * 2 * 4 * 6
    t = r.read(strict=True)
    rank, seq, logp = (t.column(c).to_numpy() for c in ("rank", "seq", "logp"))
    np.testing.assert_array_equal(logp, -0.5 - rank)
    assert len(np.unique(seq)) == 2 * 3 * 2 * 4  # unique across ranks, steps and micro-batches
