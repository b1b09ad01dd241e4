"""Bytes per token of MoE routes on disk (format v1.3): the per-token summary vs the full expert lists.

    python bench/routing_bytes.py [--layers 48 --dense 0 --topk 8 --experts 128 --tokens 200000 --differ 0.02]

Records the same tokens three times with kldiag.Recorder (zstd level 1, the format's encodings): without
routes, with the routes' summary (the default), and with full_routes=True; prints the bytes per token of
each and the routes' share. Data: log-probs as bench/recorder.py's (a heavy tail near 0), the trainer's
top-k experts drawn without replacement per token and layer, the engine's the same set in a shuffled
order (engines may list experts unsorted), one expert replaced on a `--differ` share of (token, layer).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

import kldiag


def routes(rng: np.random.Generator, n: int, layers: int, dense: int, k: int, experts: int,
           differ: float) -> tuple[np.ndarray, np.ndarray]:
    """[n, L, k] trainer and engine expert ids (-1 on the first `dense` layers)."""
    e = np.argsort(rng.random((n, layers, experts)), axis=-1)[..., :k].astype(np.int16)
    s = np.take_along_axis(e, np.argsort(rng.random(e.shape), axis=-1), axis=-1)
    hit = rng.random((n, layers)) < differ
    free = (e.max(-1) + 1) % experts  # outside the set unless it wraps to an id in it (ok is False there)
    ok = ~(e == free[..., None]).any(-1)
    s[..., 0] = np.where(hit & ok, free, s[..., 0])
    e[:, :dense] = s[:, :dense] = -1
    return e, s


def record(path: Path, batches: list[dict], full: bool | None) -> int:
    with kldiag.Recorder(path, full_routes=bool(full), rotate_seconds=None) as rec:
        for step, b in enumerate(batches):
            args = {k: v for k, v in b.items() if full is not None or k not in ("experts", "experts_sampler")}
            rec.record(step=step, **args)
    return sum(p.stat().st_size for p in (path / "tokens").rglob("*.parquet"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--dense", type=int, default=0, help="dense layers (no route) on the layer axis")
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=200_000)
    ap.add_argument("--time", type=int, default=1024)
    ap.add_argument("--differ", type=float, default=0.02, help="share of (token, layer) routed differently")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    rows = max(a.tokens // a.time, 1)
    batches = []
    for _ in range(max(rows // 8, 1)):
        n = 8 * a.time
        logp = -rng.exponential(0.3, (8, a.time)).astype(np.float32)
        e, s = routes(rng, n, a.layers, a.dense, a.topk, a.experts, a.differ)
        shape = (8, a.time, a.layers, a.topk)
        batches.append({"logp": logp, "logp_old": logp + rng.normal(0, 0.01, logp.shape).astype(np.float32),
                        "logp_sampler": logp + rng.normal(0, 0.02, logp.shape).astype(np.float32),
                        "experts": e.reshape(shape), "experts_sampler": s.reshape(shape)})
    tokens = sum(b["logp"].size for b in batches)
    with tempfile.TemporaryDirectory() as tmp:
        size = {mode: record(Path(tmp) / str(mode), batches, full)
                for mode, full in (("none", None), ("summary", False), ("full", True))}
    print(f"{tokens:,} tokens, {a.layers} layers ({a.dense} dense), top-{a.topk} of {a.experts} experts, "
          f"{a.differ:.0%} of (token, layer) routed differently")
    raw = 2 * a.layers * a.topk * 2
    for mode, n in size.items():
        extra = "" if mode == "none" else f"  (routes: {(n - size['none']) / tokens:8.2f} B/token)"
        print(f"{mode:>8}: {n / tokens:8.2f} bytes/token{extra}")
    print(f"full routes before compression: {raw} bytes/token (two sides, int16)")


if __name__ == "__main__":
    main()
