"""The recorded tokens as float64 arrays, for the mismatch modules (parity, what-if, decomposition, crosswalk).

`load(run)` reads the columns these modules need through the public reader (superseded rows
left out), keeps each sequence's first reuse iteration (a step's batch is its sequences, each
counted once) unless `all_iterations`, and sorts by (step, seq, pos).
Nulls become NaN; `has_old` says where logp_old was recorded (null: on-policy, pi_old = pi_theta).
logp_sampler is NaN outside the loss (mask false: tool output, prompt echo, which the engine never
generated): whatever a dump stored there (0.0, NaN) never enters a parity fit or mismatch figure.
Memory: ~100 bytes a token; `max_tokens` keeps every k-th step of a larger run (`step_stride`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kldiag.format import open_run
from kldiag.format.schema import TOKEN_SCHEMA

COLUMNS = ["step", "micro", "iteration", "rank", "seq", "group", "pos", "token_id", "logp", "logp_old",
           "logp_ref", "logp_sampler", "advantage", "mask", "entropy"]
MAX_TOKENS = 20_000_000
SCALAR_FIELDS = ("step_stride", "meta", "group_share")


@dataclass
class TokenSet:
    """Per-token arrays [N], sorted by (step, seq, pos). Log-probs float64, NaN where null."""

    step: np.ndarray
    seq: np.ndarray
    group: np.ndarray  # int64, -1 where null
    pos: np.ndarray
    token_id: np.ndarray  # int64, -1 where null
    iteration: np.ndarray
    micro: np.ndarray
    rank: np.ndarray
    logp: np.ndarray
    logp_old: np.ndarray  # logp where null (on-policy)
    logp_ref: np.ndarray
    logp_sampler: np.ndarray  # NaN where null and outside the loss (mask false)
    advantage: np.ndarray
    mask: np.ndarray  # bool
    entropy: np.ndarray
    has_old: np.ndarray  # bool: logp_old was recorded
    step_stride: int = 1  # 1: every step; k: every k-th step of the run was kept
    meta: dict = field(default_factory=dict)
    group_share: float = 1.0  # < 1: only the prompt groups whose group_runs hash < group_share were kept

    def __len__(self) -> int:
        return len(self.step)

    def take(self, idx: np.ndarray) -> TokenSet:
        arrays = {f.name: getattr(self, f.name)[idx] for f in fields(self) if f.name not in SCALAR_FIELDS}
        return TokenSet(**arrays, step_stride=self.step_stride, meta=dict(self.meta), group_share=self.group_share)

    def steps(self) -> np.ndarray:
        return np.unique(self.step)

    def step_slices(self) -> list[tuple[int, slice]]:
        """(step, slice into the arrays) for each step, in order (the arrays are step-sorted)."""
        if not len(self.step):
            return []
        cut = np.flatnonzero(np.diff(self.step)) + 1
        starts = np.r_[0, cut]
        ends = np.r_[cut, len(self.step)]
        return [(int(self.step[a]), slice(int(a), int(b))) for a, b in zip(starts, ends, strict=True)]

    @property
    def has_sampler(self) -> bool:
        return bool(np.isfinite(self.logp_sampler).any())

    @property
    def has_ref(self) -> bool:
        return bool(np.isfinite(self.logp_ref).any())


def _i64(t: pa.Table, name: str, null: int = -1) -> np.ndarray:
    return pc.fill_null(t.column(name), null).to_numpy(zero_copy_only=False).astype(np.int64)


def _fill(b: pa.RecordBatch) -> pa.RecordBatch:
    """The batch with every COLUMNS column, absent ones null (mask: true)."""
    n = b.num_rows
    arrays = [b.column(c) if c in b.schema.names else
              (pa.array(np.ones(n, bool)) if c == "mask" else pa.nulls(n, TOKEN_SCHEMA.field(c).type)) for c in COLUMNS]
    return pa.RecordBatch.from_arrays(arrays, schema=pa.schema([TOKEN_SCHEMA.field(c) for c in COLUMNS]))


def first_iteration(seq: np.ndarray, it: np.ndarray) -> np.ndarray | None:
    """Row indices of each sequence's first iteration (None: every row is its first, no reuse)."""
    if not len(it) or it.min() == it.max():
        return None
    uniq, inv = np.unique(seq, return_inverse=True)
    first = np.full(len(uniq), np.iinfo(np.int64).max)
    np.minimum.at(first, inv, it)
    return np.flatnonzero(it == first[inv])


def unique_inverse(key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """np.unique(key, return_inverse=True) (inverse flat), without its sort when key is already
    sorted (a TokenSet's step, or its (step, seq) key): one pass instead of an O(N log N) sort."""
    key = np.asarray(key).reshape(-1)
    if len(key) < 2 or not bool(np.all(key[1:] >= key[:-1])):
        uniq, inv = np.unique(key, return_inverse=True)
        return uniq, inv.reshape(-1)
    new = np.empty(len(key), bool)
    new[0] = True
    np.not_equal(key[1:], key[:-1], out=new[1:])
    return key[new], np.cumsum(new, dtype=np.int64) - 1


def dense_inverse(key: np.ndarray) -> np.ndarray:
    """np.unique(key, return_inverse=True)[1] (flat) of an integer key, without its sort when the key's
    range is at most a few times its length or 2M (sequence ids, steps): a table of the values present, ranked."""
    key = np.asarray(key).reshape(-1)
    if not len(key) or key.dtype.kind not in "iu":
        return np.unique(key, return_inverse=True)[1].reshape(-1)
    lo, hi = int(key.min()), int(key.max())
    if hi - lo > max(8 * len(key), 1 << 21):
        return np.unique(key, return_inverse=True)[1].reshape(-1)
    present = np.zeros(hi - lo + 1, bool)
    present[key - lo] = True
    return (np.cumsum(present) - 1)[key - lo]


SORT_BLOCK = 1 << 16  # rows a block of _sorted's check


def _sorted(step: np.ndarray, seq: np.ndarray, pos: np.ndarray) -> bool:
    # numpy, not a compiled loop: the Overview's diagnosis makes a TokenSet, and the first compiled
    # function a process calls costs 0.1-0.2 s to load. Block by block: no [N] differences and masks
    # (a 2M-token sample's would be 60 MB of fresh pages, three times the check's own cost)
    for a in range(0, len(step) - 1, SORT_BLOCK):
        b = min(a + SORT_BLOCK, len(step) - 1)
        ds, dq, dp = (v[a + 1:b + 1] - v[a:b] for v in (step, seq, pos))
        if not bool(np.all((ds > 0) | ((ds == 0) & ((dq > 0) | ((dq == 0) & (dp > 0)))))):
            return False
    return True


INT_COLUMNS = ("step", "seq", "group", "pos", "token_id", "iteration", "micro", "rank")
FLOAT_COLUMNS = ("logp", "logp_old", "logp_ref", "logp_sampler", "advantage", "entropy")


def columns_of(t: pa.Table | pa.RecordBatch) -> dict[str, np.ndarray]:
    """The COLUMNS of a table as compact arrays: ints (-1 where null), floats as stored (NaN where
    null), mask (false where null) and old_valid (logp_old recorded)."""
    return {c: column_of(t, c) for c in (*INT_COLUMNS, *FLOAT_COLUMNS, "mask", "old_valid")}


def column_of(t: pa.Table | pa.RecordBatch, c: str) -> np.ndarray:
    """One of columns_of's arrays."""
    if c == "mask":
        return pc.fill_null(t.column("mask"), False).to_numpy(zero_copy_only=False).astype(bool)
    if c == "old_valid":
        return t.column("logp_old").is_valid().to_numpy(zero_copy_only=False)
    if c in FLOAT_COLUMNS:
        return t.column(c).to_numpy(zero_copy_only=False)
    return pc.fill_null(t.column(c), -1).to_numpy(zero_copy_only=False)


def chunks(v) -> list[np.ndarray]:
    """A sample column as its list of chunks (a merged sample keeps each part's arrays, never concatenated)."""
    return v if isinstance(v, list) else [v]


def rows(cols: dict) -> int:
    """Rows of columns_of's arrays or of a merged sample's chunks."""
    return sum(len(c) for c in chunks(cols["step"]))


def kept_runs(keep: np.ndarray | None):
    """What to copy of a chunk: None (all of it), a list of (start, end) runs when the kept rows come in
    few runs (whole steps of a step-ordered part: slice copies), else their indices."""
    if keep is None or keep.all():
        return None
    edge = np.flatnonzero(keep[1:] != keep[:-1]) + 1
    bounds = np.r_[0, edge, len(keep)]
    runs = [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]) if keep[a]]
    return runs if len(runs) * 64 < len(keep) else np.flatnonzero(keep)


def _gather(col, sels: list, n: int, dtype, copy: bool = False) -> np.ndarray:
    """The selected rows of a column's chunks, in order, as `dtype`: the column itself when it is one chunk
    of that dtype, all of it taken and not `copy` (as np.asarray; a sample's int64 ids are not copied), else
    a new array (one copy, cast in place)."""
    parts = chunks(col)
    if len(parts) == 1 and sels[0] is None and parts[0].dtype == dtype and not copy:
        return parts[0]
    out, at = np.empty(n, dtype), 0
    for v, sel in zip(chunks(col), sels, strict=True):
        if sel is None:
            out[at:at + len(v)] = v
            at += len(v)
        elif isinstance(sel, list):
            for a, b in sel:
                out[at:at + b - a] = v[a:b]
                at += b - a
        else:
            out[at:at + len(sel)] = v[sel]
            at += len(sel)
    return out


def _selection(cols: dict, keep: list | None) -> tuple[list, int]:
    """(kept_runs of each chunk's keep mask, rows kept); keep None: every row."""
    if keep is None:
        return [None] * len(chunks(cols["step"])), rows(cols)
    return [kept_runs(k) for k in keep], int(sum(int(k.sum()) for k in keep))


class GatheredTokenSet(TokenSet):
    """A TokenSet (from_columns) whose arrays are gathered from the columns when first read: step, seq and
    pos (its order) at once, each other array on its first use. The Mismatch page's view, what-if and
    crosswalk read 13 of the 16 arrays: group, token_id and rank of a 2M-token sample (16 MB each) are never
    copied. Equal to the eager set array for array (`take`, ==, repr read them all); its `__dict__` holds only
    the arrays read so far."""

    def __init__(self, make: dict, step: np.ndarray, seq: np.ndarray, pos: np.ndarray, step_stride: int):
        self.__dict__.update(step=step, seq=seq, pos=pos, step_stride=step_stride, meta={}, group_share=1.0)
        self.__dict__["_make"] = make  # name -> fn(self): the array, gathered in this set's rows and order

    def __getattr__(self, name: str):
        make = self.__dict__.get("_make")  # only names missing from the instance land here
        if make is None or name not in make:
            raise AttributeError(name)
        with _GATHER_LOCK:  # a page's sessions share one set: one gather per array
            if name not in self.__dict__:
                self.__dict__[name] = make[name](self)
        return self.__dict__[name]

    def __reduce__(self):  # pickled and copied as the plain TokenSet it equals (its gathers are closures)
        return _plain, ({f.name: getattr(self, f.name) for f in fields(TokenSet)},)


def _plain(arrays: dict) -> TokenSet:
    return TokenSet(**arrays)


_GATHER_LOCK = threading.RLock()  # reentrant: logp_old's gather reads logp and has_old


def _varies(col) -> bool:
    """Whether a column's chunks hold two different values (a sample without reuse iterations: no)."""
    parts = [c for c in chunks(col) if len(c)]
    return bool(parts) and min(int(c.min()) for c in parts) != max(int(c.max()) for c in parts)


def from_columns(cols: dict, all_iterations: bool = False, step_stride: int = 1,
                 keep: list | None = None, lazy: bool = False) -> TokenSet:
    """A TokenSet from columns_of's arrays (of one table, or a merged sample's chunks); `keep`: a bool mask
    per chunk of the rows to take (all when None). An array already of the TokenSet's dtype may be the
    caller's (as np.asarray leaves it); the two it writes (logp_old, logp_sampler) never are. `lazy`: each
    array but step, seq and pos gathered when first read (GatheredTokenSet; the token sample's sets), so
    `cols` must not change meanwhile (a sample's arrays never do); else all of them now, a plain TokenSet."""
    sels, n = _selection(cols, keep)
    step, seq, pos = (_gather(cols[c], sels, n, np.int64) for c in ("step", "seq", "pos"))
    idx = None
    if not all_iterations and _varies(cols["iteration"]):
        idx = first_iteration(seq, _gather(cols["iteration"], sels, n, np.int64))
    if idx is not None:
        step, seq, pos = step[idx], seq[idx], pos[idx]
    order = None if _sorted(step, seq, pos) else np.lexsort((pos, seq, step))
    if order is not None:
        step, seq, pos = step[order], seq[order], pos[order]

    def rows_of(c: str, dtype, copy: bool = False) -> np.ndarray:
        v = _gather(cols[c], sels, n, dtype, copy)
        v = v if idx is None else v[idx]
        return v if order is None else v[order]

    def logp_old(ts: TokenSet) -> np.ndarray:  # written: never the caller's array
        v = rows_of("logp_old", np.float64, True)
        np.copyto(v, ts.logp, where=~ts.has_old)
        return v

    def logp_sampler(ts: TokenSet) -> np.ndarray:
        v = rows_of("logp_sampler", np.float64, True)
        np.copyto(v, np.nan, where=~ts.mask)  # mu exists only where it sampled
        return v

    make = {c: (lambda ts, c=c: rows_of(c, np.int64)) for c in INT_COLUMNS if c not in ("step", "seq", "pos")}
    make.update({c: (lambda ts, c=c: rows_of(c, np.float64)) for c in FLOAT_COLUMNS})
    make.update(logp_old=logp_old, logp_sampler=logp_sampler, mask=lambda ts: rows_of("mask", bool),
                has_old=lambda ts: rows_of("old_valid", bool))
    ts = GatheredTokenSet(make, step, seq, pos, step_stride)
    if lazy:
        return ts
    return TokenSet(**{f.name: getattr(ts, f.name) for f in fields(TokenSet)})


def from_table(t: pa.Table, all_iterations: bool = False, step_stride: int = 1) -> TokenSet:
    """A TokenSet from a table in the run schema (tests build one directly)."""
    return from_columns(columns_of(t), all_iterations, step_stride)


def stride_for(run, max_tokens: int) -> int:
    """Keep every k-th step so that about max_tokens rows are read (estimated from part sizes)."""
    parts = run.parts()
    total_bytes = sum(p.size for p in parts)
    est_rows = total_bytes / 12.0  # the recorder's parts are ~12 bytes a token (docs/recorder.md)
    return max(1, int(np.ceil(est_rows / max(max_tokens, 1))))


def thin(ts: TokenSet, max_tokens: int) -> TokenSet:
    """ts cut to about max_tokens by keeping every k-th of its steps (k a power of two: the steps a
    step % (stride * k) == 0 keeps stay the same as the run grows)."""
    if len(ts) <= max_tokens:
        return ts
    k = 1 << int(np.ceil(np.log2(len(ts) / max(max_tokens, 1))))
    out = ts.take(np.flatnonzero(ts.step % (ts.step_stride * k) == 0))
    out.step_stride = ts.step_stride * k
    return out


def fit_share(ts: TokenSet, fit_tokens: int) -> TokenSet:
    """ts cut to about fit_tokens rows by whole prompt groups (keep_groups), every step kept; ts itself
    when it is no larger (fit_tokens 0: no bound)."""
    if not fit_tokens or len(ts) <= fit_tokens:
        return ts
    share = ts.group_share * fit_tokens / len(ts)  # of every group: ts holds those under its own share
    out = ts.take(np.flatnonzero(keep_groups(ts.group, ts.seq, share, ts.step)))
    out.group_share = share
    return out


def load(run, all_iterations: bool = False, max_tokens: int = MAX_TOKENS,
         steps: tuple[int, int] | None = None, columns: tuple[str, ...] | None = None) -> TokenSet:
    """The run's tokens (a kldiag.format Run, a path or a URI). steps=(first, last) limits the range;
    `columns` reads only those (the others come back null: NaN, -1, mask true)."""
    if not hasattr(run, "iter_batches"):
        run = open_run(run)
    stride = stride_for(run, max_tokens)
    batches = []
    read = [c for c in COLUMNS if columns is None or c in columns or c in ("step", "seq", "pos", "iteration")]
    for b in run.iter_batches(read):
        if len(read) < len(COLUMNS):
            b = _fill(b)
        step = b.column("step")
        keep = None
        if stride > 1:
            keep = pa.array(step.to_numpy(zero_copy_only=False) % stride == 0)
        if steps is not None:
            rng = pc.and_(pc.greater_equal(step, steps[0]), pc.less_equal(step, steps[1]))
            keep = rng if keep is None else pc.and_(keep, rng)
        batches.append(b if keep is None else b.filter(keep))
    schema = pa.schema([TOKEN_SCHEMA.field(c) for c in COLUMNS])
    table = pa.Table.from_batches(batches, schema=schema) if batches else schema.empty_table()
    ts = from_table(table, all_iterations, stride)
    ts.meta = {"run": str(getattr(run, "uri", run)), "manifest_config": dict(getattr(run.manifest, "config", {}) or {}),
               "trainer": dict(getattr(run.manifest, "trainer", {}) or {})}
    return ts


def group_runs(group: np.ndarray, seq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(u, lengths): the runs of rows of one prompt group id (a sequence without a group id is its own
    group; a sequence's rows are consecutive), u float64 [runs] in [0, 1) a hash of the run's id (splitmix64's
    finaliser, its top 53 bits), lengths int64 [runs]. Rows whose u < share are about `share` of the groups,
    and lowering share only drops groups (keep_groups, the token sample's cap)."""
    group = np.asarray(group)
    key = np.where(group >= 0, group, ~np.asarray(seq, np.int64))
    if not len(key):
        return np.zeros(0), np.zeros(0, np.int64)
    new = np.empty(len(key), bool)
    new[0] = True
    np.not_equal(key[1:], key[:-1], out=new[1:])
    starts = np.flatnonzero(new)
    with np.errstate(over="ignore"):  # wrapping uint64 arithmetic
        z = (key[starts].astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    u = (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))  # 53 bits: exact in float64
    return u, np.diff(np.append(starts, len(key)))


def keep_groups(group: np.ndarray, seq: np.ndarray, share: float, step: np.ndarray | None = None) -> np.ndarray:
    """bool [N]: the rows of about `share` of the prompt groups (group_runs hash < share), chosen by a hash of
    the id alone: whole groups (the contexts a within-context fit needs), the same prompts at every step
    (the contexts a lag scan matches across steps), the same choice on every call. With `step` (the rows'
    steps), every step keeps at least its group of the smallest hash: a run of few groups a step
    (two of eight completions each) would otherwise lose whole steps, and a cause present from the first step
    would be named from the first step kept."""
    u, lengths = group_runs(group, seq)
    keep = u < min(max(share, 0.0), 1.0)
    if step is not None and len(u):
        run_step = np.asarray(step)[np.cumsum(lengths) - lengths]
        order = np.lexsort((u, run_step))  # by step, then hash: the first run of each step has its smallest
        first = order[np.r_[True, run_step[order][1:] != run_step[order][:-1]]]
        keep[first] = True
    return np.repeat(keep, lengths)
