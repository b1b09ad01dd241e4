"""kldiag.record.recorder: round trips, ids, sampling, rotation, failures and signals (subprocesses)."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import kldiag
from kldiag import format as F
from kldiag.errors import RecorderError
from kldiag.record import writer as W
from kldiag.record.recorder import SEQ_ATTEMPT_BITS, SEQ_LOCAL_BITS, Recorder, seq_unit

REPO = Path(__file__).resolve().parents[1]


def micro_batch(rng: np.random.Generator, b: int = 4, t: int = 10) -> dict[str, np.ndarray]:
    """Right-padded completions of random lengths, with one masked-out token per row."""
    lengths = rng.integers(1, t + 1, b)
    comp = np.arange(t)[None, :] < lengths[:, None]
    mask = comp.copy()
    mask[:, 0] = False  # inside the completion but out of the loss: stored with mask=false
    logp = -rng.exponential(1.0, (b, t)).astype(np.float32)
    return {"logp": logp, "logp_ref": logp - np.float32(0.5), "mask": mask, "completion_mask": comp,
            "advantages": rng.normal(size=b).astype(np.float32),
            "token_ids": rng.integers(0, 1000, (b, t))}


def read(run_dir: Path) -> dict[str, np.ndarray]:
    table = kldiag.open_run(run_dir).read(strict=True).sort_by([("seq", "ascending"), ("pos", "ascending")])
    return {c: table.column(c).to_numpy(zero_copy_only=False) for c in table.column_names}


def test_round_trip_stores_completion_tokens_only(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    batches = [micro_batch(rng) for _ in range(3)]
    with Recorder(tmp_path, beta=0.04, estimator="k3", clip_range=0.2, trainer="mine", tags=["a"]) as rec:
        for i, b in enumerate(batches):
            rec.record(step=i // 2, micro=i % 2, **b)
    got = read(tmp_path)
    comp = np.concatenate([b["completion_mask"] for b in batches])
    assert len(got["logp"]) == comp.sum() == rec.stats["rows"]
    np.testing.assert_array_equal(got["logp"], np.concatenate([b["logp"] for b in batches])[comp])
    np.testing.assert_array_equal(got["mask"], np.concatenate([b["mask"] for b in batches])[comp])
    np.testing.assert_array_equal(got["token_id"], np.concatenate([b["token_ids"] for b in batches])[comp])
    adv = np.concatenate([np.repeat(b["advantages"][:, None], 10, axis=1) for b in batches])
    np.testing.assert_array_equal(got["advantage"], adv[comp])
    np.testing.assert_array_equal(got["pos"], np.nonzero(comp)[1])
    assert np.isnan(got["logp_old"]).all() and np.isnan(got["entropy"]).all()  # not given: null
    m = kldiag.open_run(tmp_path).manifest
    assert m.config == {"beta": 0.04, "estimator": "k3", "clip_range": [0.2, 0.2]}
    assert m.trainer == {"name": "mine"} and m.tags == {"a": True} and m.world_size == 1
    assert m.writer["rows"] == comp.sum() and m.writer["files"] == 1 and m.writer["write_errors"] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_torch_tensors_of_any_float_dtype(tmp_path: Path, dtype: torch.dtype) -> None:
    rng = np.random.default_rng(1)
    logp = torch.tensor(-rng.exponential(1.0, (3, 7)), dtype=dtype)
    adv = torch.tensor(rng.normal(size=(3, 7)), dtype=dtype)  # [B, T] advantages too
    with Recorder(tmp_path) as rec:
        rec.record(step=0, logp=logp, logp_old=logp.T.contiguous().T, advantages=adv,
                   mask=torch.ones(3, 7, dtype=torch.bool))
    got = read(tmp_path)
    np.testing.assert_array_equal(got["logp"], logp.float().numpy().ravel())
    np.testing.assert_array_equal(got["logp_old"], logp.float().numpy().ravel())
    np.testing.assert_array_equal(got["advantage"], adv.float().numpy().ravel())


def test_left_padding_positions_start_at_zero(tmp_path: Path) -> None:
    comp = np.array([[False, False, True, True], [True, True, True, True]])
    with Recorder(tmp_path) as rec:
        rec.record(step=0, logp=np.zeros((2, 4), np.float32) - 1, completion_mask=comp)
    assert read(tmp_path)["pos"].tolist() == [0, 1, 0, 1, 2, 3]


def test_default_seq_ids_unique_across_ranks_steps_micro_and_stable_across_iterations(tmp_path: Path) -> None:
    logp = -np.ones((3, 2), np.float32)
    for rank in (0, 1):
        with Recorder(tmp_path, rank=rank, world_size=2) as rec:
            for step in range(3):
                for it in range(2):
                    for micro in range(2):
                        rec.record(step=step, logp=logp, micro=micro, iteration=it)
                rec.record(step=step, logp=logp)  # same micro=0 again: still new ids
    got = read(tmp_path)
    first = got["iteration"] == 0
    ids, counts = np.unique(got["seq"][first], return_counts=True)
    assert len(ids) == 2 * 3 * 3 * 3 and (counts == 2).all()  # ranks x steps x records x rows, 2 tokens each
    # iteration 1 replays iteration 0's micro-batches: the same ids, in the same order
    by_iter = {it: got["seq"][(got["iteration"] == it) & (got["micro"] == 1)] for it in (0, 1)}
    np.testing.assert_array_equal(np.sort(by_iter[0]), np.sort(by_iter[1]))
    high = got["seq"] >> (SEQ_LOCAL_BITS + SEQ_ATTEMPT_BITS)  # step * world_size + rank
    assert (high % 2 == got["rank"]).all() and (high // 2 == got["step"]).all()
    assert ((got["seq"] >> SEQ_LOCAL_BITS) % (1 << SEQ_ATTEMPT_BITS) == 0).all()  # attempt 0


def test_bad_shapes_raise_before_anything_is_queued(tmp_path: Path) -> None:
    with Recorder(tmp_path) as rec:
        with pytest.raises(ValueError, match=r"logp_ref has shape \(2, 3\), but logp has shape \(2, 4\)"):
            rec.record(step=0, logp=np.zeros((2, 4)), logp_ref=np.zeros((2, 3)))
        with pytest.raises(ValueError, match=r"advantages has shape \(3,\).*\(2, 4\)"):
            rec.record(step=0, logp=torch.zeros(2, 4), advantages=torch.zeros(3))
        with pytest.raises(ValueError, match=r"seq_ids has shape \(2, 4\)"):
            rec.record(step=0, logp=np.zeros((2, 4)), seq_ids=np.zeros((2, 4)))
        with pytest.raises(ValueError, match=r"logp has shape \(4,\)"):
            rec.record(step=0, logp=np.zeros(4))
    assert rec.stats["rows"] == 0 and F.list_parts(tmp_path) == []


def test_nonfinite_and_positive_logps_are_written_and_counted(tmp_path: Path) -> None:
    logp = np.array([[-1.0, np.nan, np.inf, 0.5]], np.float32)
    ref = np.array([[-1.0, -1.0, -1.0, -np.inf]], np.float32)
    with Recorder(tmp_path) as rec:
        rec.record(step=0, logp=logp, logp_ref=ref)
    got = read(tmp_path)
    np.testing.assert_array_equal(got["logp"], logp[0])
    assert rec.stats["nonfinite"] == 3 and rec.stats["invalid"] == 1
    w = kldiag.open_run(tmp_path).manifest.writer
    assert (w["nonfinite"], w["invalid"]) == (3, 1)


def test_sampling_every_n_steps_and_seq_fraction(tmp_path: Path) -> None:
    logp = -np.ones((64, 3), np.float32)
    with Recorder(tmp_path, every_n_steps=2, seq_fraction=0.25) as rec:
        for step in range(4):
            for it in range(2):
                rec.record(step=step, logp=logp, iteration=it)
    got = read(tmp_path)
    assert set(got["step"].tolist()) == {0, 2}
    assert (seq_unit(got["seq"]) < 0.25).all()
    kept = {it: set(got["seq"][(got["iteration"] == it) & (got["step"] == 2)].tolist()) for it in (0, 1)}
    assert kept[0] == kept[1] and 4 <= len(kept[0]) <= 32  # same sequences on every iteration
    assert kldiag.open_run(tmp_path).manifest.sampling["seq_fraction"] == 0.25
    assert rec.stats["skipped_steps"] == 4 and rec.stats["sampled_out_rows"] == 4 * 64 - len(got["seq"]) // 3


@pytest.mark.parametrize("knob, parts", [({"rotate_rows": 10}, 6), ({"rotate_steps": 2}, 3)])
def test_rotation_by_rows_and_steps(tmp_path: Path, knob: dict, parts: int) -> None:
    with Recorder(tmp_path, **knob) as rec:
        for step in range(6):
            rec.record(step=step, logp=-np.ones((2, 5), np.float32))
    found = F.list_parts(tmp_path)
    assert len(found) == parts and rec.stats["files"] == parts
    assert [p.index for p in found] == list(range(parts))
    assert (found[0].step_min, found[-1].step_max) == (0, 5)


def test_rotation_by_seconds_publishes_without_flush(tmp_path: Path) -> None:
    with Recorder(tmp_path, rotate_seconds=0.2) as rec:
        rec.record(step=0, logp=-np.ones((2, 5), np.float32))
        deadline = time.monotonic() + 10
        while not F.list_parts(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(F.list_parts(tmp_path)) == 1


def test_resumed_run_appends_parts(tmp_path: Path) -> None:
    for _ in range(2):
        with Recorder(tmp_path) as rec:
            rec.record(step=0, logp=-np.ones((2, 5), np.float32))
    assert [p.index for p in F.list_parts(tmp_path)] == [0, 1]


def test_exception_inside_with_publishes_rows_and_propagates(tmp_path: Path) -> None:
    with pytest.raises(KeyError), Recorder(tmp_path) as rec:
        rec.record(step=0, logp=-np.ones((2, 5), np.float32))
        raise KeyError("boom")
    assert len(read(tmp_path)["logp"]) == 10


def test_flush_close_idempotent_record_after_close(tmp_path: Path) -> None:
    rec = Recorder(tmp_path, rotate_seconds=None)
    rec.record(step=0, logp=-np.ones((2, 5), np.float32))
    rec.flush()
    assert rec.stats["rows"] == 10 and len(F.list_parts(tmp_path)) == 1
    rec.close()
    rec.close()
    with pytest.raises(RecorderError, match="after close"):
        rec.record(step=1, logp=-np.ones((2, 5), np.float32))


def test_update_config_vocab_and_rank_stats(tmp_path: Path) -> None:
    with Recorder(tmp_path, beta=0.1, config={"lr": 1e-6}, tokenizer=["a", "b", "c"]) as rec:
        rec.update_config(num_iterations=2)
        assert kldiag.open_run(tmp_path).manifest.config == {"beta": 0.1, "lr": 1e-6, "num_iterations": 2}
        rec.record(step=0, logp=-np.ones((1, 2), np.float32))
    run = kldiag.open_run(tmp_path)
    assert run.vocab() == {0: "a", 1: "b", 2: "c"}
    assert F.read_rank_stats(tmp_path)[(0, 0)]["rows"] == 2 == run.manifest.writer["rows"]


def test_rank_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with Recorder(tmp_path) as rec:
        rec.record(step=0, logp=-np.ones((1, 2), np.float32))
    assert (rec.rank, rec.world_size) == (1, 2)
    assert [p.rank for p in F.list_parts(tmp_path)] == [1]
    assert not (tmp_path / F.MANIFEST).exists()  # rank 0 writes the manifest
    with pytest.raises(ValueError, match="outside world_size"):
        Recorder(tmp_path, rank=2)


def _failing_publish(*args: object, **kwargs: object) -> Path:
    raise OSError(errno.ENOSPC, "No space left on device")


def test_full_disk_warns_once_counts_and_keeps_training(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(F, "publish", _failing_publish)
    with warnings.catch_warnings(record=True) as caught, Recorder(tmp_path, rotate_rows=5) as rec:
        warnings.simplefilter("always")
        for step in range(4):
            rec.record(step=step, logp=-np.ones((1, 5), np.float32))
    assert [str(w.message) for w in caught if "kldiag" in str(w.message)] == [
        next(str(w.message) for w in caught if "disk is full" in str(w.message))]
    assert rec.stats["write_errors"] == 4 and rec.stats["lost_rows"] == 20 and rec.stats["rows"] == 0
    assert kldiag.open_run(tmp_path).manifest.writer["write_errors"] == 4


def test_full_disk_strict_raises_recorder_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(F, "publish", _failing_publish)
    rec = Recorder(tmp_path, strict=True)
    rec.record(step=0, logp=-np.ones((1, 5), np.float32))
    with pytest.raises(RecorderError, match="disk is full"):
        rec.flush()
    rec.close()


def test_unwritable_run_dir(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    with pytest.warns(RuntimeWarning, match="not writable"), Recorder(tmp_path / "file" / "run") as rec:
        rec.record(step=0, logp=-np.ones((1, 5), np.float32))
    assert rec.stats["write_errors"] >= 2 and rec.stats["lost_rows"] == 5
    with pytest.raises(RecorderError, match="not writable"):
        Recorder(tmp_path / "file" / "run2", strict=True)


def test_backpressure_drop_counts_and_warns_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    slow = W.host_columns

    def host_columns(*a: object, **k: object) -> object:
        time.sleep(0.2)
        return slow(*a, **k)

    monkeypatch.setattr(W, "host_columns", host_columns)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Recorder(tmp_path, queue_batches=1, backpressure="drop") as rec:
            for step in range(6):
                rec.record(step=step, logp=-np.ones((1, 5), np.float32))
    drops = [w for w in caught if "dropping" in str(w.message)]
    assert len(drops) == 1 and rec.stats["dropped_rows"] > 0
    assert rec.stats["rows"] + rec.stats["dropped_rows"] == 30
    assert len(read(tmp_path)["logp"]) == rec.stats["rows"]


CHILD = """
import os, signal, sys, time
import numpy as np
import kldiag
run, mode = sys.argv[1], sys.argv[2]
stop = []
if mode == "sigterm_chain":
    signal.signal(signal.SIGTERM, lambda s, f: (open(run + ".chained", "w").close(), sys.exit(3)))
if mode == "sigterm_graceful":  # the trainer's handler asks for a stop at the end of the step
    signal.signal(signal.SIGTERM, lambda s, f: stop.append(1))
rec = kldiag.Recorder(run, rotate_rows={rotate_rows}, rotate_seconds=None)
step = 0
while True:
    rec.record(step=step, logp=np.full((4, 8), -1.0, np.float32))
    step += 1
    if (mode == "exit" and step == 5) or stop:
        break  # no close(): the atexit hook publishes
    if step == 5:
        print("recorded", flush=True)
    if mode != "sigkill" and step >= 5:
        time.sleep(0.05)
        if step > 400:
            sys.exit(9)
print("torch imported:", "torch" in sys.modules, flush=True)
"""


def spawn(run: Path, mode: str, rotate_rows: int = 1_000_000) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", CHILD.format(rotate_rows=rotate_rows), str(run), mode],
                            stdout=subprocess.PIPE, text=True, env=env)


def wait_line(proc: subprocess.Popen) -> str:
    line = proc.stdout.readline()
    assert line, f"child exited early with {proc.wait()}"
    return line


def test_normal_exit_without_close_publishes_everything_and_never_imports_torch(tmp_path: Path) -> None:
    proc = spawn(tmp_path / "run", "exit")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "torch imported: False" in out
    assert len(read(tmp_path / "run")["logp"]) == 5 * 32


@pytest.mark.parametrize("mode", ["sigterm", "sigterm_chain", "sigterm_graceful"])
def test_sigterm_publishes_every_recorded_row(tmp_path: Path, mode: str) -> None:
    proc = spawn(tmp_path / "run", mode)
    wait_line(proc)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    if mode == "sigterm":
        assert proc.returncode == -signal.SIGTERM  # the default action still ends the process
    elif mode == "sigterm_chain":
        assert proc.returncode == 3 and (tmp_path / "run.chained").exists()
    else:  # recording went on after the signal, up to the trainer's own stop
        assert proc.returncode == 0
    writer = json.loads((tmp_path / "run" / F.MANIFEST).read_text())["writer"]
    got = read(tmp_path / "run")
    assert len(got["logp"]) == writer["rows"] >= 5 * 32
    assert len(np.unique(got["step"])) == len(got["logp"]) // 32  # whole micro-batches, none torn


def test_sigkill_leaves_only_readable_parts(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = spawn(run, "sigkill", rotate_rows=64)
    wait_line(proc)
    deadline = time.monotonic() + 30
    while len(F.list_parts(run)) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    parts = F.list_parts(run)
    assert len(parts) >= 3
    table = kldiag.open_run(run).read(strict=True)  # every visible part opens
    assert table.num_rows == 64 * len(parts)
    for entry in F.rank_dir(run, 0).iterdir():
        assert F.PART_RE.match(entry.name) or entry.name.startswith(".") or entry.name == F.WRITER_STATS


def test_reused_buffers_never_mix_micro_batches(tmp_path: Path) -> None:
    """Padded lengths change every call (buffers are pooled by size): every row keeps its values."""
    rng = np.random.default_rng(5)
    sent = []
    with Recorder(tmp_path, queue_batches=2, rotate_rows=200) as rec:
        for step in range(60):
            t = int(rng.integers(3, 40))
            logp = torch.tensor(-rng.exponential(1.0, (3, t)), dtype=torch.float32)
            rec.record(step=step, logp=logp, token_ids=torch.full((3, t), step))
            sent.append(logp.numpy().ravel())
    got = read(tmp_path)
    order = np.argsort(got["step"], kind="stable")
    np.testing.assert_array_equal(got["logp"][order], np.concatenate(sent))
    assert (got["token_id"] == got["step"]).all()
