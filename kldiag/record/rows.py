"""Host batches to Arrow: the completion tokens of recorded micro-batches as TOKEN_SCHEMA record batches.

The recorder's writer thread (kldiag.record.writer) takes `HostBatch` objects off its queue. A
micro-batch copied plainly waits as a `Raw` batch; batches of one kind are gathered
(padding dropped, kldiag.format's columns and dtypes) into `Rows` many at once and turned
into one Arrow record batch: on micro-batches of a few hundred tokens the fixed cost of
each numpy and Arrow call, paid under the GIL beside the training thread, is the whole
cost. NaN/inf and positive log-probs are written as they are and counted (count_flags).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from kldiag import estimators as E
from kldiag import format as F
from kldiag.record import routes as RT

LOGP_COLUMNS = ("logp", "logp_old", "logp_ref", "logp_sampler")
LOSS_ONLY = ("logp_old", "logp_sampler")  # read only in the loss: elsewhere a hook or dump may hold placeholders
FLOAT_INPUTS = (*LOGP_COLUMNS, "advantage", "entropy")
GATHERED = (*((name, np.float32) for name in FLOAT_INPUTS), ("token_id", np.int32), ("mask", np.bool_),
            ("turn", np.int16))
# v1.2 top-k inputs, [B, T, K]: gathered to [n, K], written as list<...> columns (K may differ per side)
TOPK_GATHERED = (("topk_ids", np.int32), ("topk_logp", np.float32), ("topk_ids_sampler", np.int32),
                 ("topk_logp_sampler", np.float32))
# v1.3 routes (kldiag.record.routes): per-token summary [B, T]; the layer masks [B, T, L] written as lists of
# layer indices; the full lists [B, T, L * k] when asked
ROUTE_GATHERED = ((F.ROUTE_LAYERS, np.int16), (F.ROUTE_DIFFER, np.int16), (F.ROUTE_MISSING, np.int16),
                  (F.ROUTE_OVERLAP, np.float32), (F.ROUTE_MARGIN_TRAINER, np.float32),
                  (F.ROUTE_MARGIN_LAYER, np.int16))
ROUTE_LAYER_SETS = F.ROUTE_LAYER_SETS
ROUTE_LISTS = ((F.EXPERTS, np.int16), (F.EXPERTS_SAMPLER, np.int16))
# v1.3 per-sequence inputs, [B]: repeated on each sequence's tokens. `task` (strings) is gathered as int32 codes
# into Rows.labels["task"] and written as a string column (Parquet dictionary-encoded, schema.PARQUET_WRITE_OPTIONS)
VERSION_GATHERED = (("policy_version", np.int64),)
LABELS = ("task",)


@dataclass
class HostArray:
    """One column on (or on its way to) the host. kind: "plain" or "bf16" (raw uint16 bits)."""

    data: Any  # numpy array, or a pinned torch tensor filled by a non-blocking copy
    kind: str = "plain"
    release: Callable[[], None] | None = None  # hands a pooled buffer back once read

    def numpy(self) -> np.ndarray:
        a = self.data if isinstance(self.data, np.ndarray) else self.data.numpy()
        if self.kind == "bf16":
            # bfloat16 is the top half of a float32: widen the bits, no torch needed.
            return (a.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        return a


@dataclass
class HostBatch:
    """A micro-batch of [B, T] columns plus [B] row ids, as record() hands it over."""

    step: int
    micro: int
    iteration: int
    columns: dict[str, HostArray]  # [B, T]: logp..., token_id, mask, completion; [B]: seq, group
    events: list[Any] = field(default_factory=list)  # torch.cuda.Event after the copies; waited on here
    full_routes: bool = False  # v1.3: keep the [B, T, L, k] routes as lists besides their summary


@dataclass
class Raw:
    """One host batch waiting to be gathered: numpy columns ([B, T]; [B] for seq, group and
    per-row advantages) and `keep`, its completion tokens (completion_mask, else mask, else all)."""

    step: int
    micro: int
    iteration: int
    columns: dict[str, np.ndarray]
    keep: np.ndarray  # [B, T] bool
    n: int  # completion tokens

    @property
    def cells(self) -> int:
        """Padded size: what it holds in memory until gathered."""
        return self.keep.size

    @property
    def kind(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """Its columns, their ranks and top-k widths: batches of one kind are gathered together."""
        return tuple((name, (a.ndim, *a.shape[2:])) for name, a in self.columns.items())

    @classmethod
    def of(cls, batch: HostBatch, columns: dict[str, np.ndarray]) -> Raw:
        comp = columns.get("completion", columns.get("mask"))
        keep = comp.astype(bool, copy=False) if comp is not None else np.ones(columns["logp"].shape, bool)
        return cls(batch.step, batch.micro, batch.iteration, columns, keep, int(np.count_nonzero(keep)))


@dataclass
class Rows:
    """Completion tokens gathered into 1-D columns of n rows (from one or many host batches).

    `columns` holds FLOAT_INPUTS (float32), token_id (int32), mask (bool), turn (int16) and
    the TOPK_GATHERED columns ([n, K]); an absent input is None. The Arrow record batch is
    built later for many Rows at once (rows_to_record_batch).
    """

    step: np.ndarray  # [n] int64
    micro: np.ndarray  # [n] int32
    iteration: np.ndarray  # [n] int16
    seq: np.ndarray  # [n] int64
    group: np.ndarray | None  # [n] int64
    pos: np.ndarray  # [n] int32, position in the completion
    columns: dict[str, np.ndarray | None]
    labels: dict[str, np.ndarray] = field(default_factory=dict)  # LABELS: the strings behind columns' int32 codes

    @property
    def n(self) -> int:
        return len(self.pos)

    cells = n  # gathered: its memory is its rows


def host_columns(batch: HostBatch) -> dict[str, np.ndarray]:
    """{column: numpy array} of a host batch, once its device copies completed (bf16 widened)."""
    for event in batch.events:
        event.synchronize()
    batch.events = []
    return RT.summarize({name: col.numpy() for name, col in batch.columns.items()}, batch.full_routes)


def gather(raws: list[Raw]) -> Rows:
    """The completion tokens of host batches of one `kind` (same columns, same ranks), in order, as one Rows.

    Gathering many tiny micro-batches at once is a few numpy calls per column instead of
    per column and batch: each call's fixed cost, paid under the GIL beside the training
    thread, is what a micro-batch of a few hundred tokens costs. The result never shares
    memory with the inputs (pooled buffers may be released after this).
    """
    keep = _cat([r.keep.ravel() for r in raws])
    lengths = [r.keep.sum(axis=1) for r in raws]  # completion tokens per row

    def column(name: str, dtype: Any) -> np.ndarray:
        ndim = raws[0].columns[name].ndim
        if ndim == 1:  # per sequence (seq, group, advantages): one value per token
            return _cat([np.repeat(r.columns[name], k) for r, k in zip(raws, lengths, strict=True)]).astype(
                dtype, copy=False)
        if ndim == 3:  # top-k [B, T, K], route layer masks [B, T, L], full routes [B, T, L * k]: [n, K]
            width = raws[0].columns[name].shape[2]
            return _cat([r.columns[name].reshape(-1, width) for r in raws])[keep].astype(dtype, copy=False)
        return _cat([r.columns[name].ravel() for r in raws])[keep].astype(dtype, copy=False)

    counts = [r.n for r in raws]
    # Position in the completion: left padding shifts the time index, not pos.
    pos = _cat([(np.arange(r.keep.shape[1], dtype=np.int32)[None, :]
                 - np.argmax(r.keep, axis=1).astype(np.int32)[:, None]).ravel() for r in raws])[keep]
    present = raws[0].columns
    cols = {name: column(name, dtype) if name in present else None
            for name, dtype in (*GATHERED, *TOPK_GATHERED, *VERSION_GATHERED, *ROUTE_GATHERED, *ROUTE_LISTS,
                                *((m, np.bool_) for m in ROUTE_LAYER_SETS))}
    labels = {}
    for name in LABELS:
        cols[name] = None
        if name in present:  # one code per distinct label of these batches, repeated on each sequence's tokens
            labels[name], inv = np.unique(_cat([r.columns[name] for r in raws]), return_inverse=True)
            cols[name] = np.repeat(inv.reshape(-1).astype(np.int32), _cat(lengths))
    return Rows(np.repeat(np.array([r.step for r in raws], np.int64), counts),
                np.repeat(np.array([r.micro for r in raws], np.int32), counts),
                np.repeat(np.array([r.iteration for r in raws], np.int16), counts),
                column("seq", np.int64), column("group", np.int64) if "group" in present else None, pos, cols, labels)


def _cat(arrays: list[np.ndarray]) -> np.ndarray:
    return arrays[0] if len(arrays) == 1 else np.concatenate(arrays)


def gather_rows(batch: HostBatch, columns: dict[str, np.ndarray] | None = None) -> Rows:
    """The completion tokens of one host batch; releases its pooled buffers.

    `columns`: host_columns(batch) when the caller already has them.
    """
    try:
        return gather([Raw.of(batch, host_columns(batch) if columns is None else columns)])
    finally:
        for col in batch.columns.values():
            if col.release is not None:
                col.release()


def gather_pending(pending: list[Raw | Rows],
                   on_bad: Callable[[Raw, Exception], None] | None = None) -> list[Rows]:
    """Rows of the pending items: runs of consecutive Raw batches of one kind gathered at once.

    A run that fails (a batch whose values cannot take the format's dtypes) is gathered again
    batch by batch: only the bad batch is dropped, reported to `on_bad` (else raised).
    """
    out: list[Rows] = []
    run: list[Raw] = []
    for item in [*pending, None]:
        if run and (not isinstance(item, Raw) or item.kind != run[0].kind):
            out += _gather_run(run, on_bad)
            run = []
        if isinstance(item, Raw):
            run.append(item)
        elif item is not None:
            out.append(item)
    return out


def _gather_run(run: list[Raw], on_bad: Callable[[Raw, Exception], None] | None) -> list[Rows]:
    try:
        return [gather(run)]
    except Exception:
        if on_bad is None and len(run) == 1:
            raise
    out = []
    for raw in run:
        try:
            out.append(gather([raw]))
        except Exception as e:  # noqa: BLE001 - reported; the other batches go on
            if on_bad is None:
                raise
            on_bad(raw, e)
    return out


def _joined(parts: list[np.ndarray | None], sizes: list[int], dtype: Any) -> pa.Array:
    """One Arrow column from per-Rows pieces (of `sizes` rows); absent pieces are nulls."""
    present = [p for p in parts if p is not None]
    if len(present) == len(parts):
        return pa.array(present[0] if len(present) == 1 else np.concatenate(present))
    arrow = pa.from_numpy_dtype(np.dtype(dtype))
    if not present:
        return pa.nulls(sum(sizes), arrow)
    pieces = [pa.array(p) if p is not None else pa.nulls(k, arrow) for p, k in zip(parts, sizes, strict=True)]
    return pa.concat_arrays(pieces)


def _joined_lists(parts: list[np.ndarray | None], sizes: list[int], dtype: Any) -> pa.Array:
    """One list<...> column from per-Rows [n, K] pieces (K may differ between pieces); absent ones null.

    Zero-copy over the values: offsets are 0, K, 2K, ... (not fixed_size_list, which pandas
    and DuckDB read less plainly)."""
    arrow = pa.list_(pa.from_numpy_dtype(np.dtype(dtype)))
    pieces = []
    for p, k in zip(parts, sizes, strict=True):
        if p is None:
            pieces.append(pa.nulls(k, arrow))
            continue
        offsets = pa.array(np.arange(k + 1, dtype=np.int32) * p.shape[1])
        pieces.append(pa.ListArray.from_arrays(offsets, pa.array(np.ascontiguousarray(p).ravel()), type=arrow))
    return pieces[0] if len(pieces) == 1 else pa.concat_arrays(pieces)


def _layer_lists(parts: list[np.ndarray | None], sizes: list[int]) -> pa.Array:
    """One list<int16> column of the layer indices set in per-Rows bool [n, L] pieces (absent pieces: null)."""
    arrow = pa.list_(pa.int16())
    pieces = []
    for p, k in zip(parts, sizes, strict=True):
        if p is None:
            pieces.append(pa.nulls(k, arrow))
            continue
        offsets = np.zeros(k + 1, np.int32)
        np.cumsum(p.sum(1), out=offsets[1:])
        values = pa.array(np.nonzero(p)[1].astype(np.int16))
        pieces.append(pa.ListArray.from_arrays(pa.array(offsets), values, type=arrow))
    return pieces[0] if len(pieces) == 1 else pa.concat_arrays(pieces)


def _joined_labels(rows: list[Rows], name: str) -> pa.Array:
    """One string column from per-Rows int32 codes and their labels; absent pieces are nulls."""
    pieces = [pa.DictionaryArray.from_arrays(pa.array(r.columns[name]), pa.array(r.labels[name].tolist(), pa.string()))
              .cast(pa.string()) if r.columns.get(name) is not None else pa.nulls(r.n, pa.string()) for r in rows]
    return pieces[0] if len(pieces) == 1 else pa.concat_arrays(pieces)


def rows_to_record_batch(rows: list[Rows], rank: int, attempt: int = 0) -> tuple[pa.RecordBatch, int, int, int]:
    """One record batch of several gathered Rows, in order: TOKEN_SCHEMA's columns, then the
    optional v1.2/v1.3 columns (turn, top-k, policy_version, task) some of the rows have (F.part_schema),
    none otherwise.

    Returns (record batch, nonfinite rows, invalid rows, placeholder rows): see count_flags.
    Every value is written as it is.
    """
    sizes = [r.n for r in rows]
    n = sum(sizes)

    arrays: dict[str, pa.Array] = {
        "step": _joined([r.step for r in rows], sizes, np.int64),
        "micro": _joined([r.micro for r in rows], sizes, np.int32),
        "iteration": _joined([r.iteration for r in rows], sizes, np.int16),
        "rank": pa.array(np.full(n, rank, np.int16)),
        "seq": _joined([r.seq for r in rows], sizes, np.int64),
        "group": _joined([r.group for r in rows], sizes, np.int64),
        "pos": _joined([r.pos for r in rows], sizes, np.int32), "attempt": pa.array(np.full(n, attempt, np.int16)),
    }
    for name, dtype in GATHERED:
        arrays[name] = _joined([r.columns[name] for r in rows], sizes, dtype)
    for name, dtype in TOPK_GATHERED:
        pieces = [r.columns.get(name) for r in rows]
        if any(p is not None for p in pieces):
            arrays[name] = _joined_lists(pieces, sizes, dtype)
    for name, dtype in ROUTE_GATHERED:  # v1.3
        if any(r.columns.get(name) is not None for r in rows):
            arrays[name] = _joined([r.columns.get(name) for r in rows], sizes, dtype)
    for name, dtype in ROUTE_LISTS:
        if any(r.columns.get(name) is not None for r in rows):
            arrays[name] = _joined_lists([r.columns.get(name) for r in rows], sizes, dtype)
    for name in ROUTE_LAYER_SETS:  # written only when some token has such a layer
        if any(r.columns.get(name) is not None and r.columns[name].any() for r in rows):
            arrays[name] = _layer_lists([r.columns.get(name) for r in rows], sizes)
    for name, dtype in VERSION_GATHERED:
        pieces = [r.columns.get(name) for r in rows]
        if any(p is not None for p in pieces):
            arrays[name] = _joined(pieces, sizes, dtype)
    for name in LABELS:
        if any(r.columns.get(name) is not None for r in rows):
            arrays[name] = _joined_labels(rows, name)
    if arrays["mask"].null_count == n:
        arrays["mask"] = pa.array(np.ones(n, bool))  # no mask given: every completion token is in the loss
    elif arrays["mask"].null_count:
        arrays["mask"] = arrays["mask"].fill_null(True)
    present = [c for c in F.OPTIONAL_SCHEMA.names if c in arrays and arrays[c].null_count < n]
    schema = F.part_schema(present)
    rb = pa.RecordBatch.from_arrays([arrays[f.name] for f in schema], schema=schema)
    in_loss = np.concatenate([r.columns["mask"] if r.columns["mask"] is not None else np.ones(r.n, bool)
                              for r in rows]) if rows else np.zeros(0, bool)
    return (rb, *count_flags({name: arrays[name] for name in LOGP_COLUMNS}, in_loss))


def conform(batches: list[pa.RecordBatch]) -> pa.Table:
    """One table of record batches that hold different optional columns: their union
    (F.part_schema), null where a batch lacks one. Without optional columns: a v1.1 table."""
    present = {name for b in batches for name in b.schema.names}
    schema = F.part_schema([c for c in F.OPTIONAL_SCHEMA.names if c in present])
    out = []
    for b in batches:
        if b.schema.equals(schema):
            out.append(b)
            continue
        cols = [b.column(f.name) if f.name in b.schema.names else pa.nulls(b.num_rows, f.type) for f in schema]
        out.append(pa.RecordBatch.from_arrays(cols, schema=schema))
    return pa.Table.from_batches(out, schema=schema)


def count_flags(logps: dict[str, pa.Array], in_loss: np.ndarray) -> tuple[int, int, int]:
    """(rows with a NaN/inf log-prob, rows with a finite log-prob > 0, placeholder rows) over the
    present LOGP_COLUMNS (estimators.flag_nonfinite / flag_invalid), as the analysis counts them:
    logp_old and logp_sampler only in the loss (in_loss: bool [n], the mask). Outside it a row whose
    logp_old or logp_sampler is 0.0 or NaN/inf holds a placeholder (tool output the engine never
    generated). Rows outside the loss are re-read alone: the common all-in-the-loss batch pays nothing."""
    # A null (the column absent from some batches) is no log-prob: read as -1, finite and not > 0.
    xs = {name: (col.fill_null(-1.0) if col.null_count else col).to_numpy(zero_copy_only=False)
          for name, col in logps.items() if col.null_count < len(col)}
    if not xs:
        return 0, 0, 0
    nonfinite, invalid = E.flag_nonfinite(*xs.values()), E.flag_invalid(*xs.values())
    out = np.flatnonzero(~in_loss)
    loss_only = [x[out] for name, x in xs.items() if name in LOSS_ONLY]
    if not len(out) or not loss_only:
        return int(np.count_nonzero(nonfinite)), int(np.count_nonzero(invalid)), 0
    with np.errstate(invalid="ignore"):
        placeholder = np.logical_or.reduce([(x == 0) | ~np.isfinite(x) for x in loss_only])
    kept = [x[out] for name, x in xs.items() if name not in LOSS_ONLY]  # logp, at least
    nonfinite[out], invalid[out] = E.flag_nonfinite(*kept), E.flag_invalid(*kept)
    return int(np.count_nonzero(nonfinite)), int(np.count_nonzero(invalid)), int(np.count_nonzero(placeholder))


def to_record_batch(batch: HostBatch, rank: int, attempt: int = 0) -> tuple[pa.RecordBatch, int, int, int]:
    """The completion tokens of one host batch as a TOKEN_SCHEMA record batch (see rows_to_record_batch)."""
    return rows_to_record_batch([gather_rows(batch)], rank, attempt)
