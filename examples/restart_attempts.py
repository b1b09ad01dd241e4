"""What a restart into the same run directory looks like (run format v1.1 attempts).

    python examples/restart_attempts.py [RUN_DIR]

Records steps 0..29, then "restarts from a checkpoint at step 20" and records 20..39 with
other values into the same directory, as a resumed trainer would. The analysis uses the
second attempt's rows for steps 20..29 and says how many rows it left out; every row stays
on disk and plain pyarrow still reads all of them.
"""

from __future__ import annotations

import sys
import tempfile

import numpy as np
import pyarrow.parquet as pq

import kldiag

B, T = 8, 16


def record(run: str, steps: range, shift: float) -> int:
    """One attempt: logp_ref drifts by `shift` so that the attempts' KL differ. Returns its number."""
    with kldiag.Recorder(run, beta=0.04, estimator="k3", rotate_steps=5) as rec:
        for step in steps:
            logp = -np.random.default_rng(step).exponential(1.0, (B, T)).astype(np.float32)
            rec.record(step=step, logp=logp, logp_ref=(logp - 0.2 - shift).astype(np.float32))
    return rec.attempt


def main(run: str) -> None:
    attempts = record(run, range(30), 0.0), record(run, range(20, 40), 1.0)
    a = kldiag.analyze(run, kldiag.AnalysisConfig(use_cache=False))
    steps = a.steps.to_pandas().set_index("step")
    on_disk = kldiag.open_run(run).read(include_superseded=True).num_rows
    print(f"attempts {attempts}; rows on disk {on_disk}, analysed {a.info['rows']}; "
          f"superseded {a.superseded.to_pylist()}")
    print(f"{len(steps)} steps, tokens per step {steps.tokens.min()}..{steps.tokens.max()}; k3_mean at step 15 "
          f"(attempt 0) {steps.loc[15, 'k3_mean']:.4f}, at step 25 (attempt 1) {steps.loc[25, 'k3_mean']:.4f}")
    t = pq.read_table(f"{run}/tokens").to_pandas()
    print(f"plain pyarrow reads {len(t)} rows; sequences holding two attempts: "
          f"{int((t.groupby('seq').attempt.nunique() > 1).sum())}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="kldiag-restart-") + "/run")
