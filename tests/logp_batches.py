"""Random log-prob columns from ordinary to extreme, shared by the compiled passes' tests."""

from __future__ import annotations

import numpy as np
import pyarrow as pa


def logp_columns(rng: np.random.Generator, n: int, special: np.ndarray, odd: float = 0.03, null_rate: float = 0.05,
                 absent: tuple[str, ...] = ()) -> dict[str, pa.Array]:
    """advantage, mask and the four log-prob columns of n rows: special values (NaN, +-inf, positive) at rate
    `odd` per column, nulls at `null_rate` (never in logp), the `absent` columns all null, mask holes."""
    s = -rng.exponential(2.0, n)
    cols = {"logp": s, "logp_ref": s + rng.normal(0, rng.choice([0.01, 1.0, 8.0], n)),
            "logp_old": s + rng.normal(0, 0.3, n), "logp_sampler": s + rng.normal(0, 0.05, n)}
    arrays = {}
    for c, v in cols.items():
        v = v.astype(np.float32)
        hit = rng.random(n) < odd
        v[hit] = rng.choice(special, hit.sum())
        null = rng.random(n) < (0.0 if c == "logp" else null_rate)
        if c in absent:
            null[:] = True
        arrays[c] = pa.array(v, mask=null)
    adv = rng.normal(0, 1, n)
    adv[rng.random(n) < 0.2] = np.nan
    mask = rng.random(n) < 0.8
    return {"advantage": pa.array(adv.astype(np.float32)), "mask": pa.array(mask, mask=rng.random(n) < 0.01),
            **arrays}
