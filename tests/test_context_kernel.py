"""The flagged rows' context in one compiled loop (kldiag/analysis/kernels/context.py, through around.context_of)
against the plain-numpy version it replaced, kept here as the reference: equal bit for bit on random parts cut
into record batches (Arrow slices: offsets into the validity bits), with null ids, iterations and positions,
positions out of order, sequences crossing batch edges, and rows at a batch's first and last WIDTH rows."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from kldiag.analysis.core import around as A
from kldiag.analysis.core.batch import Batch
from kldiag.analysis.kernels import context

W = A.WIDTH


# ---- the reference: around.context_of as plain numpy, reading columns through pyarrow's take -----------------


def ref_at(b: Batch, name: str, rows: np.ndarray, fill: int = 0) -> np.ndarray:
    col = b.arrow.column(name).take(pa.array(rows, pa.int64()))
    return (col.fill_null(fill) if col.null_count else col).to_numpy(zero_copy_only=False).astype(np.int64)


def ref_rows_at(b: Batch, idx: np.ndarray) -> dict:
    idx = np.asarray(idx, np.int64)
    return {"step": b.step[idx].astype(np.int64), "seq": b.seq[idx].astype(np.int64),
            "iteration": ref_at(b, "iteration", idx), "pos": ref_at(b, "pos", idx),
            "token_id": ref_at(b, "token_id", idx, A.NULL_TOKEN)}


def ref_context_of(b: Batch, rows: np.ndarray, tail: dict | None) -> tuple[np.ndarray, np.ndarray]:
    rows = np.asarray(rows, np.int64)
    ctx = np.full((len(rows), 2 * W), A.ABSENT, np.int32)
    open_ = np.full(len(rows), -1, np.int64)
    if not len(rows):
        return ctx, open_
    me = ref_rows_at(b, rows)
    k = len(tail["pos"]) if tail else 0
    steps = np.arange(1, W + 1)
    j = np.concatenate([rows[:, None] - steps, rows[:, None] + steps], axis=1)
    jj = np.clip(j, -k, b.n - 1).ravel()
    got = ref_rows_at(b, np.maximum(jj, 0))
    before = np.flatnonzero(jj < 0)
    for c in A.ROW_COLUMNS if len(before) else ():
        got[c][before] = tail[c][k + jj[before]]
    got = {c: v.reshape(j.shape) for c, v in got.items()}
    inside = (j >= -k) & (j < b.n)
    same = inside & np.all([got[c] == me[c][:, None] for c in A.KEYS], axis=0)
    bad = np.zeros(len(rows), bool)
    for side, cols in ((-1, range(W)), (1, range(W, 2 * W))):
        alive = np.ones(len(rows), bool)
        last = me["pos"].copy()
        for d, col in enumerate(cols, 1):
            if side > 0:
                open_[alive & ~inside[:, col] & (open_ < 0)] = d - 1
            alive &= same[:, col]
            at = np.flatnonzero(alive)
            if not len(at):
                break
            q = got["pos"][at, col]
            ordered = (q > last[at]) if side > 0 else (q < last[at])
            bad[at[~ordered]] = True
            last[at] = q
            off = (q - me["pos"][at]) * side
            near = ordered & (off >= 1) & (off <= W)  # off < 1 only after a row went out of order (UNKNOWN anyway);
            # the numpy version in use until the kernel lacked `off >= 1` and raised IndexError there
            ctx[at[near], (W - 1 + off if side > 0 else W - off)[near]] = got["token_id"][at[near], col]
            alive[at[off >= W]] = False
    ctx[bad] = A.UNKNOWN
    open_[bad] = -1
    return ctx, open_


# ---- random parts ---------------------------------------------------------------------------------------------


def random_part(rng: np.random.Generator, n: int) -> pa.Table:
    """Sequences of 1..12 rows, some sharing (step, seq) with another iteration; positions mostly ascending with
    gaps, a few swapped or repeated; nulls in token_id, iteration and pos."""
    step, seq, it, pos = [], [], [], []
    s = q = 0
    while len(pos) < n:
        s += int(rng.integers(0, 2))
        q += int(rng.integers(0, 3))
        length = int(rng.integers(1, 13))
        p = np.cumsum(rng.choice([1, 1, 1, 2, 3, 7], length)) + int(rng.integers(-1, 3))
        if rng.random() < 0.25 and length > 1:
            a = int(rng.integers(0, length - 1))
            p[a], p[a + 1] = (p[a + 1], p[a]) if rng.random() < 0.7 else (p[a], p[a])
        step += [s] * length
        seq += [q] * length
        it += [int(rng.integers(0, 2))] * length
        pos += p.tolist()
    n = len(pos)

    def nulls(values, rate):
        return [None if rng.random() < rate else int(v) for v in values]

    return pa.table({
        "step": pa.array(step, pa.int64()), "seq": pa.array(seq, pa.int64()),
        "iteration": pa.array(nulls(it, 0.05), pa.int16()), "pos": pa.array(nulls(pos, 0.05), pa.int32()),
        "token_id": pa.array(nulls(rng.integers(0, 50_000, n), 0.15), pa.int32()), "mask": pa.array(np.ones(n, bool)),
        **{c: pa.array(np.zeros(n), pa.float32()) for c in ("logp", "logp_old", "logp_ref", "logp_sampler",
                                                             "advantage")}})


def batches_of(table: pa.Table, rng: np.random.Generator) -> list[Batch]:
    """The part as record batches of 1..40 rows: Arrow slices of one array (offsets not multiples of 8)."""
    rb = table.combine_chunks().to_batches()[0]
    cuts = [0]
    while cuts[-1] < rb.num_rows:
        cuts.append(min(rb.num_rows, cuts[-1] + int(rng.integers(1, 41))))
    return [Batch.from_arrow(rb.slice(lo, hi - lo)) for lo, hi in zip(cuts[:-1], cuts[1:], strict=True)]


def test_the_kernel_equals_the_numpy_reference_on_random_parts():
    rng = np.random.default_rng(7)
    checked = unknown = opened = from_tail = 0
    for _ in range(60):
        edge = A.Edge()
        for b in batches_of(random_part(rng, int(rng.integers(5, 200))), rng):
            edges = np.r_[np.arange(min(W, b.n)), np.arange(max(b.n - W, 0), b.n)]
            rows = np.unique(np.r_[edges, rng.integers(0, b.n, 8)])
            rng.shuffle(rows)
            got = A.context_of(b, rows, edge.tail)
            want = ref_context_of(b, rows, edge.tail)
            np.testing.assert_array_equal(got[0], want[0])
            np.testing.assert_array_equal(got[1], want[1])
            assert got[0].dtype == np.int32 and got[1].dtype == np.int64
            checked += len(rows)
            unknown += int((want[0][:, 0] == A.UNKNOWN).sum())
            opened += int((want[1] >= 0).sum())
            from_tail += int((rows < W).sum()) if edge.tail else 0
            A.advance(edge, b)
    assert checked > 3000 and unknown > 100 and opened > 300 and from_tail > 300  # every case was reached


def test_no_rows_and_a_batch_without_nulls():
    b = Batch.from_arrow(pa.record_batch({
        "step": pa.array([0] * 4, pa.int64()), "seq": pa.array([0] * 4, pa.int64()),
        "iteration": pa.array([0] * 4, pa.int16()), "pos": pa.array([0, 1, 2, 3], pa.int32()),
        "token_id": pa.array([5, 6, 7, 8], pa.int32()), "mask": pa.array(np.ones(4, bool)),
        **{c: pa.array(np.zeros(4), pa.float32()) for c in ("logp", "logp_old", "logp_ref", "logp_sampler",
                                                             "advantage")}}))
    ctx, open_ = A.context_of(b, np.zeros(0, np.int64), None)
    assert ctx.shape == (0, 2 * W) and open_.shape == (0,)
    ctx, open_ = A.context_of(b, np.array([2]), None)
    assert ctx[0].tolist() == [A.ABSENT] * 3 + [5, 6, 8] + [A.ABSENT] * 4 and open_.tolist() == [1]


def test_the_tail_columns_are_read_in_row_columns_order():
    order = (context.TAIL_STEP, context.TAIL_SEQ, context.TAIL_ITERATION, context.TAIL_POS, context.TAIL_TOKEN)
    assert [A.ROW_COLUMNS[i] for i in order] == ["step", "seq", "iteration", "pos", "token_id"]
