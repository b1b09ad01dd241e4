"""Sealed sequence rows kept on disk, not in memory, until the tables are built from them.

The merged per-(step, seq) rows (192 bytes a sequence) are the one part of the merge that grows with
the run: 20M sequences for 10B tokens. `prefix.Stream` seals rows no later part can change; once
SPILL_CHUNK_ROWS of them wait, it writes them to a file (`spill`) and keeps a `Spilled` handle: the
file stays open, so a handle reads it even after another process's prefix rewrite removed its name.
The engine then loads one chunk at a time (`load`), builds its share of the tables and drops it; the
prefix cache lists the named chunk files instead of copying their rows (prefix.py).

Files: CACHE/prefix/seqs/<uuid>.seqs (reduce.save_arrays' layout, one keyed table), or an unnamed
temporary file when the cache is off or read-only; beside a chunk file, what is derived from it for
every process (<uuid>.seqs.<digest>.parquet: its rows of the sequence table, seqrows.py;
<uuid>.seqs.<digest>.arrays: its per-step counts and sums, `kept`), removed with it; beside the last
of a prefix's chunk files, those sums of all of them in one file (<uuid>.seqs.all.<digest>.<digest>.arrays,
`kept_all`).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from kldiag.analysis import protocol as reduce
from kldiag.analysis.core import keyed

SPILL_CHUNK_ROWS = 1 << 16  # sealed sequence rows gathered before they go to one file (about 12 MB)
SUFFIX = ".seqs"
STALE_SECONDS = 3600  # an unlisted chunk file older than this is an orphan (a killed analysis): removed


class Spilled:
    """A keyed table of sequence rows in a file: its rows and last step known without reading it."""

    def __init__(self, f, rows: int, step_max: int, name: str | None = None):
        self.f, self.rows, self.step_max, self.name = f, rows, step_max, name

    def load(self) -> keyed.Keyed:
        self.f.seek(0)
        arrays = reduce.parse_arrays(self.f.read())
        if arrays is None:
            raise OSError(f"sequence rows spilled to {self.name or 'a temporary file'} are unreadable")
        return arrays


Chunk = keyed.Keyed | Spilled


def rows(c: Chunk) -> int:
    return c.rows if isinstance(c, Spilled) else keyed.rows(c)


def materialize(c: Chunk) -> keyed.Keyed:
    return c.load() if isinstance(c, Spilled) else c


def loaded(chunks: Iterable[Chunk]) -> Iterator[keyed.Keyed]:
    """The non-empty chunks, each read only when reached (one spilled chunk in memory at a time)."""
    for c in chunks:
        if rows(c):
            yield materialize(c)


_memo: OrderedDict[tuple, Any] = OrderedDict()
_lock = threading.Lock()
MEMO_ENTRIES = 4096  # what was derived from named chunk files (small: per-step sums, Parquet pieces on disk)


def _remembered(key: tuple, compute: Callable[[], Any]) -> Any:
    """compute(), kept in the process's memo under `key` (what a named chunk file, or a list of them, gives:
    their rows never change, a new name is a new file)."""
    with _lock:  # a dashboard analyses in several threads
        if key in _memo:
            _memo.move_to_end(key)
            return _memo[key]
    value = compute()
    with _lock:
        _memo[key] = value
        while len(_memo) > MEMO_ENTRIES:
            _memo.popitem(last=False)
    return value


def derived(c: Chunk, tag: tuple, fn: Callable[[keyed.Keyed], Any], handle: bool = False) -> Any:
    """fn(the chunk's rows), remembered for a named chunk file (its rows never change: a new name is
    a new file), so that an analysis of a grown run derives again only the rows after the prefix.
    handle: fn gets the Spilled handle of a named chunk instead (it reads the rows only if it must)."""
    if not isinstance(c, Spilled) or c.name is None:
        return fn(materialize(c))
    return _remembered((c.name, tag), lambda: fn(c if handle else c.load()))


def _tag_digest(version: int, tag: tuple) -> str:
    return hashlib.sha1(repr((version, tag)).encode()).hexdigest()[:16]


def _from_file(path: Path, compute: Callable[[], keyed.Keyed]) -> tuple[keyed.Keyed, bool]:
    """(the arrays kept in `path`, else compute()'s, then written there; whether they were written now)."""
    got = reduce.load_arrays(path)
    if got is not None:
        return got, False
    got = compute()
    return got, reduce.save_arrays(path, got)


def kept(c: Chunk, tag: tuple, fn: Callable[[keyed.Keyed], keyed.Keyed], version: int) -> keyed.Keyed:
    """derived(c, tag, fn) for a small keyed table (per-step sums of a chunk's sequences), also kept beside
    a named chunk file for every later process (NAME.seqs.<digest of version, tag>.arrays, written once,
    atomically): a warm analysis in a fresh process reads it, not the chunk's 12 MB of rows, so what
    it reads for the run's per-step tables no longer grows with the run's sequences. `version`: bump it
    when fn's result changes meaning. A read-only folder: derived again in every process, as before."""
    def from_disk(h: Spilled) -> keyed.Keyed:
        path = Path(h.f.name).with_name(f"{h.name}.{_tag_digest(version, tag)}.arrays")
        return _from_file(path, lambda: fn(h.load()))[0]

    if not isinstance(c, Spilled) or c.name is None:
        return fn(materialize(c))
    return derived(c, tag, from_disk, handle=True)


def kept_all(chunks: list[Chunk], tag: tuple, fn: Callable[[keyed.Keyed], keyed.Keyed], version: int) -> keyed.Keyed:
    """keyed.concat of kept(c, tag, fn, version) over `chunks` in order, the leading named chunk files' part
    read from one file (NAME.seqs.all.<digest of version, tag>.<digest of the names>.arrays, NAME the last
    of them, written once): a warm analysis in a fresh process then opens one file per tag, not one per
    chunk (41 at 1B rows, 400 at 10B tokens). Writing it removes the tag's files of other chunk lists."""
    k = 0
    while k < len(chunks) and isinstance(chunks[k], Spilled) and chunks[k].name is not None:
        k += 1
    if k < 2:
        return keyed.concat([kept(c, tag, fn, version) for c in chunks])
    named: list[Spilled] = chunks[:k]  # type: ignore[assignment]
    list_digest = hashlib.sha1("\n".join(c.name for c in named).encode()).hexdigest()[:16]  # type: ignore[misc]
    whole = _remembered(("all", list_digest, tag), lambda: _whole(named, tag, fn, version, list_digest))
    return keyed.concat([whole, *[kept(c, tag, fn, version) for c in chunks[k:]]])


def _whole(named: list[Spilled], tag: tuple, fn, version: int, list_digest: str) -> keyed.Keyed:
    """kept_all's table of the named chunks: from its file, else from each chunk's kept() and then written."""
    tag_digest = _tag_digest(version, tag)
    folder = Path(named[-1].f.name).parent
    path = folder / f"{named[-1].name}.all.{tag_digest}.{list_digest}.arrays"
    got, written = _from_file(path, lambda: keyed.concat([kept(c, tag, fn, version) for c in named]))
    if written:
        for old in folder.glob(f"*{SUFFIX}.all.{tag_digest}.*.arrays"):  # another chunk list's: superseded
            if old.name != path.name:
                old.unlink(missing_ok=True)
    return got


def spill(table: keyed.Keyed, folder: Path | None) -> Chunk:
    """`table` written to a file in `folder` (None or unwritable: an unnamed temporary file), as a
    handle; the table itself when no file can be written."""
    step_max = int(table["step"][-1])
    if folder is not None:
        name = f"{uuid.uuid4().hex}{SUFFIX}"
        try:
            if reduce.save_arrays(Path(folder) / name, table):
                return Spilled(open(Path(folder) / name, "rb"), keyed.rows(table), step_max, name)
        except OSError:
            pass
    try:
        f = tempfile.TemporaryFile()
        if reduce.write_arrays(f, table):
            return Spilled(f, keyed.rows(table), step_max)
        f.close()
    except OSError:
        pass
    return table


def open_named(folder: Path, name: str, n_rows: int, step_max: int) -> Spilled | None:
    """The handle of a chunk file a prefix lists, or None when it is gone (the prefix is then unusable)."""
    if os.path.basename(name) != name or not name.endswith(SUFFIX):
        return None
    try:
        return Spilled(open(Path(folder) / name, "rb"), n_rows, step_max, name)
    except OSError:
        return None


def remove_unlisted(folder: Path, keep: set[str]) -> None:
    """Remove the chunk files no prefix lists any more (open handles still read theirs); a file
    written in the last STALE_SECONDS may belong to an analysis still running, and stays."""
    now = time.time()
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for e in entries:
        chunk = e.name.split(SUFFIX)[0] + SUFFIX  # a chunk file, or what was derived from it (NAME.seqs.*)
        if SUFFIX in e.name and not e.name.startswith(".") and chunk not in keep:
            try:
                if now - e.stat().st_mtime > STALE_SECONDS:
                    os.unlink(e.path)
            except OSError:
                pass
