"""The run's shared token sample: the tokens of every k-th step, read along in the analysis's pass
(`SampleReducer`), merged without copies and capped, and the TokenSets the mismatch modules read from it
(`Sample`, `sample_of`): the parity fits, the decomposition, the what-if replays and the crosswalk of every
face share one sample per analysis.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from kldiag.analysis.runtime import runner
from kldiag.jit import njit
from kldiag.mismatch.tokenset import (
    COLUMNS,
    FLOAT_COLUMNS,
    INT_COLUMNS,
    TokenSet,
    chunks,
    column_of,
    columns_of,
    first_iteration,
    fit_share,
    from_columns,
    group_runs,
    keep_groups,
    kept_runs,
    rows,
    thin,
)


def sample_stride(parts, max_tokens: int) -> int:
    """A power of two k such that every k-th step of `parts` is about max_tokens rows at most: the
    stride of a growing run changes only when its size doubles (each change recomputes the sample)."""
    est_rows = sum(p.size for p in parts) / 12.0  # the recorder's parts are ~12 bytes a token
    need = est_rows / max(max_tokens, 1)
    return 1 if need <= 1 else 1 << int(np.ceil(np.log2(need)))


SAMPLE_TOKENS = 4_000_000  # the bound stride aims at this many tokens (estimated from the parts' bytes)
SAMPLE_CAP = 2_000_000  # tokens the merged sample holds at most, whatever the estimate (fewer groups beyond)
# The prompt-group shares the cap steps down: 2^(-k/8). A step of 9% keeps a capped sample within 9% of the
# cap at every run length (halving the steps, as the stride does, left it anywhere in (cap / 2, cap]).
SHARE_LADDER = 2.0 ** (-np.arange(8 * 64) / 8)


RUNS = 256  # step runs a batch is cut into at most by kept_step_runs (more: a shuffled batch, masked instead)


@njit(cache=True, nogil=True)
def _ordered(step):  # pragma: no cover - compiled
    """Whether step [n] never decreases: one branch-free loop that LLVM vectorises."""
    bad = False
    for i in range(len(step) - 1):
        bad |= step[i + 1] < step[i]
    return not bad


@njit(cache=True, nogil=True)
def _run_end(step, i):  # pragma: no cover - compiled
    """In a non-decreasing step [n], the end of the run of step[i] that starts at i: galloping then bisection
    (Bentley and Yao 1976), O(log run) compares where a scan makes one per row."""
    n, s, lo, width = len(step), step[i], i, 1
    while lo + width < n and step[lo + width] == s:  # step[lo] == s; probe lo + 1, + 2, + 4...
        lo, width = lo + width, 2 * width
    hi = min(lo + width, n)  # step[hi] != s or hi == n
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if step[mid] == s:
            lo = mid
        else:
            hi = mid
    return hi


@njit(cache=True, nogil=True)
def kept_step_runs(step, every, out):  # pragma: no cover - compiled
    """Rows of the steps `step % every == 0` as runs: out[2i], out[2i + 1] = start, end of run i (adjacent
    kept steps make one run); returns the number of runs, or -1 past len(out) // 2. One pass over step [n]
    comparing each row with the one before, where numpy's step % every == 0 wrote two arrays as long; in a
    step-ordered batch (the recorder's), a run's end is found by galloping (_run_end) instead."""
    n, k, i = len(step), 0, 0
    ordered = _ordered(step)
    while i < n:
        s = step[i]
        j = _run_end(step, i) if ordered else i + 1
        while j < n and step[j] == s:
            j += 1
        if s % every == 0:
            if k > 0 and out[2 * k - 1] == i:
                out[2 * k - 1] = j
            elif 2 * k + 1 >= len(out):
                return -1
            else:
                out[2 * k], out[2 * k + 1] = i, j
                k += 1
        i = j
    return k


def _keep_every(step: np.ndarray, every: int) -> np.ndarray:
    # a power of two (sample_stride doubles it): step % every == 0 as a bit test, 5x faster
    return (step & (every - 1)) == 0 if (every & (every - 1)) == 0 else step % every == 0


@dataclass(frozen=True)
class SampleReducer:
    """The tokens of every `stride`-th step, all COLUMNS (reduce.py's protocol): one sample that the
    parity fits, the decomposition, the what-if replays and the crosswalk of every face share.

    `bind(parts)` fixes the stride from the run's size (sample_stride); the sample keeps every
    reuse iteration (the crosswalk needs them) and float log-probs as stored (float32). The merge keeps
    each part's arrays as chunks (a list per column: never a concatenated copy; the cache writes them one
    after the other) and at most `cap` rows: past it, the prompt groups of a share of them (whole groups,
    every kept step; SHARE_LADDER, the level in "share_level" [1] int64), so that a capped sample is within
    9% of `cap` whatever the run's length. A row a merge drops never comes back, so merging in any grouping
    of the parts in order keeps the same rows."""

    max_tokens: int = SAMPLE_TOKENS
    stride: int = 0  # 0: not bound yet
    name: str = "tokens"
    version: int = 3  # 3: capped by prompt groups (share_level), no longer by doubling the stride
    columns: tuple[str, ...] = tuple(COLUMNS)
    merge_every: int = 0  # chunks appended: merged once, at the end (nothing is copied)
    cap: int = SAMPLE_CAP

    def bind(self, parts) -> SampleReducer:
        return SampleReducer(self.max_tokens, sample_stride(parts, self.max_tokens), cap=self.cap)

    def settings(self) -> dict:
        return {"stride": self.stride, "cap": self.cap}

    def start(self, part) -> list:
        return []

    def add(self, state: list, batch: pa.RecordBatch) -> None:
        if not batch.num_rows:
            return
        if self.stride > 1:
            step = batch.column("step").to_numpy(zero_copy_only=False)
            bounds = np.empty(2 * RUNS, np.int64)
            k = kept_step_runs(step, self.stride, bounds)
            if k == 0:
                return
            if k < 0 or bounds[0] > 0 or bounds[1] < len(step):  # else every row is kept
                runs = bounds[:2 * k].reshape(-1, 2).tolist() if k > 0 else kept_runs(_keep_every(step, self.stride))
                state.append(kept_columns(batch, runs))
                return
        state.append(columns_of(batch))

    def finish(self, state: list, dropped: int) -> dict[str, np.ndarray]:
        """The part's rows, a chunk per batch (merge and the cache take chunks: never concatenated)."""
        if not state:
            return empty_columns()
        out = state[0] if len(state) == 1 else {c: [p[c] for p in state] for c in state[0]}
        return {**out, "stride": np.array([max(self.stride, 1)], np.int64)}

    def merge(self, partials) -> dict:
        """The partials' chunks in order: the rows of every `stride`-th step whose prompt group's hash is
        under SHARE_LADDER[level], level the smallest (no lower than any partial's) that leaves at most
        `cap` rows. A row a merge drops never comes back (a higher level keeps a subset), so merging in any
        grouping of the parts in order keeps the same rows."""
        partials = [p for p in partials if rows(p)]
        if not partials:
            return empty_columns()
        every = max(int(p["stride"][0]) if "stride" in p else max(self.stride, 1) for p in partials)
        level = max(int(p["share_level"][0]) if "share_level" in p else 0 for p in partials)
        names = [c for c in partials[0] if c not in ("stride", "share_level")]
        cols = {c: [v for p in partials for v in chunks(p[c])] for c in names}
        keep = [_keep_every(c, every) for c in cols["step"]]
        # a partial capped at a level makes the others' rows go by it too, under the cap or not: else the
        # rows kept would depend on how the parts were grouped
        if level > 0 or sum(int(np.count_nonzero(k)) for k in keep) > self.cap:
            keep, level = _capped(cols, keep, level, self.cap)
        out = {c: [v if k.all() else v[k] for v, k in zip(vs, keep, strict=True) if k.any()] for c, vs in cols.items()}
        tail = {"stride": np.array([every], np.int64), "share_level": np.array([level], np.int64)}
        return {**empty_columns(), **tail} if not out["step"] else {**out, **tail}

    def length(self, partial) -> int:
        """A partial's rows (runner.Accumulator records each part's, for slice_rows)."""
        return rows(partial)

    def slice_rows(self, merged, start: int, stop: int) -> dict | None:
        """merge() of the partials whose rows are merged's start:stop: those rows (views of its chunks) when
        merged is their plain concatenation (share_level 0); None once capped (merged lacks the rows the cap
        dropped, which a merge of other parts may keep: side_prefix.cut) or past its rows."""
        if int(merged["share_level"][0]) if "share_level" in merged else 0:
            return None
        if not 0 <= start <= stop <= rows(merged):
            return None
        if start == stop:
            return empty_columns()
        out = {c: _between(v, start, stop) for c, v in merged.items() if c not in ("stride", "share_level")}
        return {**out, "stride": merged["stride"], "share_level": np.zeros(1, np.int64)}


def _between(v, start: int, stop: int) -> list[np.ndarray]:
    """Rows start:stop of a column (an array or a list of chunks), as views of its chunks."""
    out, at = [], 0
    for c in chunks(v):
        a, b = max(start - at, 0), min(stop - at, len(c))
        if a < b:
            out.append(c[a:b])
        at += len(c)
    return out


def _capped(cols: dict, keep: list[np.ndarray], level: int, cap: int) -> tuple[list[np.ndarray], int]:
    """(keep masks, level): the kept rows under SHARE_LADDER[level'] of their group's hash, level' >= level
    the smallest with at most cap rows. Each group run's hash is compared with the ladder once: the number
    of ladder entries above it is the first level that drops it."""
    runs = []
    for k, g, q in zip(keep, cols["group"], cols["seq"], strict=True):
        u, lengths = group_runs(np.asarray(g)[k], np.asarray(q)[k])
        runs.append((len(SHARE_LADDER) - np.searchsorted(SHARE_LADDER[::-1], u, side="right"), lengths))
    counts = np.zeros(len(SHARE_LADDER) + 1, np.int64)
    for drop, lengths in runs:
        counts += np.bincount(drop, weights=lengths, minlength=len(counts)).astype(np.int64)
    kept_at = counts[::-1].cumsum()[::-1][1:]  # rows kept at each level: those dropped later
    level = max(level, int(np.argmax(kept_at <= cap)) if (kept_at <= cap).any() else len(SHARE_LADDER) - 1)
    out = []
    for k, (drop, lengths) in zip(keep, runs, strict=True):
        k = k.copy()
        k[k] = np.repeat(drop > level, lengths)
        out.append(k)
    return out, level


def _and_groups(keep: np.ndarray, group: np.ndarray, seq: np.ndarray, share: float, step: np.ndarray) -> np.ndarray:
    """keep & keep_groups(group, seq, share, step), hashing only the rows keep holds (a thinned sample's few):
    every step of the rows kept keeps a group."""
    if keep.all():
        return keep_groups(group, seq, share, step)
    out = keep.copy()
    out[keep] = keep_groups(np.asarray(group)[keep], np.asarray(seq)[keep], share, np.asarray(step)[keep])
    return out


def kept_columns(batch: pa.RecordBatch, sel) -> dict[str, np.ndarray]:
    """columns_of the rows of `batch` that `sel` (kept_runs': (start, end) runs or row indices) keeps. Whole
    steps of a step-ordered batch are a few runs of rows, taken as slices, not with Arrow's filter of every
    column: a column without nulls is copied once from its zero-copy view, run after run (its own array:
    no view holds every row of the batch alive); one with nulls goes through columns_of on the slices."""
    if not isinstance(sel, list):
        return columns_of(batch.take(pa.array(sel, pa.int64())))
    table = None
    out = {}
    for c in (*INT_COLUMNS, *FLOAT_COLUMNS, "mask", "old_valid"):
        src = batch.column("logp_old" if c == "old_valid" else c)
        if c == "old_valid" and not src.null_count:
            out[c] = np.ones(sum(b - a for a, b in sel), bool)
        elif not src.null_count and c != "old_valid":
            v = _bits(src) if c == "mask" else src.to_numpy(zero_copy_only=False)
            out[c] = np.concatenate([v[a:b] for a, b in sel])
        else:
            if table is None:
                table = pa.Table.from_batches([batch.slice(a, b - a) for a, b in sel], batch.schema)
            v = column_of(table, c)
            out[c] = v.copy() if v.base is not None else v
    return out


def _bits(col: pa.Array) -> np.ndarray:
    """A bool column without nulls as numpy: Arrow's bitmap unpacked (about 15x its to_numpy)."""
    bits = np.frombuffer(col.buffers()[1], np.uint8)
    return np.unpackbits(bits, count=col.offset + len(col), bitorder="little")[col.offset:].view(bool)


def empty_columns() -> dict[str, np.ndarray]:
    out = {c: np.zeros(0, np.int64) for c in INT_COLUMNS}
    out.update({c: np.zeros(0, np.float32) for c in FLOAT_COLUMNS})
    out.update(mask=np.zeros(0, bool), old_valid=np.zeros(0, bool))
    return out


class Sample:
    """The merged sample of a run (columns as arrays or chunk lists), with its TokenSets made on first use
    (first iterations or all).

    A TokenSet is kept only while a face holds it (weakly: the Mismatch page's view, a parity fit in
    progress), so that a refresh's new analysis reuses the freed memory instead of touching new pages."""

    def __init__(self, cols: dict, stride: int, meta: dict | None = None):
        if "stride" in cols:  # the stride the merge kept
            stride = max(stride, int(np.asarray(cols["stride"]).reshape(-1)[0]))
        level = int(np.asarray(cols["share_level"]).reshape(-1)[0]) if "share_level" in cols else 0
        cols = {c: v for c, v in cols.items() if c not in ("stride", "share_level")}
        self.cols, self.stride, self.meta = cols, stride, dict(meta or {})
        self.share = float(SHARE_LADDER[level])  # the prompt groups the cap kept: group_runs hash < share
        self._sets: weakref.WeakValueDictionary[bool, TokenSet] = weakref.WeakValueDictionary()
        self._thin: dict[tuple[bool, int], TokenSet] = {}  # at most max_tokens tokens each: kept

    def __len__(self) -> int:
        return rows(self.cols)

    def tokens(self, all_iterations: bool = False) -> TokenSet:
        key = all_iterations and self.reused()  # without reuse iterations both sets are the same tokens
        ts = self._sets.get(key)
        if ts is None:
            ts = from_columns(self.cols, key, self.stride, lazy=True)  # an array copied when first read
            ts.meta, ts.group_share = dict(self.meta), self.share
            self._sets[key] = ts
        return ts

    def reused(self) -> bool:
        """Whether a sequence of the sample has a second reuse iteration (else both TokenSets are one)."""
        its = [c for c in chunks(self.cols.get("iteration", [])) if len(c)]
        return bool(its) and min(int(c.min()) for c in its) != max(int(c.max()) for c in its)

    def thinned(self, max_tokens: int, all_iterations: bool = False, fit_tokens: int = 0) -> TokenSet:
        """thin(self.tokens(all_iterations), max_tokens), made from the kept steps' rows only: the float64
        TokenSet of the whole sample (its copies) is not built when only a thinned one is read. With
        `fit_tokens`, past that many rows only the rows of a share of the prompt groups (keep_groups) that
        leaves about fit_tokens: every kept step stays, with fewer of its groups."""
        key = (all_iterations, max_tokens, fit_tokens)
        if key not in self._thin:
            self._thin[key] = self._thinned(max_tokens, all_iterations, fit_tokens)
        return self._thin[key]

    def _first(self) -> list[np.ndarray] | None:
        """Per chunk, its rows that are their sequence's first iteration (None: every row is)."""
        if not self.reused():
            return None
        seq = np.concatenate([np.asarray(c, np.int64) for c in chunks(self.cols["seq"])])
        idx = first_iteration(seq, np.concatenate([np.asarray(c, np.int64) for c in chunks(self.cols["iteration"])]))
        first = np.zeros(len(seq), bool)
        first[idx] = True
        cut = np.cumsum([len(c) for c in chunks(self.cols["seq"])])[:-1]
        return np.split(first, cut)

    def _thinned(self, max_tokens: int, all_iterations: bool, fit_tokens: int = 0) -> TokenSet:
        whole = self._sets.get(all_iterations and self.reused())
        if whole is not None:
            return fit_share(thin(whole, max_tokens), fit_tokens)
        first = None if all_iterations else self._first()
        n = len(self) if first is None else int(sum(int(f.sum()) for f in first))
        k = 1 << int(np.ceil(np.log2(n / max(max_tokens, 1)))) if n > max_tokens else 1
        # thin's steps; rows keep their order, so from_columns sorts alike
        keep = [_keep_every(c, self.stride * k) for c in chunks(self.cols["step"])]
        if first is not None:  # the first iterations among the whole sample's, as from_columns finds them
            keep = [a & b for a, b in zip(keep, first, strict=True)]
        kept = int(sum(int(c.sum()) for c in keep))
        share = self.share
        if fit_tokens and kept > fit_tokens:
            share *= fit_tokens / kept  # of every group: the sample holds those under its own share
            keep = [_and_groups(c, g, q, share, st) for c, g, q, st in zip(
                keep, chunks(self.cols["group"]), chunks(self.cols["seq"]), chunks(self.cols["step"]), strict=True)]
        elif k == 1:
            return self.tokens(all_iterations)
        ts = from_columns(self.cols, True, self.stride * k, keep, lazy=True)
        ts.meta, ts.group_share = dict(self.meta), share
        return ts

    def has_values(self, column: str) -> bool:
        """Whether the sample holds a non-null value of `column` (a log-prob or the entropy); for
        logp_sampler and logp_old, on a token in the loss (elsewhere a dump may hold placeholders)."""
        v = self.cols.get(column)
        if v is None:
            return False
        for c, m in zip(chunks(v), chunks(self.cols["mask"]), strict=True):
            ok = np.isfinite(c)
            if bool((ok & m).any() if column in ("logp_sampler", "logp_old") else ok.any()):
                return True
        return False


def sample_of(analysis, max_tokens: int = SAMPLE_TOKENS) -> Sample:
    """The analysed run's shared token sample: the one its analysis read along (Analysis.reduced),
    else one more read of the parts that lack a cached sample partial; kept in `analysis.memo`."""
    memo = getattr(analysis, "memo", None)
    red = memo.get(("reducer", SampleReducer.name)) if memo is not None else None  # the one read along: bound
    if not (isinstance(red, SampleReducer) and red.max_tokens == max_tokens and red.stride > 0):
        red = None
    elif ("sample", red) in memo:  # one Sample per analysis: its TokenSets are made once for every face
        return memo[("sample", red)]
    run, parts = runner.parts_of(analysis)
    meta = {"run": str(getattr(run, "uri", run)), "manifest_config": dict(run.manifest.config or {}),
            "trainer": dict(run.manifest.trainer or {})}
    red = red or SampleReducer(max_tokens).bind(parts)
    key = ("sample", red)
    if memo is not None and key in memo:
        return memo[key]
    cols = runner.reduced(analysis, red)
    if rows(cols) > red.cap:  # one part's partial is the result as it was read: capped here
        cols = red.merge([cols])
    sample = Sample(cols, red.stride, meta)
    if memo is not None:
        memo[key] = sample
    return sample
