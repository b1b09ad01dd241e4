"""The recorder yields to training: writer-thread observers, waiting for conversion (never for a
publish), the writer threads' lowered OS priority, their CPU time, and the TRL hook's log metrics
computed off the training thread equal to the on-thread ones."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from kldiag import format as F
from kldiag.integrations import trl as kt
from kldiag.record import recorder as kr
from kldiag.record.recorder import Recorder


def batch(rng: np.random.Generator, b: int = 4, t: int = 10) -> dict[str, np.ndarray]:
    logp = -rng.exponential(1.0, (b, t)).astype(np.float32)
    mask = np.arange(t)[None, :] < rng.integers(1, t + 1, b)[:, None]
    logp_old = logp + rng.normal(0, 0.1, (b, t)).astype(np.float32)
    return {"logp": logp, "logp_old": logp_old, "logp_ref": logp - np.float32(3.0) * rng.random((b, t), np.float32),
            "mask": mask}


def test_observers_see_the_recorded_values_in_the_writer_thread(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    given = [batch(rng) for _ in range(3)]
    seen, threads = [], set()

    def observe(columns: dict[str, np.ndarray]) -> None:
        seen.append(kt.batch_partials(columns["logp"], columns["logp_ref"], columns["logp_old"], columns["mask"]))
        threads.add(threading.get_ident())

    with Recorder(tmp_path) as rec:
        rec.observe(observe)
        for i, b in enumerate(given):
            rec.record(step=i, **{k: torch.from_numpy(v).bfloat16() if k == "logp" else v for k, v in b.items()})
        assert rec.wait_converted(10.0)
    want = [kt.batch_partials(torch.from_numpy(b["logp"]).bfloat16().float().numpy(), b["logp_ref"], b["logp_old"],
                              b["mask"]) for b in given]
    assert seen == want  # exactly: the same float32 values reach the same function
    assert threads and threading.get_ident() not in threads


def test_wait_converted_waits_for_queued_batches_only(tmp_path: Path) -> None:
    seen, gate = [], threading.Event()

    def slow(columns: dict[str, np.ndarray]) -> None:
        gate.wait(10.0)
        seen.append(len(columns["logp"]))

    with Recorder(tmp_path) as rec:
        rec.observe(slow)
        for b in (1, 2, 3):
            rec.record(step=0, micro=b, logp=-np.ones((b, 4), np.float32))
        assert not rec.wait_converted(0.05)  # the observer is held: a short timeout, not a hang
        gate.set()
        assert rec.wait_converted(10.0) and seen == [1, 2, 3]
        assert rec.wait_converted(0.0)  # nothing new since


def test_a_slow_publish_does_not_delay_conversion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    publish, release = F.publish, threading.Event()

    def slow_publish(*args: object, **kwargs: object) -> int:
        release.wait(10.0)
        return publish(*args, **kwargs)

    monkeypatch.setattr(F, "publish", slow_publish)
    with Recorder(tmp_path, rotate_rows=1) as rec:  # every batch is a part
        for step in range(2):
            rec.record(step=step, logp=-np.ones((1, 3), np.float32))
        t0 = time.monotonic()
        assert rec.wait_converted(5.0)  # both converted while the first part is still publishing
        assert time.monotonic() - t0 < 2.0 and rec.stats["files"] == 0
        release.set()
    assert rec.stats["files"] == 2 and rec.stats["rows"] == 6
    assert rec.writer_cpu_s > 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
@pytest.mark.parametrize("nice", [5, None])
def test_the_encoding_thread_runs_at_a_lower_priority(tmp_path: Path, nice: int | None) -> None:
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with Recorder(tmp_path, writer_nice=nice) as rec:
        rec.record(step=0, logp=-np.ones((1, 3), np.float32))
        rec.flush()  # the writer and its publisher have started and set their priority
        got = [os.getpriority(os.PRIO_PROCESS, t.native_id) for t in (rec._writer, rec._writer.publisher)]
    assert got == [base, min(19, base + (nice or 0))]  # the converter (a log waits for it) keeps the trainer's
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base  # the caller's is untouched


@pytest.mark.slow
def test_trl_log_metrics_off_thread_equal_on_thread(tmp_path: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    import trl_grpo

    model = trl_grpo.build_tiny_model(tmp_path / "model")
    logs = {}
    for off in (True, False):
        trainer = trl_grpo.make_trainer(model, tmp_path / f"out{off}", steps=3)
        kt.attach(trainer, tmp_path / f"run{off}")
        if not off:
            trainer._kldiag_hook._off = False  # the on-thread path, as with a guard or histograms
        trainer.train()
        assert trainer._kldiag_hook._off is off and trainer._kldiag_hook.late_logs == 0
        logs[off] = [{k: v for k, v in h.items() if k.startswith("kldiag/")} for h in trainer.state.log_history]
    assert len([h for h in logs[True] if h]) == 3
    assert logs[True] == logs[False]


@pytest.mark.parametrize(("options", "off"), [({}, True), ({"every_n_steps": 2}, False), ({"seq_fraction": 0.5}, False),
                                              ({"backpressure": "drop"}, False)])
def test_the_hook_computes_metrics_off_thread_only_when_every_batch_is_recorded(tmp_path: Path, options: dict,
                                                                                 off: bool) -> None:
    from types import SimpleNamespace

    with Recorder(tmp_path, **options) as rec:
        hook = kt._Hook(SimpleNamespace(beta=0.1), rec)
        assert hook.off_thread() is off and hook.off_thread() is off  # decided once
        assert (hook._observe in rec._writer.observers) is off


def test_an_observer_failure_is_raised_on_the_training_thread_at_the_next_log(tmp_path: Path) -> None:
    from types import SimpleNamespace

    trainer = SimpleNamespace(beta=0.1, accelerator=SimpleNamespace(num_processes=1))
    with Recorder(tmp_path) as rec:
        hook = kt._Hook(trainer, rec)
        hook._observe({"logp": np.zeros((1, 2), np.float32)})  # no mask column: a bug, not a crash of the writer
        with pytest.raises(KeyError, match="completion"):
            hook._add_metrics({})
        hook._observe({"logp": -np.ones((1, 2), np.float32), "mask": np.ones((1, 2), bool)})
        logs: dict = {}
        hook._add_metrics(logs)
    assert logs["kldiag/rho_max"] == 1.0 and "kldiag/k3_mean" in logs


@pytest.mark.parametrize("t", [12, 40_000])  # under and over the Stager's small-copy threshold (64 KiB a column)
@pytest.mark.parametrize("kind", ["numpy", "float32", "bfloat16"])
def test_record_copies_small_and_large_inputs_the_caller_then_overwrites(tmp_path: Path, t: int, kind: str) -> None:
    rng = np.random.default_rng(1)
    want = []
    with Recorder(tmp_path) as rec:
        for step in range(3):
            logp = -rng.random((2, t)).astype(np.float32)
            x = logp if kind == "numpy" else torch.from_numpy(logp).to(getattr(torch, kind))
            want.append(x.float().numpy().copy() if kind == "bfloat16" else np.array(logp))
            rec.record(step=step, logp=x)
            x[...] = 0.0  # the trainer reuses its buffer at once
    got = rec_logp(tmp_path)
    assert np.array_equal(got, np.concatenate([w.ravel() for w in want]))


def rec_logp(run: Path) -> np.ndarray:
    import kldiag

    t = kldiag.open_run(run).read(columns=["step", "seq", "pos", "logp"]).to_pandas()
    return t.sort_values(["step", "seq", "pos"])["logp"].to_numpy()


def mixed_batches(rng: np.random.Generator) -> list[dict[str, np.ndarray]]:
    """Micro-batches whose optional columns come and go: sampler log-probs, groups, token ids, per-row or
    per-token advantages (the same columns with another rank, batches 6 and 7), left padding, a batch with
    no completion token."""
    out = []
    for i in range(8):
        b, t = int(rng.integers(1, 5)), int(rng.integers(3, 9))
        comp = np.arange(t)[None, :] >= rng.integers(0, t, b)[:, None]  # left padding
        if i == 3:
            comp[:] = False
        args = {"logp": -rng.random((b, t)).astype(np.float32), "completion_mask": comp,
                "mask": comp & (rng.random((b, t)) < 0.7), "seq_ids": np.arange(b) + 10 * i}
        if i == 7:
            args.update(token_ids=rng.integers(0, 50, (b, t)), advantages=rng.normal(size=b))
        elif i % 2:
            args.update(logp_sampler=-rng.random((b, t)).astype(np.float32), group_ids=np.full(b, i),
                        advantages=rng.normal(size=b).astype(np.float32))
        else:
            args.update(token_ids=rng.integers(0, 50, (b, t)), advantages=rng.normal(size=(b, t)))
        if i == 5:
            args["logp"][0, -1] = np.nan
        out.append(args)
    return out


@pytest.mark.parametrize("convert_rows", [1, 7, 1 << 16])  # every batch, some, all at publish (publisher thread)
def test_rows_converted_together_equal_rows_converted_one_batch_at_a_time(tmp_path: Path, convert_rows: int,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import pyarrow as pa

    from kldiag.record import writer as W

    rng = np.random.default_rng(3)
    given = mixed_batches(rng)
    stager = W.Stager(keep=4)
    one_at_a_time = []
    for i, args in enumerate(given):
        columns = {kr.COLUMN_OF.get(k, k): stager.stage(v) for k, v in args.items()}
        one_at_a_time.append(W.to_record_batch(W.HostBatch(i, 0, 0, columns), rank=2, attempt=1)[0])
    want = pa.Table.from_batches(one_at_a_time)
    monkeypatch.setattr(W, "CONVERT_ROWS", convert_rows)
    with Recorder(tmp_path, rank=2, world_size=3) as rec:
        for i, args in enumerate(given):
            rec.record(step=i, **args)
    got = pq.read_table(next((tmp_path / "tokens" / "rank-2").glob("*.parquet")))
    assert got.num_rows == want.num_rows == rec.stats["rows"]
    for name in want.column_names:
        if name != "attempt":  # the recorder's own attempt is 0
            assert got[name].to_pylist() == want[name].to_pylist() or name == "logp" and np.array_equal(
                got[name].to_numpy(), want[name].to_numpy(), equal_nan=True), name
    assert got["logp_sampler"].null_count > 0 and got["token_id"].null_count > 0  # absent in some batches: null
    assert rec.stats["nonfinite"] == 1


def test_conversion_happens_in_chunks_off_the_publish(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kldiag.record import writer as W

    monkeypatch.setattr(W, "CONVERT_ROWS", 10)
    with Recorder(tmp_path, rotate_seconds=None) as rec:
        for step in range(5):
            rec.record(step=step, logp=-np.ones((1, 4), np.float32))
        assert rec.wait_converted(10.0)
        writer = rec._writer
        # 20 rows gathered: 12 converted (the chunk that crossed 10 rows), 8 waiting for the next chunk or part
        assert (sum(b.num_rows for b in writer.buffer), writer.pending_cells, writer.buffered_rows) == (12, 8, 20)
        assert rec.stats["files"] == 0
        # One token of 8 kept: 9 rows wait, under 10, but their padded size (16 cells) is what memory holds.
        rec.record(step=5, logp=-np.ones((1, 8), np.float32), completion_mask=np.arange(8)[None, :] == 0)
        assert rec.wait_converted(10.0)
        assert (sum(b.num_rows for b in writer.buffer), writer.pending_cells, writer.buffered_rows) == (21, 0, 21)
    assert rec.stats["rows"] == 21 and rec.stats["files"] == 1


@pytest.mark.parametrize("convert_rows", [8, 1 << 16])  # converted by the writer, or by the publisher at close
def test_a_batch_that_cannot_be_converted_is_dropped_alone(tmp_path: Path, convert_rows: int,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from kldiag.record import writer as W

    monkeypatch.setattr(W, "CONVERT_ROWS", convert_rows)
    with pytest.warns(RuntimeWarning, match="writing"), Recorder(tmp_path) as rec:
        for step in range(4):
            tokens = np.full((1, 3), "x" if step == 1 else "7")  # step 1: token ids that are no integers
            rec.record(step=step, logp=-np.ones((1, 3), np.float32), token_ids=tokens)
    assert rec.stats["rows"] == 9 and rec.stats["lost_rows"] == 3 and rec.stats["write_errors"] == 1
    got = pq.read_table(next((tmp_path / "tokens" / "rank-0").glob("*.parquet")))
    assert sorted(set(got["step"].to_pylist())) == [0, 2, 3] and set(got["token_id"].to_pylist()) == {7}
