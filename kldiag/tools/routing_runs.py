"""Small synthetic MoE-routing runs for tests and demos: routes drawn at random, the engine's mismatch put on
the tokens it routes differently. The real-model runs with a known truth are kldiag/tools/truth_moe.py's.

    from kldiag.tools.routing_runs import batches, write
    write("runs/r", batches(differ=0.1, layer=2, gap=1.5), config={"routing_replay": "R3"})
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from kldiag.record.recorder import Recorder

STEPS, B, T, L, K = 6, 8, 20, 4, 2


def batches(seed: int = 0, differ: float = 0.1, layer: int = 2, gap: float = 1.0,
            missing_from: int | None = None) -> list[dict[str, Any]]:
    """STEPS record() arguments of [B, T] tokens with [B, T, L, K] routes (layer 0 dense). On a `differ` share of
    tokens the engine picks another expert at `layer` and its log-prob moves by N(0, gap); elsewhere by N(0, 0.01).
    The engine lists each set in reverse order (a set comparison must not care); from `missing_from` on it
    gives no route on the last layer."""
    rng = np.random.default_rng(seed)
    out = []
    for step in range(STEPS):
        e = np.argsort(rng.random((B, T, L, 8)), -1)[..., :K]
        e[:, :, 0] = -1
        s = e[..., ::-1].copy()
        dis = rng.random((B, T)) < differ
        s[dis, layer, 0] = (e[dis, layer].max(-1) + 1) % 8
        if missing_from is not None and step >= missing_from:
            s[:, :, L - 1] = -1
        logp = -rng.exponential(0.5, (B, T))
        mu = logp + rng.normal(0, 0.01, (B, T)) + np.where(dis, rng.normal(0, gap, (B, T)), 0.0)
        out.append({"step": step, "logp": logp, "logp_sampler": mu, "logp_ref": logp - rng.exponential(0.05, (B, T)),
                    "mask": rng.random((B, T)) < 0.9, "experts": e, "experts_sampler": s})
    return out


def write(path: str | Path, data: list[dict[str, Any]], config: dict | None = None, trainer: str = "verl") -> Path:
    """The batches recorded with kldiag.Recorder; returns path."""
    with Recorder(path, trainer=trainer, config=config or {}) as rec:
        for d in data:
            rec.record(**d)
    return Path(path)
