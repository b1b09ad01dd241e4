"""Importer benchmark: `kldiag import prime-rl` throughput and memory against baselines.

    python bench/importers.py [--steps 4 --ranks 2 --seqs 256 --len 1024]

Writes a prime-rl token export (token_exports/step_N/rank_r.jsonl, as TokenExporter writes
it: tests/importer_fixtures.py cites the lines) and prints, each a ratio to a baseline
measured in the same run:
- import: tokens/s of import_dumps (JSONL -> kldiag run, published) / tokens/s of json.loads
  over the same lines (the parse every JSONL reader pays; the decode limit);
- memory: the import's peak RSS growth / the largest dump file's size (bounded memory:
  the importer holds a 256-sequence micro-batch, not a file), also / all files' size.
Each measurement runs in a fresh process so peak RSS is its own.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def write_export(out: Path, steps: int, ranks: int, seqs: int, length: int) -> int:
    """A prime-rl export; returns the number of loss tokens."""
    rng = np.random.default_rng(0)
    tokens = 0
    for step in range(steps):
        d = out / "token_exports" / f"step_{step}"
        d.mkdir(parents=True)
        for rank in range(ranks):
            with open(d / f"rank_{rank}.jsonl", "w") as f:
                for k in range(seqs):
                    n = int(rng.integers(length // 2, length))
                    p = n // 4
                    t = np.round(-np.abs(rng.standard_exponential(n) * 0.3), 6)
                    inf = np.round(t + rng.normal(0, 0.02, n), 6).clip(max=0)
                    inf[:p] = 0.0
                    loss = np.arange(n) >= p
                    tokens += int(loss.sum())
                    rec = {"schema_version": 1, "step": step, "rank": rank, "micro_step": k // 16,
                           "micro_sequence_idx": k % 16, "export_sequence_idx": k, "env_name": "math",
                           "token_ids": rng.integers(0, 151_936, n).tolist(), "position_ids": list(range(n)),
                           "loss_mask": loss.tolist(), "advantages": [float(rng.normal())] * n,
                           "inference_logprobs": inf.tolist(), "trainer_logprobs": t.tolist(),
                           "entropy": np.round(rng.random(n), 6).tolist(), "mismatch_kl": [0.0] * n}
                    f.write(json.dumps(rec, separators=(",", ":")) + "\n")
            (d / "STABLE").touch()
    return tokens


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _parse_only(src: str, q) -> None:
    base = _peak_mb()
    t0 = time.perf_counter()
    for p in sorted(Path(src).rglob("rank_*.jsonl")):
        with open(p, "rb") as f:
            for line in f:
                json.loads(line)
    q.put((time.perf_counter() - t0, _peak_mb() - base))


def _import(src: str, run: str, q) -> None:
    from kldiag.importers import import_dumps

    import_dumps  # noqa: B018 - imported before the baseline: RSS growth is the import's own
    base = _peak_mb()
    t0 = time.perf_counter()
    import_dumps("prime-rl", src, run)
    q.put((time.perf_counter() - t0, _peak_mb() - base))


def _in_process(target, *args) -> tuple[float, float]:
    q = mp.get_context("spawn").Queue()
    p = mp.get_context("spawn").Process(target=target, args=(*args, q))
    p.start()
    out = q.get()
    p.join()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--seqs", type=int, default=256, help="sequences per rank file")
    ap.add_argument("--len", type=int, default=1024, help="max sequence length")
    a = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "out"
        tokens = write_export(src, a.steps, a.ranks, a.seqs, a.len)
        files = list(src.rglob("rank_*.jsonl"))
        largest, total = max(f.stat().st_size for f in files) / 2**20, sum(f.stat().st_size for f in files) / 2**20
        t_parse, _ = _in_process(_parse_only, str(src))
        t_imp, rss = _in_process(_import, str(src), str(Path(tmp) / "run"))
        print(f"export: {len(files)} files, {total:.1f} MiB (largest {largest:.1f} MiB), {tokens:,} loss tokens")
        print(f"json.loads only : {tokens / t_parse / 1e6:6.2f} M tokens/s ({t_parse:.2f} s)")
        print(f"kldiag import   : {tokens / t_imp / 1e6:6.2f} M tokens/s ({t_imp:.2f} s)  "
              f"ratio to json.loads {t_parse / t_imp:.2f}")
        print(f"peak RSS growth : {rss:.0f} MiB = {rss / largest:.2f} x the largest file, "
              f"{rss / total:.2f} x all files")


if __name__ == "__main__":
    sys.exit(main())
