"""Recorder benchmark: training-thread hold, writer throughput, bytes per token.

    python bench/recorder.py [--batches 104 --batch 64 --time 2048]

Every figure is a ratio to a baseline measured in the same run:
- hold: time record() holds the training thread / a bare `.cpu().numpy()` of the same
  tensors (zero-copy for CPU tensors, so also / `.clone().numpy()`, a real host copy);
- writer: sustained tokens/s from the first record() to close() (everything published)
  / writing the same Arrow table with pyarrow directly (pq.write_table, zstd level 1);
  and the CPU seconds its threads spent per million tokens (thread CPU time, robust to
  other load: Recorder.writer_cpu_s, or the writer thread's own clock for an older kldiag)
  / pq.write_table's CPU seconds per million tokens;
- bytes/token on disk with logp, logp_old, logp_ref, advantages, mask, token_ids
  (docs/recorder.md, "Measured": at most 14), and for each Parquet encoding option.
Data: log-probs of sampled tokens (most near 0, a heavy tail), old/ref policies nearby,
Zipf token ids over a 151,936-token vocabulary, completion lengths uniform in [T/2, T].
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

import kldiag
from kldiag import format as F
from kldiag.record import writer as W

VOCAB = 151_936


def make_batches(n_distinct: int, batch: int, time_: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Realistic [B, T] micro-batches (float32 CPU tensors)."""
    rng = np.random.default_rng(seed)
    p_tok = 1.0 / (np.arange(VOCAB) + 2.7)
    p_tok /= p_tok.sum()
    out = []
    for _ in range(n_distinct):
        shape = (batch, time_)
        confident = rng.random(shape) < 0.6
        logp = np.where(confident, -rng.exponential(0.02, shape), -rng.exponential(1.5, shape)).astype(np.float32)
        logp_old = (logp - np.abs(rng.normal(0, 0.02, shape))).astype(np.float32)
        logp_ref = (logp - rng.normal(0.05, 0.3, shape)).astype(np.float32)
        lengths = rng.integers(time_ // 2, time_ + 1, batch)
        comp = np.arange(time_)[None, :] < lengths[:, None]
        out.append({
            "logp": torch.from_numpy(logp), "logp_old": torch.from_numpy(logp_old),
            "logp_ref": torch.from_numpy(logp_ref),
            "advantages": torch.from_numpy(rng.normal(size=batch).astype(np.float32)),
            "mask": torch.from_numpy(comp),
            "token_ids": torch.from_numpy(rng.choice(VOCAB, size=shape, p=p_tok).astype(np.int64)),
        })
    return out


def bench_hold(batches: list[dict], n: int, dtype: torch.dtype, run_dir: Path, pace_s: float) -> dict[str, float]:
    """Seconds record() holds the caller vs .cpu().numpy() and .clone().numpy() of the same tensors.

    "paced": the caller sleeps `pace_s` after each call (a trainer computes between
    micro-batches; the writer works meanwhile); "back to back": no pause, the writer is
    always busy and competes for the GIL and the two cores.
    """
    data = [{k: (v.to(dtype) if v.is_floating_point() and v.dim() == 2 else v) for k, v in b.items()}
            for b in batches]
    as_np = (lambda t: t.cpu().float().numpy()) if dtype == torch.bfloat16 else (lambda t: t.cpu().numpy())
    copy = (lambda t: t.clone().view(torch.int16).numpy()) if dtype == torch.bfloat16 else (
        lambda t: t.clone().numpy())
    bare = clone = 0.0
    for i in range(n):
        t0 = time.perf_counter()
        [as_np(t) for t in data[i % len(data)].values()]
        t1 = time.perf_counter()
        [copy(t) for t in data[i % len(data)].values()]
        bare, clone = bare + t1 - t0, clone + time.perf_counter() - t1
    out = {"bare_s": bare / n, "clone_s": clone / n}
    for regime, pause in (("paced", pace_s), ("back to back", 0.0)):
        hold = []
        with kldiag.Recorder(run_dir / regime.replace(" ", "_"), rotate_seconds=None) as rec:
            for i in range(n):
                t0 = time.perf_counter()
                rec.record(step=i // 8, micro=i % 8, **data[i % len(data)])
                hold.append(time.perf_counter() - t0)
                time.sleep(pause)
        out[regime] = (float(np.mean(hold)), float(np.median(hold)))
    return out


def writer_cpu_clock() -> None:
    """For a kldiag without Recorder.writer_cpu_s: the writer thread notes its CPU time when it ends."""
    run = W.Writer.run

    def timed_run(self: W.Writer) -> None:
        try:
            run(self)
        finally:
            self.bench_cpu_s = time.thread_time()
    W.Writer.run = timed_run


def bench_writer(batches: list[dict], n: int, run_dir: Path, repeats: int) -> dict[str, float]:
    """End-to-end tokens/s (first record() to close()) and the writer threads' CPU seconds vs
    pq.write_table of the same rows (wall and thread CPU).

    Alternates the two `repeats` times and keeps each one's median (the machine is shared).
    """
    walls, directs, cpus, direct_cpus = [], [], [], []
    for r in range(repeats):
        t0 = time.perf_counter()
        with kldiag.Recorder(run_dir / f"rec-{r}", rotate_seconds=None) as rec:
            for i in range(n):
                rec.record(step=i // 8, micro=i % 8, **batches[i % len(batches)])
        walls.append(time.perf_counter() - t0)
        cpus.append(getattr(rec, "writer_cpu_s", None) or rec._writer.bench_cpu_s)
        tables = [pq.read_table(p.path) for p in F.list_parts(run_dir / f"rec-{r}")]
        t0, c0 = time.perf_counter(), time.thread_time()
        for j, table in enumerate(tables):
            pq.write_table(table, run_dir / f"direct-{j}.parquet", compression="zstd", compression_level=1)
        directs.append(time.perf_counter() - t0)
        direct_cpus.append(time.thread_time() - c0)
    stats = rec.stats
    return {"wall_s": float(np.median(walls)), "direct_s": float(np.median(directs)), "rows": stats["rows"],
            "cpu_s": float(np.median(cpus)), "direct_cpu_s": float(np.median(direct_cpus)),
            "bytes": stats["bytes"], "files": stats["files"], "table": tables[0]}


def bench_encodings(table: pa.Table, out: Path) -> list[tuple[str, float, float]]:
    """(option, bytes/token, write seconds) for the Parquet encodings considered."""
    ints_dict = [c for c in F.TOKEN_SCHEMA.names if c not in F.FLOAT_COLUMNS]
    enc = F.PARQUET_WRITE_OPTIONS["column_encoding"]
    variants = {
        "dictionary ints, plain floats": {"use_dictionary": ints_dict, "column_encoding": None},
        "dictionary ints, BSS floats": {"use_dictionary": ints_dict,
                                        "column_encoding": dict.fromkeys(F.FLOAT_COLUMNS, "BYTE_STREAM_SPLIT")},
        "delta ints, plain floats": {"column_encoding": {k: v for k, v in enc.items() if k not in F.FLOAT_COLUMNS}},
        "format v1.1 (delta ints, plain token ids, BSS floats)": {},
    }
    bf16_valued = table.set_column(
        table.schema.get_field_index("logp"), "logp",
        pa.array(torch.from_numpy(table.column("logp").to_numpy()).bfloat16().float().numpy()))
    rows = []
    for data_name, t in (("float32 values", table), ("bf16-valued logp", bf16_valued)):
        for name, opts in variants.items():
            t0 = time.perf_counter()
            path = F.publish_part(t, out, f"enc-{len(rows)}.parquet", **opts)
            rows.append((f"{data_name}: {name}", Path(path).stat().st_size / t.num_rows, time.perf_counter() - t0))
    return rows


def bench_bf16_widening(batches: list[dict]) -> tuple[float, float]:
    """Tokens/s widening bfloat16 to float32 on the host: kldiag's bit shift vs torch .float()."""
    bf16 = [b["logp"].bfloat16() for b in batches]
    raw = [W.HostArray(t.view(torch.int16).numpy(), "bf16") for t in bf16]
    n = sum(t.numel() for t in bf16)
    t0 = time.perf_counter()
    [a.numpy() for a in raw]
    t1 = time.perf_counter()
    [t.float().numpy() for t in bf16]
    return n / (t1 - t0), n / (time.perf_counter() - t1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=104, help="micro-batches (104 x [64, 2048] ~ 10M tokens)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--time", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3, help="writer measurements (median kept)")
    ap.add_argument("--distinct", type=int, default=16, help="distinct micro-batches generated, then cycled")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if not hasattr(kldiag.Recorder, "writer_cpu_s"):
        writer_cpu_clock()
    batches = make_batches(args.distinct, args.batch, args.time)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        w = bench_writer(batches, args.batches, tmp / "writer", args.repeats)
        tps, direct_tps = w["rows"] / w["wall_s"], w["rows"] / w["direct_s"]
        print(f"tokens recorded: {w['rows']:,} in {args.batches} micro-batches of [{args.batch}, {args.time}], "
              f"{w['files']} parts")
        print(f"writer: {tps / 1e6:.2f} M tokens/s end to end (record() .. close(), median of {args.repeats}); "
              f"pyarrow write_table of the same tables: {direct_tps / 1e6:.2f} M tokens/s; "
              f"ratio {tps / direct_tps:.2f}")
        cpu_m, direct_cpu_m = w["cpu_s"] / w["rows"] * 1e6, w["direct_cpu_s"] / w["rows"] * 1e6
        print(f"writer CPU: {cpu_m:.3f} s per million tokens (writer threads' thread CPU time, median of "
              f"{args.repeats}); pq.write_table: {direct_cpu_m:.3f} s per million tokens; ratio "
              f"{cpu_m / direct_cpu_m:.2f}")
        print(f"bytes/token on disk: {w['bytes'] / w['rows']:.2f} (bar: <= 14)")
        pace = 2 * w["wall_s"] / args.batches
        print(f"hold per record() call: paced = {pace * 1e3:.0f} ms of 'compute' after each call (2x the "
              "writer's time per micro-batch); back to back = no pause, so once queue_batches are in flight "
              "record() waits for the writer (backpressure='block')")
        for dtype in (torch.float32, torch.bfloat16):
            h = bench_hold(batches, args.batches, dtype, tmp / f"hold-{str(dtype)[6:]}", pace)
            print(f"  {str(dtype)[6:]} CPU tensors: bare .cpu().numpy() {h['bare_s'] * 1e6:.0f} us, "
                  f".clone().numpy() {h['clone_s'] * 1e6:.0f} us")
            for regime in ("paced", "back to back"):
                mean, median = h[regime]
                print(f"    record() {regime}: mean {mean * 1e6:.0f} us, median {median * 1e6:.0f} us; "
                      f"median / bare {median / h['bare_s']:.1f}, median / clone {median / h['clone_s']:.2f}")
        shift, torch_float = bench_bf16_widening(batches)
        print(f"bf16 -> float32 on the host (writer thread): bit shift {shift / 1e6:.0f} M values/s, "
              f"torch .float() {torch_float / 1e6:.0f} M values/s")
        print("encodings (first part, same rows):")
        for name, bpt, secs in bench_encodings(w["table"], tmp / "enc"):
            print(f"  {name:70s} {bpt:6.2f} bytes/token  {w['table'].num_rows / secs / 1e6:6.1f} M tokens/s")


if __name__ == "__main__":
    main()
