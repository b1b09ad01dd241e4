"""The recorder's CUDA path on a real device: pinned buffers, non-blocking copies, one CUDA event per
batch, tensors made on several streams. Skipped without a GPU (run on one: pytest tests/test_recorder_cuda.py)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

import kldiag  # noqa: E402


def _batch(gen: torch.Generator, b: int, t: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    dev = "cuda"
    logp = -torch.rand(b, t, generator=gen, device=dev).mul(5).to(dtype)
    lengths = torch.randint(t // 2, t + 1, (b,), generator=gen, device=dev)
    return {"logp": logp, "logp_old": (logp.float() - 0.01).to(dtype), "logp_ref": (logp.float() + 0.3).to(dtype),
            "advantages": torch.randn(b, generator=gen, device=dev),
            "mask": torch.arange(t, device=dev)[None, :] < lengths[:, None],
            "token_ids": torch.randint(0, 151_936, (b, t), generator=gen, device=dev)}


def _expected(batch: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    torch.cuda.synchronize()
    keep = batch["mask"].cpu().numpy()
    out = {k: batch[k].float().cpu().numpy()[keep] for k in ("logp", "logp_old", "logp_ref")}
    out["token_id"] = batch["token_ids"].cpu().numpy()[keep]
    out["advantage"] = np.broadcast_to(batch["advantages"].cpu().numpy()[:, None], keep.shape)[keep]
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_tensors_from_several_streams_round_trip(tmp_path, dtype):
    """Each stream makes its micro-batches and records them under `torch.cuda.stream(s)`; then the
    stream overwrites the source tensors in place: the run holds the values at record() time."""
    streams = [torch.cuda.current_stream(), *(torch.cuda.Stream() for _ in range(3))]
    gen = torch.Generator(device="cuda").manual_seed(0)
    want: dict[tuple[int, int], dict[str, np.ndarray]] = {}
    with kldiag.Recorder(tmp_path / "run", rotate_rows=10_000, strict=True) as rec:
        for step in range(3):
            for micro, stream in enumerate(streams):
                with torch.cuda.stream(stream):
                    batch = _batch(gen, 16, 257, dtype)
                    want[(step, micro)] = _expected(batch)
                    rec.record(step=step, micro=micro, **batch)
                    torch.cuda._sleep(1_000_000)  # keep the stream busy: the copy must not wait for it
                    for k in ("logp", "logp_old", "logp_ref"):
                        batch[k].fill_(1.0)  # ordered after the copy on this stream
        assert rec.stats["write_errors"] == 0
    table = kldiag.open_run(tmp_path / "run").read().to_pandas().sort_values(["step", "micro", "seq", "pos"])
    assert len(table) == sum(len(w["logp"]) for w in want.values())
    for (step, micro), w in want.items():
        got = table[(table.step == step) & (table.micro == micro)]
        for col in ("logp", "logp_old", "logp_ref", "advantage"):
            np.testing.assert_array_equal(got[col].to_numpy(np.float32), w[col].astype(np.float32), err_msg=col)
        np.testing.assert_array_equal(got["token_id"].to_numpy(), w["token_id"])


def test_cuda_record_returns_before_the_device_finishes(tmp_path):
    """record() only queues the copies: with the stream busy for ~50 ms it returns long before."""
    import time

    gen = torch.Generator(device="cuda").manual_seed(1)
    batch = _batch(gen, 64, 4096, torch.bfloat16)
    with kldiag.Recorder(tmp_path / "run", strict=True) as rec:
        rec.record(step=0, **batch)  # warm the pinned pool
        rec.flush()
        torch.cuda._sleep(50 * 1_000_000)
        t0 = time.perf_counter()
        rec.record(step=1, **batch)
        held = time.perf_counter() - t0
        torch.cuda.synchronize()
    assert held < 0.02, held
    rows = kldiag.open_run(tmp_path / "run").read(columns=["step"]).num_rows
    assert rows == 2 * int(batch["mask"].sum())


@pytest.mark.parametrize("warm", [False, True])
def test_cuda_record_never_syncs_the_device(tmp_path, warm):
    """record() under sync debug mode "error": no device sync (no .item(), .cpu(), nonzero or blocking
    copy) on the training thread, whether the pinned pool is empty (first call) or warm."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    batch = _batch(gen, 8, 512, torch.bfloat16)
    with kldiag.Recorder(tmp_path / "run", strict=True) as rec:
        if warm:
            rec.record(step=0, **batch)
            rec.flush()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            rec.record(step=1, **batch)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    steps = kldiag.open_run(tmp_path / "run").read(columns=["step"]).column("step").to_numpy()
    assert (steps == 1).sum() == int(batch["mask"].sum())
