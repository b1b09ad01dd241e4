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

Files: CACHE/reducers/<namespace>.json (k, digest of the k keys, whether a result was written, or
"state" when the state's one partial is the result: a concatenation's) and
CACHE/reducers/<namespace>-<digest>.state / .result (reduce.save_arrays's layout); the namespace is
a digest of the reducer's name, version and settings.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kldiag.analysis import protocol as reduce
from kldiag.analysis.cache.prefix import PREFIX_TAIL, digest
from kldiag.analysis.protocol import Arrays, Reducer
from kldiag.format import PartInfo

REDUCER_PREFIX_VERSION = 1
FOLDER = "reducers"


@dataclass
class State:
    """A reducer's in-order merge after parts[0:k]: `acc` (None before the first merge) and `buf`."""

    k: int
    acc: Arrays | None
    buf: list[Arrays]
    result: Arrays | None = None  # merge([acc, *buf]) when it was written with the state


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


def load(cache_dir: Path, parts: Sequence[PartInfo], r: Reducer) -> State | None:
    """r's cached state when the listing starts with its parts, else None. Only the result is read
    when the listing is exactly its parts (the state is not needed then)."""
    folder = Path(cache_dir) / FOLDER
    ns = namespace(r)
    meta = _meta(folder, ns)
    try:
        k, want, has_acc, n_buf = int(meta["k"]), str(meta["digest"]), bool(meta["acc"]), int(meta["buf"])
        with_result = bool(meta["result"]) and n_buf >= (meta["result"] == "state")
    except (TypeError, KeyError, ValueError):
        return None
    if not 0 < k <= len(parts) or digest(parts[:k]) != want:
        return None
    if k == len(parts) and with_result and meta["result"] != "state":
        result = _load(folder / f"{ns}-{want}.result")
        if result is not None:
            return State(k, None, [], result)
    raw = _load(folder / f"{ns}-{want}.state")
    if raw is None:
        return None
    acc, buf = from_arrays(raw, has_acc, n_buf)
    if k == len(parts) and meta["result"] == "state":  # the state's one partial is the result
        return State(k, None, [], buf[0])
    return State(k, acc, buf)


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
