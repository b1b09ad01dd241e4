"""The flagged rows' context as the pass reads it (kldiag/analysis/core/around.py): the token ids around a row from
its batch's neighbours, the previous batch's tail before it, the next batch's head after it."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from kldiag.analysis.core import around as A
from kldiag.analysis.core.batch import Batch

W = A.WIDTH


def _batch(seq: list[int], pos: list[int], ids: list[int | None]) -> Batch:
    n = len(seq)
    return Batch.from_arrow(pa.record_batch({
        "step": pa.array(np.zeros(n), pa.int64()), "seq": pa.array(seq, pa.int64()),
        "iteration": pa.array(np.zeros(n), pa.int16()), "pos": pa.array(pos, pa.int32()),
        "token_id": pa.array(ids, pa.int32()), "mask": pa.array(np.ones(n, bool)),
        **{c: pa.array(np.zeros(n), pa.float32()) for c in ("logp", "logp_old", "logp_ref", "logp_sampler",
                                                             "advantage")}}))


def _flagged(b: Batch, rows: list[int], tail=None) -> dict:
    """The flagged-row table around.attach makes, with the key columns close() reads."""
    me = A.rows_at(b, np.array(rows))
    return A.attach({**{c: me[c] for c in (*A.KEYS, "pos")}, A.ROW: np.array(rows)}, b, tail)


def test_context_within_one_batch_with_null_ids_and_sequence_edges():
    b = _batch([0] * 4 + [1] * 8, [0, 1, 2, 3, *range(8)], [10, 11, None, 13, *range(20, 28)])
    t = A.done(_flagged(b, [1, 9]))  # seq 0 pos 1; seq 1 pos 5
    assert t[A.CONTEXT][0].tolist() == [A.ABSENT] * 4 + [10] + [A.NULL_TOKEN, 13] + [A.ABSENT] * 3
    assert t[A.CONTEXT][1].tolist() == [20, 21, 22, 23, 24, 26, 27] + [A.ABSENT] * 3
    assert A.OPEN not in t


def test_a_sequence_cut_by_batches_takes_its_context_from_the_tail_and_the_head():
    """One sequence of 14 tokens read as batches of 6, 2 and 6 rows: the row at pos 6 (the second batch's first)
    takes 5 ids before it from the tail of the first batch, and the 5 after it from the second and third."""
    ids = list(range(100, 114))
    batches = [_batch([0] * n, list(range(lo, lo + n)), ids[lo:lo + n]) for lo, n in ((0, 6), (6, 2), (8, 6))]
    edge = A.Edge()
    A.advance(edge, batches[0])
    table = _flagged(batches[1], [0], edge.tail)
    assert table[A.OPEN].tolist() == [1]  # one row after it in its batch, the sequence goes on
    A.advance(edge, batches[1])
    A.advance(edge, batches[2])  # as PartReducer.add: the next batch read, then the open rows closed by its head
    table = A.close(table, edge.head)
    assert table[A.OPEN].tolist() == [-1]
    assert A.done(table)[A.CONTEXT][0].tolist() == ids[1:6] + ids[7:12]


def test_rows_out_of_pos_order_are_unknown_and_the_part_end_closes_the_rest():
    b = _batch([0] * 6, [0, 1, 3, 2, 4, 5], list(range(6)))
    t = A.done(_flagged(b, [1, 5]))
    assert (t[A.CONTEXT][0] == A.UNKNOWN).all()  # pos 3 before pos 2 after pos 1
    assert (t[A.CONTEXT][1] == A.UNKNOWN).all()  # pos 3 after pos 2 before pos 5
    t = _flagged(_batch([0] * 3, [0, 1, 2], [7, 8, 9]), [1])
    assert t[A.OPEN].tolist() == [1]
    assert A.done(t)[A.CONTEXT][0].tolist() == [A.ABSENT] * 4 + [7, 9] + [A.ABSENT] * 4


def test_a_row_after_positions_far_out_of_order_is_unknown():
    """pos 16 then 15 before pos 10: out of order, then in order again but past the row (the numpy version before
    the compiled loop raised IndexError on it)."""
    b = _batch([0] * 4, [15, 16, 10, 11], [1, 2, 3, 4])
    t = A.done(_flagged(b, [2]))
    assert (t[A.CONTEXT][0] == A.UNKNOWN).all()
