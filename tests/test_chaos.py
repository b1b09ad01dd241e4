"""Chaos: a recorder (with a guard observing the same batches) rotates parts while `kldiag watch`'s
watcher, the dashboard's analysis and a plain reader follow the run, and is SIGKILLed at random
points, ITERATIONS times; each restart is a new writer process on the same run, as a trainer that
crashes and resumes from its last published step. Every published part opens, no reader raises, and the analysis the readers
built incrementally (the engine's cache, extended kill after kill) equals a clean re-analysis of
the surviving parts in a fresh directory.

Writers are forked from a forkserver that imported kldiag once, so a kill-and-restart costs a few
milliseconds rather than a fresh interpreter."""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import kldiag
from kldiag import format as F
from kldiag.live.watch import Watcher
from kldiag.views.dashboard import reducers as dashboard_reducers

ITERATIONS = int(os.environ.get("KLDIAG_CHAOS_ITERATIONS", 200))


def writer(run: str, life: int, first_step: int, writing) -> None:
    """One writer life: micro-batches of 4 x 16 tokens, a part every 4 of them, until killed;
    it resumes at `first_step` (after the last published step, as a trainer resumes from its checkpoint);
    `writing` (an Event) is set once the recorder is open."""
    from kldiag.live.guard import Guard

    rng = np.random.default_rng(life)
    guard = Guard(on="blowup,nonfinite", action="log")
    with kldiag.Recorder(run, rotate_rows=256, queue_batches=4) as rec:
        writing.set()
        for k in itertools.count():  # until killed
            step = first_step + k
            logp = -rng.exponential(1.0, (4, 16)).astype(np.float32)
            ref = np.minimum(logp + rng.normal(0, 0.1, (4, 16)), 0).astype(np.float32)
            rec.record(step=step, logp=logp, logp_old=logp, logp_ref=ref, advantages=rng.normal(size=4))
            guard.observe(step, logp, logp_ref=ref, logp_old=logp)
            guard.end_step(step)
            time.sleep(0.01)


def read_everything(run: Path, watcher: Watcher, life: int, opened: set[str]) -> None:
    """What the faces do while a writer runs: the watcher's poll, every 10th life the dashboard's
    one-pass analysis with its reducers, and every part published since the last look opened
    strictly (`opened`: the keys already checked)."""
    watcher.poll()
    parts = F.list_parts(run)
    if life % 10 == 0 and parts:
        kldiag.analyze(run, kldiag.AnalysisConfig(), dashboard_reducers())
    new = [p for p in parts if p.key not in opened]
    if new:
        kldiag.open_run(run).read_parts(new, ["step"], strict=True)  # raises on a part that does not open
        opened.update(p.key for p in new)


@pytest.mark.slow
def test_sigkill_chaos_readers_never_fail_and_the_cache_equals_a_clean_analysis(tmp_path):
    ctx = mp.get_context("forkserver")
    # the modules this file imports: a child unpickles `writer` by importing this module
    ctx.set_forkserver_preload(["kldiag", "kldiag.record", "kldiag.live.guard", "kldiag.live.watch",
                                "kldiag.views.dashboard", "pyarrow.parquet"])
    run = tmp_path / "run"
    watcher = Watcher(str(run))
    rng = np.random.default_rng(0)
    kills, opened = 0, set()
    for life in range(ITERATIONS):
        writing = ctx.Event()
        first_step = max((p.step_max + 1 for p in F.list_parts(run)), default=0)
        proc = ctx.Process(target=writer, args=(str(run), life, first_step, writing))
        proc.start()
        # one life in ten dies while it starts (opening the run); the others at a random point of their
        # writing, timed from when it began (a timer, not the readers' pace: a loaded machine still kills
        # mid-publish)
        if rng.uniform() > 0.1:
            writing.wait(60)
        timer = threading.Timer(rng.uniform(0.0, 0.1), os.kill, (proc.pid, signal.SIGKILL))
        timer.start()
        read_everything(run, watcher, life, opened)  # while the writer lives, or just after it died
        timer.join()
        proc.join(30)
        kills += proc.exitcode == -signal.SIGKILL
        read_everything(run, watcher, 1, opened)
    assert kills == ITERATIONS

    parts = F.list_parts(run)
    assert parts, "no writer life published a part"
    table = kldiag.open_run(run).read(strict=True)  # every published part opens
    assert table.num_rows == 256 * len(parts)  # a part is published whole or not at all
    followed = kldiag.analyze(run)  # through the cache the readers extended
    clean_run = tmp_path / "clean"
    shutil.copytree(run, clean_run, ignore=shutil.ignore_patterns(".kldiag"))
    clean = kldiag.analyze(clean_run)
    assert followed.files_new == 0 and clean.files_new == len(parts)
    a, b = followed.steps.to_pandas(), clean.steps.to_pandas()
    assert len(a) == len(b) > 0
    for col in a.columns:
        x, y = a[col].to_numpy(), b[col].to_numpy()
        if x.dtype.kind == "f":
            np.testing.assert_allclose(x, y, rtol=1e-12, atol=0, equal_nan=True, err_msg=col)
        else:
            assert (x == y).all(), col
    print(f"\nchaos: {ITERATIONS} writer lives SIGKILLed, {len(parts)} parts published, "
          f"{table.num_rows} rows, every part readable, cache == clean re-analysis over {len(a)} steps")
