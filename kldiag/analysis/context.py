"""The token ids around a run's worst tokens (largest |k3 weight|), read along with the analysis.

A reducer (reduce.py): per part, the `keep` tokens in the loss with the largest |1 - pi_ref/pi_theta|
(Schulman 2020's K3 weight, `estimators.weight_k3`), each with the token ids of the `width`
positions before and after it in its sequence. A sequence cut by a record-batch boundary is
carried into the next batch, so the context is whole. Merged: the `keep` largest over the run,
ties broken by (step, rank, seq, pos, iteration) as the analysis's flags table breaks them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kldiag import estimators as E

KEY = ("step", "rank", "seq", "iteration")  # one sequence's rows in one reuse iteration
ABSENT = -2  # a context slot outside the sequence (-1: a token id that is null)


@dataclass
class _State:
    rank: int
    carry: dict[str, np.ndarray] | None = None  # the rows of the batch's last sequence
    top: dict[str, np.ndarray] | None = None  # the running candidates: KEY, pos, w
    rows: dict[tuple, dict[int, int]] = field(default_factory=dict)  # candidate sequence -> {pos: token id}


def _columns(batch: pa.RecordBatch, rank: int) -> dict[str, np.ndarray]:
    def col(name: str, null: float | int) -> np.ndarray:
        return pc.fill_null(batch.column(name), null).to_numpy(zero_copy_only=False)

    s, r = col("logp", np.nan).astype(np.float64), col("logp_ref", np.nan).astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        w = np.abs(E.weight_k3(s, r))
    w = np.where(col("mask", False).astype(bool) & np.isfinite(w), w, -np.inf)
    return {"step": col("step", 0).astype(np.int64), "rank": np.full(batch.num_rows, rank, np.int64),
            "seq": col("seq", 0).astype(np.int64), "iteration": col("iteration", 0).astype(np.int64),
            "pos": col("pos", 0).astype(np.int64), "token_id": col("token_id", -1).astype(np.int64), "w": w}


def _hash(t: dict[str, np.ndarray]) -> np.ndarray:
    """One int64 per row for its KEY (collisions are checked against the key itself)."""
    with np.errstate(over="ignore"):
        return ((t["step"] * 1_000_003 + t["rank"]) * 1_000_033 + t["seq"]) * 65_537 + t["iteration"]


def _order(t: dict[str, np.ndarray]) -> np.ndarray:
    """Largest w first; ties in the analysis's flag order."""
    return np.lexsort([t["iteration"], t["pos"], t["seq"], t["rank"], t["step"], -t["w"]])


def _contenders(t: dict[str, np.ndarray], keep: int) -> dict[str, np.ndarray]:
    """The rows that can be among the `keep` largest w: at least the keep-th largest, every tie of it
    included (the order's other keys decide between them), so that _order's first `keep` rows of
    these are those of the whole table; a partition, where sorting every row of a batch cost about
    200 ns a row."""
    w = t["w"]
    if len(w) <= keep:
        return t
    at = np.flatnonzero(w >= np.partition(w, len(w) - keep)[len(w) - keep])
    return {c: v[at] for c, v in t.items()}


def _member(h: np.ndarray, of: np.ndarray) -> np.ndarray:
    """np.isin(h, of) for a few `of`: a binary search per row instead of one pass over h per value."""
    if not len(of):
        return np.zeros(len(h), bool)
    s = np.sort(of)
    return s[np.minimum(np.searchsorted(s, h), len(s) - 1)] == h


@dataclass(frozen=True)
class ContextReducer:
    """Per part the `keep` worst tokens and `width` token ids on each side of each."""

    keep: int = 32
    width: int = 5
    name: str = "context"
    version: int = 1
    columns: tuple[str, ...] = ("step", "seq", "iteration", "pos", "token_id", "logp", "logp_ref", "mask")

    def settings(self) -> dict:
        return {"keep": self.keep, "width": self.width}

    def start(self, part) -> _State:
        return _State(part.rank)

    def add(self, state: _State, batch: pa.RecordBatch) -> None:
        new = _columns(batch, state.rank)
        n_new = len(new["w"])
        t = new if state.carry is None else {c: np.concatenate([state.carry[c], new[c]]) for c in new}
        start = len(t["w"]) - n_new  # carried rows were candidates already
        cand = _contenders({c: v[start:] for c, v in t.items()}, self.keep)
        top = cand if state.top is None else {c: np.concatenate([state.top[c], cand[c]]) for c in cand}
        order = _order(top)[: self.keep]
        state.top = {c: v[order] for c, v in top.items()}
        wanted = set(zip(*(state.top[c].tolist() for c in KEY), strict=True))
        state.rows = {k: v for k, v in state.rows.items() if k in wanted}
        h = _hash(t)
        for i in np.flatnonzero(_member(h, _hash(state.top))):  # the rows of candidate sequences only
            k = tuple(int(t[c][i]) for c in KEY)
            if k in wanted:
                state.rows.setdefault(k, {})[int(t["pos"][i])] = int(t["token_id"][i])
        differ = np.flatnonzero(h != h[-1]) if len(h) else np.zeros(0, np.int64)
        tail = int(differ[-1]) + 1 if len(differ) else 0
        state.carry = {c: v[tail:] for c, v in t.items()}

    def finish(self, state: _State, dropped: int) -> dict[str, np.ndarray]:
        top = state.top or {c: np.zeros(0, np.float64 if c == "w" else np.int64) for c in (*KEY, "pos", "w")}
        top = {c: v[np.isfinite(top["w"])] for c, v in top.items()}
        ctx = np.full((len(top["w"]), 2 * self.width + 1), ABSENT, np.int64)
        for i, k in enumerate(zip(*(top[c] for c in KEY), strict=True)):
            rows, pos = state.rows.get(k, {}), int(top["pos"][i])
            for j, p in enumerate(range(pos - self.width, pos + self.width + 1)):
                ctx[i, j] = rows.get(p, ABSENT)
        return {**{c: top[c] for c in (*KEY, "pos", "w")}, "context": ctx}

    def merge(self, partials) -> dict[str, np.ndarray]:
        partials = [p for p in partials if len(p["w"])]
        if not partials:
            return self.finish(_State(0), 0)
        t = {c: np.concatenate([p[c] for p in partials]) for c in partials[0]}
        order = _order(t)[: self.keep]
        return {c: v[order] for c, v in t.items()}


def lookup(merged: dict[str, np.ndarray], width: int) -> dict[tuple, tuple[list[int], list[int]]]:
    """(step, rank, seq, iteration, pos) -> (token ids before, token ids after), absent slots left out."""
    out = {}
    ctx = merged["context"]
    mid = ctx.shape[1] // 2 if ctx.ndim == 2 else 0
    for i in range(len(merged["w"])):
        key = (*(int(merged[c][i]) for c in KEY), int(merged["pos"][i]))
        row = ctx[i]
        before = [int(x) for x in row[max(mid - width, 0):mid] if x != ABSENT]
        after = [int(x) for x in row[mid + 1: mid + 1 + width] if x != ABSENT]
        out[key] = (before, after)
    return out
