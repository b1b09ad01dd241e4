"""The Estimators page's token sample and the numpy merge of its partials (kldiag.views.estimators).

The sample always holds the tokens that matter most (the largest |k3 weight|, the worst flagged ones),
then a uniform draw of the others; `kept_pick` draws it from the always-kept sets that the compiled
pass (estimator_kernel.token_pass) selects, `sample_pick` from every token's weight (its reference).
`merge_arrays` merges partials held as named arrays (the reducer's cache format) exactly as
`estimators.merge_partials` merges EstimatorPartials, without pandas.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

SAMPLE_COLUMNS = ("step", "seq", "d", "rho", "weight_k2", "weight_k3", "weight_k3_is", "flagged", "kind")
# The scatter's sample always holds the tokens that matter most, then random ones (`kind`):
KEEP_TOP = 200  # tokens with the largest |k3 weight| ("top |k3 weight|"), per part and merged
KEEP_FLAGGED = 1000  # flagged tokens kept, the worst first ("flagged")
SAMPLED = "sampled"


KINDS = (SAMPLED, "top |k3 weight|", "flagged")  # the sample's `kind`, stored as its index


def kind_index(kind: np.ndarray) -> np.ndarray:
    """int8 KINDS index of each label (object [m])."""
    out = np.zeros(len(kind), np.int8)
    for i, k in enumerate(KINDS[1:], 1):
        out[kind == k] = i
    return out


SCALARS = ("rows", "tokens", "flagged", "clamp_saturated", "k3_weight_lost")
DTYPES = {"step": np.int64, "seq": np.int64, "kind": np.int8, "flagged": bool}  # else float64
PER_ESTIMATOR = ("value_sum", "value_nonfinite", "weight_abs_sum", "weight_abs_flagged", "weight_abs_max")


def largest(w: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest values of w, ties to the lower index: the set argsort(-w, stable)[:k]
    gives, found in linear time (argpartition) rather than by sorting every token."""
    if k <= 0 or not len(w):
        return np.zeros(0, np.int64)
    if len(w) <= k:
        return np.arange(len(w))
    kth = -np.partition(-w, k - 1)[k - 1]
    above = np.flatnonzero(w > kth)
    return np.concatenate([above, np.flatnonzero(w == kth)[: k - len(above)]])


def sample_pick(weight_k3: np.ndarray, flagged: np.ndarray, sample_size: int,
                seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows [m] of a token sample and their kind: the KEEP_FLAGGED worst flagged tokens and the
    KEEP_TOP largest |k3 weight| always (NaN weights count as largest), then at most
    `sample_size` drawn uniformly from the rest. Sorted row indices and kind labels (object [m])."""
    w = np.abs(np.asarray(weight_k3, dtype=np.float64))
    w = np.where(np.isnan(w), np.inf, w)
    top = largest(w, KEEP_TOP)
    flagged_at = np.flatnonzero(np.asarray(flagged, dtype=bool))
    flagged_rows = flagged_at[largest(w[flagged_at], KEEP_FLAGGED)]
    special = np.union1d(top, flagged_rows)
    others = np.ones(w.size, bool)
    others[special] = False
    rest = np.flatnonzero(others)
    if rest.size > sample_size:  # bounded: a scatter never draws every token
        rest = np.random.default_rng(seed).choice(rest, size=sample_size, replace=False)
    pick = np.sort(np.concatenate([special, rest]).astype(np.int64))
    kind = np.full(pick.size, SAMPLED, dtype=object)
    kind[np.isin(pick, top)] = "top |k3 weight|"
    kind[np.isin(pick, flagged_rows)] = "flagged"
    return pick, kind


def kept_pick(top: np.ndarray, worst: np.ndarray, m: int, sample_size: int,
              seed: int) -> tuple[np.ndarray, np.ndarray]:
    """sample_pick's (rows, kind) from its always-kept sets, found without the weights of every token:
    top and worst are the token numbers [< m] of `largest(|w|, KEEP_TOP)` and of the flagged tokens'
    `largest(.., KEEP_FLAGGED)` (estimator_kernel.token_pass keeps them). The uniform draw is
    sample_pick's own: the same generator call on as many others, the i-th other mapped to its number."""
    pick, kind = kept_pick_index(top, worst, m, sample_size, seed)
    return pick, np.array(KINDS, dtype=object)[kind]


def kept_pick_index(top: np.ndarray, worst: np.ndarray, m: int, sample_size: int,
                    seed: int) -> tuple[np.ndarray, np.ndarray]:
    """kept_pick with each kind as its KINDS index (int8)."""
    special = np.sort(np.concatenate([top, worst]).astype(np.int64))  # np.union1d's, without its hashing
    special = special[np.r_[True, special[1:] != special[:-1]]] if special.size else special
    n_rest = m - special.size
    if n_rest > sample_size:  # the p-th other: p plus the kept tokens at or below it among the others
        p = np.random.default_rng(seed).choice(n_rest, size=sample_size, replace=False)
        rest = p + np.searchsorted(special - np.arange(special.size), p, side="right")
    else:
        others = np.ones(m, bool)
        others[special] = False
        rest = np.flatnonzero(others)
    pick = np.sort(np.concatenate([special, rest]).astype(np.int64))
    kind = np.zeros(pick.size, np.int8)
    # top and worst are in pick (sorted, distinct): their places by binary search, not np.isin's sort of all
    kind[np.searchsorted(pick, np.asarray(top, np.int64))] = KINDS.index("top |k3 weight|")
    kind[np.searchsorted(pick, np.asarray(worst, np.int64))] = KINDS.index("flagged")
    return pick, kind


def merge_arrays(parts: Sequence[dict[str, np.ndarray]], sample_size: int = 5000,
                 seed: int = 0) -> dict[str, np.ndarray]:
    """to_arrays(merge_partials(...)) of partials as named arrays, in numpy: the same sums in the same
    order, maxima, histograms and sample."""
    parts = [p for p in parts if p is not None]
    out = {k: np.array([sum((p[k][0].item() for p in parts), 0.0 if k == "k3_weight_lost" else 0)])
           for k in SCALARS}
    names = list(dict.fromkeys(key.partition("/")[2] for p in parts for key in p if key.startswith("value_sum/")))
    for k in PER_ESTIMATOR:
        for name in names:
            have = [p[f"{k}/{name}"][0].item() for p in parts if f"{k}/{name}" in p]
            if k == "weight_abs_max":
                v = 0.0
                for x in have:
                    v = max(v, x)
            else:
                v = sum(have, 0 if k == "value_nonfinite" else 0.0)
            out[f"{k}/{name}"] = np.array([v])
    for name in names:
        out[f"weight_hist/{name}"] = sum((p[f"weight_hist/{name}"] for p in parts if f"weight_hist/{name}" in p), 0)
    out.update(_merge_sample_arrays([p for p in parts if len(p["sample/step"])], sample_size, seed))
    return out


def _merge_sample_arrays(parts: Sequence[dict[str, np.ndarray]], n: int, seed: int) -> dict[str, np.ndarray]:
    """_merge_samples on named arrays (kind as its KINDS index): the always-kept tokens re-selected, the
    others drawn weighted by each part's tokens per sampled token, all in a stable order by step."""
    if not parts:
        return {f"sample/{c}": np.zeros(0, DTYPES.get(c, np.float64)) for c in SAMPLE_COLUMNS}
    col = {c: np.concatenate([p[f"sample/{c}"] for p in parts]) for c in SAMPLE_COLUMNS}
    kind = col["kind"]
    special = np.flatnonzero(kind != 0)
    if len(special):
        pick, labels = sample_pick(col["weight_k3"][special], kind[special] == KINDS.index("flagged"), 0, 0)
        special = special[pick]
        special_kind = kind_index(labels)
    else:
        special_kind = np.zeros(0, np.int8)
    rest, weights, base = [], [], 0
    for p in parts:
        mine = np.flatnonzero(p["sample/kind"] == 0)
        rest.append(base + mine)
        weights.append(np.full(len(mine), p["tokens"][0].item() / max(len(mine), 1)))
        base += len(p["sample/kind"])
    rest, weights = np.concatenate(rest), np.concatenate(weights)
    if len(rest) > n:
        pick = np.random.default_rng(seed).choice(len(rest), size=n, replace=False, p=weights / weights.sum())
        rest = rest[np.sort(pick)]
    rows = np.concatenate([special, rest])
    order = np.argsort(col["step"][rows], kind="stable")
    out = {f"sample/{c}": v[rows][order] for c, v in col.items() if c != "kind"}
    out["sample/kind"] = np.concatenate([special_kind, np.zeros(len(rest), np.int8)])[order]
    return {f"sample/{c}": out[f"sample/{c}"] for c in SAMPLE_COLUMNS}
