"""Kernel inputs: the columns of a record batch as numpy, and the thresholds.

The per-token maths and the one pass over a batch are in fused.py; this module turns a
record batch into the arrays it reads (float32 log-probs as stored, NaN at nulls).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

LOGPS = ("logp", "logp_old", "logp_ref", "logp_sampler")
LOSS_ONLY = ("logp_old", "logp_sampler")  # read only where mask is true: elsewhere a dump may hold placeholders
COLUMNS = ("step", "micro", "iteration", "seq", "group", "pos", "token_id", *LOGPS, "advantage", "mask")


@dataclass(frozen=True)
class Thresholds:
    """What the kernel and its partials need from AnalysisConfig (clip range resolved from the manifest)."""

    tau: float
    weight_limit: float
    clamp: float
    clip_low: float
    clip_high: float
    top_k: int
    per_rank: bool = True  # False: a part's per-step rows drop their rank, so ranks merge on the way in


# ---- columns ----------------------------------------------------------


def f32(batch: pa.RecordBatch, name: str) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(float32 values, NaN at nulls; null mask or None); (None, None) if every row is null."""
    col = batch.column(name)
    if col.null_count == len(col):
        return None, None
    values = col.to_numpy(zero_copy_only=False)
    return values, (np.asarray(col.is_null()) if col.null_count else None)


def ints(batch: pa.RecordBatch, name: str) -> np.ndarray:
    col = batch.column(name)
    return (col.fill_null(0) if col.null_count else col).to_numpy(zero_copy_only=False)


def bools(batch: pa.RecordBatch, name: str) -> np.ndarray:
    """A bool column as numpy, nulls False; unpacks Arrow's bitmap (20x its to_numpy)."""
    col = batch.column(name)
    if col.null_count:
        col = col.fill_null(False)
    bits = np.frombuffer(col.buffers()[1], np.uint8)
    return np.unpackbits(bits, count=col.offset + len(col), bitorder="little")[col.offset:].view(bool)


def int_view(col: pa.Array) -> tuple[np.ndarray, np.ndarray, int]:
    """(values, validity bits, bit offset) of an integer Arrow array as Batch.int_view gives them; another type
    is cast to int64 first, a column of nulls only reads as zeros with every bit 0."""
    n = len(col)
    if not n:
        return np.zeros(0, np.int64), np.zeros(0, np.uint8), 0
    if col.null_count == n:
        return np.broadcast_to(np.int64(0), (n,)), np.broadcast_to(np.uint8(0), ((n + 7) // 8,)), 0  # no copy
    if not pa.types.is_integer(col.type):
        col = col.cast(pa.int64())
    values = np.frombuffer(col.buffers()[1], col.type.to_pandas_dtype(), count=col.offset + n)[col.offset:]
    if not col.null_count:
        return values, np.zeros(0, np.uint8), 0
    return values, np.frombuffer(col.buffers()[0], np.uint8), col.offset


def valid_at(bits: np.ndarray, off: int, rows: np.ndarray) -> np.ndarray:
    """bool [len(rows)]: Arrow's validity bit of each row (bit offset `off`)."""
    i = np.asarray(rows, np.int64) + off
    return ((bits[i >> 3] >> (i & 7).astype(np.uint8)) & 1).astype(bool)


@dataclass
class Batch:
    """A record batch as numpy: int keys, bool mask, float32 log-probs (NaN at nulls)."""

    n: int
    step: np.ndarray
    seq: np.ndarray
    mask: np.ndarray
    raw: dict[str, np.ndarray | None]  # LOGPS and "advantage", float32
    null: dict[str, np.ndarray | None]  # null masks, None when no row is null
    arrow: pa.RecordBatch  # columns read only at a few rows (group, pos, token_id, ...)
    _views: dict = field(default_factory=dict, repr=False, compare=False)  # int_view's, by column

    @classmethod
    def from_arrow(cls, batch: pa.RecordBatch) -> Batch:
        """The batch's columns as numpy (the caller sorts a batch that is not step-ordered first)."""
        step = ints(batch, "step")
        raw, null = {}, {}
        for name in (*LOGPS, "advantage"):
            raw[name], null[name] = f32(batch, name)
        return cls(batch.num_rows, step, ints(batch, "seq"), bools(batch, "mask"), raw, null, batch)

    @property
    def partial_nulls(self) -> bool:
        """Some log-prob column is null on some rows only: NaN no longer tells a bad value."""
        return any(self.null[name] is not None for name in LOGPS)

    def int_view(self, name: str) -> tuple[np.ndarray, np.ndarray, int]:
        """Integer column `name` as stored, without a copy: (values [n], a view of Arrow's buffer whose slots at
        nulls hold anything; validity bits uint8, empty when no row is null; their bit offset). Row i is null
        when bit i + offset (least significant first) is 0. Made once per batch and column."""
        got = self._views.get(name)
        if got is None:
            got = self._views[name] = int_view(self.arrow.column(name))
        return got

    def at(self, name: str, rows: np.ndarray, fill: int = 0) -> np.ndarray:
        """Integer column `name` at `rows` (nulls as `fill`), without converting the rest."""
        values, bits, off = self.int_view(name)
        out = values[rows].astype(np.int64)
        if len(bits):
            out[~valid_at(bits, off, rows)] = fill
        return out

    def null_at(self, name: str, rows: np.ndarray) -> np.ndarray:
        """bool [len(rows)]: integer column `name` is null at `rows`."""
        _, bits, off = self.int_view(name)
        return ~valid_at(bits, off, rows) if len(bits) else np.zeros(len(rows), bool)

    def bad_codes(self) -> np.ndarray:
        """fused.BAD_* bits per row, from present values only (nulls are absence, not findings);
        logp_old and logp_sampler only on tokens in the loss (elsewhere: placeholders)."""
        code = np.zeros(self.n, np.uint8)
        for name in LOGPS:
            v = self.raw[name]
            if v is None:
                continue
            with np.errstate(invalid="ignore"):
                nf = ~np.isfinite(v)
                inv = (v > 0) & ~nf  # +inf is non-finite, not a probability above one (estimators.flag_invalid)
            if self.null[name] is not None:
                nf &= ~self.null[name]
            if name in LOSS_ONLY:
                nf &= self.mask
                inv &= self.mask
            code[nf] |= 1
            code[inv] |= 2
        return code

    def placeholders(self) -> np.ndarray:
        """Rows (int64, ascending) of tokens outside the loss (mask false) whose recorded logp_old
        or logp_sampler is 0.0 or non-finite: what dumps put where the engine generated nothing
        (tool output, prompt echo). No figure reads them (fused.bad_code, the masked sums)."""
        rows = np.flatnonzero(~self.mask)  # usually few: the cost follows them
        hit = np.zeros(len(rows), bool)
        for name in LOSS_ONLY:
            v, null = self.raw[name], self.null[name]
            if v is None or not len(rows):
                continue
            x = v[rows]
            with np.errstate(invalid="ignore"):
                h = (x == 0) | ~np.isfinite(x)
            hit |= h & ~null[rows] if null is not None else h
        return rows[hit]


def clip_range(clip_low: float | None, clip_high: float | None, manifest) -> tuple[float, float]:
    """(clip_low, clip_high): the config's where set, else the manifest's `clip_range`, else 0.2."""
    clip = manifest.config.get("clip_range") or [0.2, 0.2]
    if isinstance(clip, (int, float)):
        clip = [clip, clip]
    return (float(clip_low) if clip_low is not None else float(clip[0]),
            float(clip_high) if clip_high is not None else float(clip[1]))
