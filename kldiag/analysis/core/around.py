"""The token ids around each flagged row, read off the record batches the analysis reads anyway.

The report shows its worst tokens between their neighbours. A flagged row (stats.flag_rows) carries
`context`, int32 [n, 2 * WIDTH]: the token ids at pos - WIDTH .. pos - 1, then pos + 1 .. pos + WIDTH, of
its sequence (step, seq, iteration). The analysis reads a sequence's rows as one run (scans.seq_starts),
in pos order as every writer stores them, so those are the rows just before and after the flagged one:
no second read of the part. Across record batches of one part, the previous batch's last WIDTH rows
(`Edge.tail`) stand before the batch's first row, and a row whose sequence reaches the batch's end stays
open (`OPEN`: the after-rows scanned so far) until the part's next batch (`close`) or its end.

Slots: a token id; NULL_TOKEN where the id is null; ABSENT where the sequence has no such position;
UNKNOWN (the whole row) where the rows in reach are out of pos order: kldiag.analysis.runtime.context
then reads that token's context from the part.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kldiag.analysis.core.batch import Batch
from kldiag.analysis.core.keyed import Keyed
from kldiag.analysis.kernels import context
from kldiag.analysis.kernels.context import ABSENT, NULL_TOKEN, UNKNOWN, WIDTH

CONTEXT, OPEN = "context", "context_open"  # the flagged rows' columns; OPEN is dropped when the part ends
ROW = "batch_row"  # a flagged row's index in its batch, until `attach` turns it into its context
KEYS = ("step", "seq", "iteration")
ROW_COLUMNS = (*KEYS, "pos", "token_id")


@dataclass
class Edge:
    """What one record batch leaves to the next of its part: its last WIDTH rows (with the rows before
    them when it has fewer), and its first WIDTH rows, which close the rows left open before it."""

    tail: Keyed | None = None
    head: Keyed | None = None


def rows_at(b: Batch, idx: np.ndarray) -> Keyed:
    """ROW_COLUMNS of the batch at `idx` (null ids as NULL_TOKEN, a null iteration or pos as 0)."""
    idx = np.asarray(idx, np.int64)
    return {"step": b.step[idx].astype(np.int64), "seq": b.seq[idx].astype(np.int64),
            "iteration": b.at("iteration", idx), "pos": b.at("pos", idx), "token_id": b.at("token_id", idx, NULL_TOKEN)}


def _concat(a: Keyed | None, b: Keyed) -> Keyed:
    return b if not a else {c: np.concatenate([a[c], b[c]]) for c in ROW_COLUMNS}


def advance(edge: Edge, b: Batch) -> None:
    """The edge after batch `b` (read once its flagged rows took their context)."""
    n = b.n
    edge.head = rows_at(b, np.arange(min(n, WIDTH)))
    edge.tail = {c: v[-WIDTH:] for c, v in _concat(edge.tail, rows_at(b, np.arange(max(n - WIDTH, 0), n))).items()}


def attach(table: Keyed, b: Batch, tail: Keyed | None) -> Keyed:
    """The batch's selected flagged rows (`table`, with their ROW) with CONTEXT and OPEN in place of ROW."""
    if not table:
        return table
    out = {c: v for c, v in table.items() if c != ROW}
    out[CONTEXT], out[OPEN] = context_of(b, table[ROW], tail)
    return out


def context_of(b: Batch, rows: np.ndarray, tail: Keyed | None) -> tuple[np.ndarray, np.ndarray]:
    """(CONTEXT [len(rows), 2 * WIDTH] int32, OPEN [len(rows)] int64: after-rows scanned when the sequence
    reaches the batch's end, else -1) of the batch's `rows`, the previous batch's `tail` before it.

    One compiled loop (kernels/context.py) over the batch's columns as stored: no gather per column."""
    rows = np.ascontiguousarray(rows, np.int64)
    ctx = np.empty((len(rows), 2 * WIDTH), np.int32)
    open_ = np.empty(len(rows), np.int64)
    if not len(rows):
        return ctx, open_
    tail_rows = np.stack([np.asarray(tail[c], np.int64) for c in ROW_COLUMNS], axis=1) if tail else \
        np.zeros((0, len(ROW_COLUMNS)), np.int64)
    cols = [_with_bits(*b.int_view(c), b.n) for c in ROW_COLUMNS[2:]]  # iteration, pos, token_id
    context.context_rows(b.step, b.seq, *cols[0], *cols[1], *cols[2], rows, tail_rows, ctx, open_)
    return ctx, open_


_all_valid = np.zeros(0, np.uint8)


def _with_bits(values: np.ndarray, bits: np.ndarray, off: int, n: int) -> tuple[np.ndarray, np.ndarray, int]:
    """A Batch.int_view with validity bits even when no row is null: one shared read-only all-set array."""
    global _all_valid
    if len(bits):
        return values, bits, off
    if len(_all_valid) < (n + 7) // 8:
        _all_valid = np.full(max((n + 7) // 8, 2 * len(_all_valid)), 255, np.uint8)
        _all_valid.flags.writeable = False
    return values, _all_valid, 0


def close(table: Keyed, head: Keyed | None) -> Keyed:
    """The flagged rows of `table` with their open after-context continued from `head` (the part's next
    batch's first rows); head None: the part ended, so their sequences did (no later position)."""
    if not table or OPEN not in table or not (table[OPEN] >= 0).any():
        return table
    table = {c: v.copy() if c in (CONTEXT, OPEN) else v for c, v in table.items()}
    ctx, open_ = table[CONTEXT], table[OPEN]
    for i in np.flatnonzero(open_ >= 0):
        open_[i] = _go_on(ctx[i], int(open_[i]), {c: int(table[c][i]) for c in (*KEYS, "pos")}, head)
    return table


def _go_on(ctx: np.ndarray, scanned: int, me: dict[str, int], head: Keyed | None) -> int:
    """Fill one open row's after-slots (`ctx`, in place) from `head`; its new OPEN value."""
    if head is None:
        return -1
    p = me["pos"]
    filled = np.flatnonzero(ctx[WIDTH:] != ABSENT)
    last = p + 1 + int(filled[-1]) if len(filled) else p
    for h in range(len(head["pos"])):
        if any(int(head[c][h]) != me[c] for c in KEYS):
            return -1  # the sequence ended with the batch
        q = int(head["pos"][h])
        if q <= last:
            ctx[:] = UNKNOWN
            return -1
        if q - p > WIDTH:
            return -1
        ctx[WIDTH - 1 + q - p] = head["token_id"][h]
        last, scanned = q, scanned + 1
        if q - p == WIDTH or scanned >= WIDTH:
            return -1
    return scanned  # the head was shorter than what is still wanted: open until the next batch


def done(table: Keyed) -> Keyed:
    """The part's flagged rows once it ended: every open context closed, the OPEN column dropped."""
    return {c: v for c, v in close(table, None).items() if c != OPEN} if table else table
