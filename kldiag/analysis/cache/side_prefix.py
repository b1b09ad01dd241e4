"""Merged-prefix cache of the reducers that ride along with the analysis (the dashboard's, the diagnosis's).

Without it a warm read loads one cached partial per part and reducer and merges them all again: it
grows with the run (530 parts at 300M rows, seven reducers). This cache keeps, per reducer, the state
of its in-order merge (runner.Accumulator) after parts[0:k], so a warm read loads one file per reducer
and only the partials of the parts listed after k.

The state is exactly what the cold merge holds after k partials: `acc`, the merge of the first
k // every * every of them, and `buf`, the others, unmerged (`every`: the reducer's merge_every). Going
on from it with the partials of the later parts runs the same merges on the same inputs in the same
order as a cold merge of every part, so the result equals it bit for bit, whatever the reducer's merge
is (a merge need not be associative: the estimators' token sample is re-drawn at each merge, and
numpy's reduceat sums pairwise). A reducer that merges once at the end (every = 0) declares its merge a
concatenation in part order (runner.Accumulator), so its buffer is kept merged: one partial.

Like the analysis's prefix (prefix.py), the state is used only when the listing starts with exactly
its k part keys (a restart or a rewritten part invalidates it), never covers a part that was unreadable,
and is rewritten once PREFIX_TAIL parts follow it. Beside the state, `result` holds the merged partial
of parts[0:k] when the pass that wrote it read exactly those parts: a warm read of an unchanged run
loads that one file and merges nothing.

A concatenation whose reducer can cut its merge (`slice_rows(merged, start, stop)`: the merge of the
partials whose rows are merged's start:stop, None when it cannot say, the token sample once capped)
records each part's rows and key: a state whose listing no longer matches from part j on (a restart's
superseded steps, a rewritten, removed or inserted part) is cut back to parts[0:j], a slice of its one
partial, and the later parts it holds that are still listed are handed out as slices too (`State.spare`):
only the parts it does not hold are read again. The runner then writes such a reducer's per-part
partials only for the parts no state covers (runner.Accumulator.hold): the sample is in the cache once.

Files: CACHE/reducers/<namespace>.json (k, digest of the k keys, whether a result was written, or
"state" when the state's one partial is the result: a concatenation's; a concatenation's "rows" and
"keys", a digest of each part's key) and
CACHE/reducers/<namespace>-<digest>.state / .result (reduce.save_arrays's layout); the namespace is
a digest of the reducer's name, version and settings.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kldiag.analysis import protocol as reduce
from kldiag.analysis.cache.prefix import PREFIX_TAIL, digest
from kldiag.analysis.protocol import Arrays, Reducer
from kldiag.format import PartInfo

REDUCER_PREFIX_VERSION = 2  # 2: a concatenation's state records each part's rows and key (cut back, not dropped)
FOLDER = "reducers"


@dataclass
class State:
    """A reducer's in-order merge after parts[0:k]: `acc` (None before the first merge) and `buf`."""

    k: int
    acc: Arrays | None
    buf: list[Arrays]
    result: Arrays | None = None  # merge([acc, *buf]) when it was written with the state
    rows: list[int] | None = None  # a concatenation's: each part's rows in buf[0], parts[0:k] in order
    spare: dict[str, Arrays] | None = None  # a cut state's: part digest -> that later part's partial, from it


def namespace(r: Reducer) -> str:
    text = json.dumps([REDUCER_PREFIX_VERSION, r.name, r.version, r.settings()], sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:20]


def to_arrays(acc: Arrays | None, buf: Sequence[Arrays]) -> Arrays:
    """acc's arrays as "a:<name>", buf[j]'s as "b<j>:<name>" (one file; a partial's names may hold '/')."""
    out = {f"a:{n}": v for n, v in (acc or {}).items()}
    for j, p in enumerate(buf):
        out.update({f"b{j}:{n}": v for n, v in p.items()})
    return out


def from_arrays(raw: Arrays, has_acc: bool, n_buf: int) -> tuple[Arrays | None, list[Arrays]]:
    acc: Arrays | None = {} if has_acc else None
    buf: list[Arrays] = [{} for _ in range(n_buf)]
    for key, v in raw.items():
        head, _, name = key.partition(":")
        if head == "a" and acc is not None:
            acc[name] = v
        elif head[:1] == "b" and head[1:].isdigit() and int(head[1:]) < n_buf:
            buf[int(head[1:])][name] = v
    return acc, buf


_memo: dict[Path, tuple[tuple[int, int], Arrays]] = {}
MEMO_ENTRIES = 32  # files kept in memory (seven reducers, a few runs): a refresh does not read them again


def _load(path: Path) -> Arrays | None:
    """reduce.load_arrays, remembered while the file's (mtime, size) stay the same: a refresh after a
    new part goes on from the state the first render read (the token sample's is its result)."""
    try:
        st = path.stat()
    except OSError:
        return None
    stamp = (st.st_mtime_ns, st.st_size)
    hit = _memo.get(path)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    raw = reduce.load_arrays(path, mapped=True)  # read when a face first uses it
    if raw is not None:
        if len(_memo) >= MEMO_ENTRIES:
            _memo.pop(next(iter(_memo)))
        _memo[path] = (stamp, raw)
    return raw


def _meta(folder: Path, ns: str) -> dict | None:
    try:
        meta = json.loads((folder / f"{ns}.json").read_text())
        return meta if isinstance(meta, dict) else None
    except (OSError, ValueError):
        return None


def part_digest(p: PartInfo) -> str:
    """A digest of one part's key (the state records one per part, to find where a listing stops matching)."""
    return hashlib.sha1(p.key.encode()).hexdigest()[:16]


def load(cache_dir: Path, parts: Sequence[PartInfo], r: Reducer, cut_back: bool = False) -> State | None:
    """r's cached state when the listing starts with its parts, else (cut_back: where a read starts r) a
    concatenation's cut back to the parts that still lead the listing (`cut`), else None. Only the result
    is read when the listing is exactly its parts (the state is not needed then)."""
    folder = Path(cache_dir) / FOLDER
    ns = namespace(r)
    meta = _meta(folder, ns)
    try:
        k, want, has_acc, n_buf = int(meta["k"]), str(meta["digest"]), bool(meta["acc"]), int(meta["buf"])
        with_result = bool(meta["result"]) and n_buf >= (meta["result"] == "state")
    except (TypeError, KeyError, ValueError):
        return None
    rows = _rows(meta, k)
    if k <= 0:
        return None
    if k > len(parts) or digest(parts[:k]) != want:
        return cut(folder / f"{ns}-{want}.state", meta, rows, parts, r) if cut_back else None
    if k == len(parts) and with_result and meta["result"] != "state":
        result = _load(folder / f"{ns}-{want}.result")
        if result is not None:
            return State(k, None, [], result, rows)
    raw = _load(folder / f"{ns}-{want}.state")
    if raw is None:
        return None
    acc, buf = from_arrays(raw, has_acc, n_buf)
    if k == len(parts) and meta["result"] == "state":  # the state's one partial is the result
        return State(k, None, [], buf[0], rows)
    return State(k, acc, buf, rows=rows)


def _rows(meta: dict, k: int) -> list[int] | None:
    """The state's rows per part (a concatenation's), when its JSON lists one count and key for each of its k parts."""
    rows, keys = meta.get("rows"), meta.get("keys")
    if not (isinstance(rows, list) and isinstance(keys, list) and len(rows) == len(keys) == k):
        return None
    ok = all(type(n) is int and n >= 0 for n in rows) and all(isinstance(key, str) for key in keys)
    return rows if ok else None


def cut(path: Path, meta: dict, rows: list[int] | None, parts: Sequence[PartInfo], r: Reducer) -> State | None:
    """A concatenation's state cut back to parts[0:j], the parts of it that still lead the listing: the first
    rows of its one partial, those parts' (r.slice_rows), with `spare` the rows of each later part of it that
    the listing still holds (after a part rewritten, removed or inserted at j, or another rank's restart);
    None when it is not a concatenation's, r cannot cut its merge (the token sample once capped) or no part
    of it is listed."""
    part_rows = getattr(r, "slice_rows", None)
    if rows is None or part_rows is None or meta.get("acc") or meta.get("buf") != 1:
        return None
    listed = [part_digest(p) for p in parts]
    j = 0
    for key, now in zip(meta["keys"], listed, strict=False):  # the state may list more parts, or fewer
        if key != now:
            break
        j += 1
    later = set(listed[j:])
    if not j and not later & set(meta["keys"]):
        return None
    raw = _load(path)
    if raw is None:
        return None
    merged = from_arrays(raw, False, 1)[1][0]
    ends = [0, *itertools.accumulate(rows)]
    head = part_rows(merged, 0, ends[j])
    spare = {key: part_rows(merged, ends[m], ends[m + 1])
             for m, key in enumerate(meta["keys"]) if m >= j and key in later}
    if head is None or any(v is None for v in spare.values()):
        return None
    return State(j, None, [head] if j else [], rows=rows[:j], spare=spare)


def save(cache_dir: Path, parts: Sequence[PartInfo], r: Reducer, state: State) -> bool:
    """Write the state (and its result, if any), then point the reducer's JSON at them; False when
    the cache is read-only or a partial holds objects."""
    folder = Path(cache_dir) / FOLDER
    ns, dig = namespace(r), digest(parts[:state.k])
    if not reduce.save_arrays(folder / f"{ns}-{dig}.state", to_arrays(state.acc, state.buf)):
        return False
    if state.result is not None and state.acc is None and len(state.buf) == 1 and state.buf[0] is state.result:
        with_result: bool | str = "state"  # a concatenation's state is its result: not written twice
    else:
        with_result = state.result is not None and reduce.save_arrays(folder / f"{ns}-{dig}.result", state.result)
    old = _meta(folder, ns)
    tmp = folder / f".{ns}.json.{os.getpid()}.tmp"
    meta = {"k": state.k, "digest": dig, "acc": state.acc is not None, "buf": len(state.buf), "result": with_result}
    if state.rows is not None and len(state.rows) == state.k and state.acc is None and len(state.buf) == 1:
        meta.update(rows=[int(n) for n in state.rows], keys=[part_digest(p) for p in parts[:state.k]])
    try:
        tmp.write_text(json.dumps(meta))
        os.replace(tmp, folder / f"{ns}.json")
    except OSError:
        return False
    if old and old.get("digest") != dig and isinstance(old.get("digest"), str) and old["digest"].isalnum():
        for ext in ("state", "result"):
            (folder / f"{ns}-{old['digest']}.{ext}").unlink(missing_ok=True)
    return True


def due(k: int, end: int) -> bool:
    """Whether a state of parts[0:end] replaces one of parts[0:k]: the first one, or PREFIX_TAIL parts on."""
    return end > 0 and (k == 0 or end - k >= PREFIX_TAIL)
