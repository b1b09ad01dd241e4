"""Merged-prefix cache: a refresh merges the new parts' partials, not the whole run's.

Merging every cached partial on each refresh grows with the run (a lexsort of every step
and sequence row). The prefix cache keeps the merge of the parts listed first, parts[0:k]:

- `sealed`: its steps and seqs rows of steps < step_cut, where step_cut is the step_min of
  parts[k-1]. Parts are listed by step_min first (format/parts.py), so every part listed
  after the prefix, now or later, has only rows of steps >= step_cut: these rows are final.
- its top, bad and superseded tables and row count (they merge by a total order or exact
  integer sums, so merging them again with later parts gives the same result).

A refresh then merges only the rows of steps >= step_cut (from the few prefix parts whose
step range reaches step_cut, read from the per-part cache) with the new parts' partials,
and appends that after `sealed`: every key leads with the step, so sealed rows sort first.
The result equals `partials.merge` of every partial in part order bit for bit: each key's
rows are reduced from the same partials in the same order (tests/test_analysis_prefix.py).

The prefix is used only when the current listing starts with exactly its k part keys (a
key holds size, mtime and superseded steps: a restart or a rewritten part invalidates it),
never covers a skipped part, and is rewritten once PREFIX_TAIL parts follow it.
Files: CACHE/prefix/<settings>.json (k, step_cut, digest of the k keys, data file, chunk files),
CACHE/prefix/<settings>-<digest>.part (partials.save's layout) and the sealed sequence rows in
step order: CACHE/prefix/seqs/*.seqs (spill.py), then the data file's own seqs rows (fewer than
spill.SPILL_CHUNK_ROWS). The chunk files are read one at a time when the tables are built, so the
sequence rows of a long run are never all in memory.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kldiag.analysis import protocol as reduce
from kldiag.analysis.core import keyed, partials, spill
from kldiag.analysis.core.batch import Thresholds
from kldiag.analysis.core.stats import select_first, select_top
from kldiag.format import PartInfo

PREFIX_VERSION = 2  # 2: sealed sequence rows in chunk files (spill.py), listed by the JSON
PREFIX_TAIL = 16  # parts listed after the prefix before it is rewritten
STEP_TABLES = ("steps", "seqs")  # keyed by (step, ...): split at step_cut


@dataclass
class Prefix:
    """The merge of parts[0:k]: `sealed` steps/seqs rows below step_cut, the rest whole."""

    k: int
    step_cut: int
    sealed: partials.Partial


def digest(parts: Sequence[PartInfo]) -> str:
    h = hashlib.sha1()
    for p in parts:
        h.update(p.key.encode() + b"\n")
    return h.hexdigest()


def settings_key(th: Thresholds) -> str:
    text = json.dumps([partials.PARTIAL_VERSION, PREFIX_VERSION, th.__dict__], sort_keys=True)
    return hashlib.sha1(text.encode()).hexdigest()[:20]


def load(cache_dir: Path, parts: Sequence[PartInfo], th: Thresholds) -> Prefix | None:
    """The cached prefix when the listing starts with its parts, else None."""
    folder = Path(cache_dir) / "prefix"
    try:
        meta = json.loads((folder / f"{settings_key(th)}.json").read_text())
        k, cut, want, name = int(meta["k"]), int(meta["step_cut"]), meta["digest"], meta["file"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not 0 < k <= len(parts) or digest(parts[:k]) != want or os.path.basename(name) != name:
        return None
    sealed = _load_data(folder / name)
    if sealed is None:
        return None
    handles = []
    for entry in meta.get("seq_files", []):
        h = spill.open_named(folder / "seqs", *entry) if isinstance(entry, list) and len(entry) == 3 else None
        if h is None:  # removed by a newer prefix's cleanup: this one is stale
            return None
        handles.append(h)
    if handles:
        sealed.seq_chunks = [*handles, *([sealed.seqs] if sealed.seqs and keyed.rows(sealed.seqs) else [])]
        sealed.seqs = {}
    return Prefix(k, cut, sealed)


def _load_data(path: Path) -> partials.Partial | None:
    """partials.load, read each time (small: the sealed sequence rows are in the chunk files, but for
    fewer than spill.SPILL_CHUNK_ROWS; what derives from the chunk files is remembered, spill.derived)."""
    raw = reduce.load_arrays(path)
    return partials.from_arrays(raw) if raw is not None else None


def save(cache_dir: Path, parts: Sequence[PartInfo], th: Thresholds, pre: Prefix) -> bool:
    """Write the prefix's data, then point the settings' JSON at it; False when read-only."""
    folder = Path(cache_dir) / "prefix"
    key, dig = settings_key(th), digest(parts[:pre.k])
    name = f"{key}-{dig}.part"
    files, rest = chunk_files(pre.sealed.seq_rows(), folder / "seqs")
    if files is None:
        return False
    arrays = partials.to_arrays(partials.Partial(steps=pre.sealed.steps, top=pre.sealed.top, bad=pre.sealed.bad,
                                                 superseded=pre.sealed.superseded, rows=pre.sealed.rows))
    if rest:  # written one chunk after the other: no concatenated copy in memory
        arrays.update({f"seqs/{c}": [ch[c] for ch in rest] for c in rest[0]})
    if not reduce.save_arrays(folder / name, arrays):
        return False
    meta = folder / f"{key}.json"
    try:
        old = json.loads(meta.read_text()).get("file")
    except (OSError, ValueError, AttributeError):
        old = None
    tmp = folder / f".{key}.json.{os.getpid()}.tmp"
    try:
        tmp.write_text(json.dumps({"k": pre.k, "step_cut": pre.step_cut, "digest": dig, "file": name,
                                   "seq_files": [[h.name, h.rows, h.step_max] for h in files]}))
        os.replace(tmp, meta)
        if old and old != name and os.path.basename(old) == old:
            (folder / old).unlink(missing_ok=True)
    except OSError:
        return False
    spill.remove_unlisted(folder / "seqs", listed(folder))
    return True


def chunk_files(chunks: Sequence[spill.Chunk], folder: Path) -> tuple[list[spill.Spilled] | None, list[keyed.Keyed]]:
    """The sealed seqs chunks as named chunk files (the spilled ones as they are) and the in-memory
    rows after them, themselves a file once SPILL_CHUNK_ROWS wait; None when a file cannot be written."""
    files: list[spill.Spilled] = []
    rest: list[keyed.Keyed] = []
    for c in chunks:
        if isinstance(c, spill.Spilled) and c.name is not None and not rest:
            files.append(c)
            continue
        c = spill.materialize(c)
        if keyed.rows(c):
            rest.append(c)
    if sum(keyed.rows(c) for c in rest) >= spill.SPILL_CHUNK_ROWS:
        h = spill.spill(keyed.concat(rest), folder)
        if not isinstance(h, spill.Spilled) or h.name is None:
            return None, []
        files, rest = [*files, h], []
    return files, rest


def listed(folder: Path) -> set[str]:
    """The chunk files the prefixes in `folder` list (every settings key's)."""
    out: set[str] = set()
    for meta in folder.glob("*.json"):
        try:
            out.update(entry[0] for entry in json.loads(meta.read_text()).get("seq_files", []))
        except (OSError, ValueError, AttributeError, TypeError, IndexError):
            continue
    return out


def spill_folder(cache_dir: Path) -> Path | None:
    """Where the stream writes its sealed sequence rows: CACHE/prefix/seqs, None when not writable."""
    folder = Path(cache_dir) / "prefix" / "seqs"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return folder if os.access(folder, os.W_OK) else None


def drop_empty_spill(cache_dir: Path) -> None:
    """Remove CACHE/prefix/seqs, CACHE/prefix and CACHE when spill_folder made them and nothing was
    written (an analysis that found no readable row leaves the run as it was); rmdir keeps anything
    holding a file."""
    cache = Path(cache_dir)
    for folder in (cache / "prefix" / "seqs", cache / "prefix", cache):
        try:
            folder.rmdir()
        except OSError:  # not empty, not there, or not ours to remove: left as it is
            return


def rows_where(table: keyed.Keyed, keep: np.ndarray) -> keyed.Keyed:
    return {c: a[keep] for c, a in table.items()} if table else {}


def at_or_above(p: partials.Partial, cut: int) -> partials.Partial:
    """Only p's steps and seqs rows of steps >= cut (the rows a later part may continue)."""
    return partials.Partial(**{t: rows_where(getattr(p, t), getattr(p, t)["step"] >= cut) if getattr(p, t) else {}
                               for t in STEP_TABLES})


def combine(pre: Prefix | None, opened: Sequence[partials.Partial], tail: Sequence[partials.Partial],
            top_k: int, chunked: bool = False) -> partials.Partial:
    """partials.merge(prefix parts + tail) from the prefix, its open rows and the tail's partials
    (chunked: the seqs rows in Partial.seq_chunks, the prefix's sealed ones not copied)."""
    if pre is None:
        out = partials.merge(tail, top_k)
        if chunked:
            out.seq_chunks, out.seqs = out.seq_rows(), {}
        return out
    rest = [at_or_above(p, pre.step_cut) for p in opened] + list(tail)
    out = whole_tables(pre, tail, top_k)
    out.steps = keyed.concat([pre.sealed.steps, keyed.merge([p.steps for p in rest])])
    chunks = [*pre.sealed.seq_rows(), keyed.merge([p.seqs for p in rest])]
    if chunked:
        out.seq_chunks = [c for c in chunks if spill.rows(c)]
    else:
        out.seqs = keyed.concat(list(spill.loaded(chunks)))
    return out


def whole_tables(pre: Prefix | None, tail: Sequence[partials.Partial], top_k: int) -> partials.Partial:
    """top, bad, superseded and rows of the prefix and the tail (steps and seqs left empty)."""
    ps = ([pre.sealed] if pre else []) + list(tail)
    return partials.Partial(top=select_top(keyed.concat([p.top for p in ps]), top_k),
                            bad=select_first(keyed.concat([p.bad for p in ps]), top_k),
                            superseded=keyed.merge([p.superseded for p in ps]), rows=sum(p.rows for p in ps))


def below(table: keyed.Keyed, cut: int) -> keyed.Keyed:
    """The rows of steps < cut of a step-sorted table: a leading block, so views, not a copy."""
    if not table:
        return {}
    n = int(np.searchsorted(table["step"], cut, side="left"))
    return {c: a[:n] for c, a in table.items()}


def seal(merged: partials.Partial, k: int, cut: int) -> Prefix:
    """The prefix of parts[0:k] from `merged`, the merge of parts[0:k] (rows below cut may
    also come from the merge of more parts: later parts hold no step below cut). Its seqs rows may
    be a list of chunks (views of merged's, concatenated on disk by save)."""
    seqs = [c if isinstance(c, spill.Spilled) and c.step_max < cut else below(spill.materialize(c), cut)
            for c in merged.seq_rows()]
    seqs = [c for c in seqs if spill.rows(c)]
    low = partials.Partial(steps=below(merged.steps, cut), top=merged.top, bad=merged.bad,
                           superseded=merged.superseded, rows=merged.rows)
    if len(seqs) == 1 and not isinstance(seqs[0], spill.Spilled):
        low.seqs = seqs[0]
    else:
        low.seq_chunks = seqs
    return Prefix(k, cut, low)


def refresh(cache_dir: Path, parts: Sequence[PartInfo], th: Thresholds, pre: Prefix | None,
             by_index: dict[int, partials.Partial], result: partials.Partial) -> None:
    """Rewrite the prefix up to the first skipped part once PREFIX_TAIL parts follow the old one."""
    k = pre.k if pre else 0
    end = next((i for i in range(k, len(parts)) if i not in by_index), len(parts))
    if end == k or (pre is not None and end - k < PREFIX_TAIL):
        return
    if end == len(parts):
        covered = result
    else:  # top, bad, superseded and rows of parts[0:end] only; steps/seqs below the cut are final
        covered = whole_tables(pre, [by_index[i] for i in range(k, end)], th.top_k)
        covered.steps, covered.seqs, covered.seq_chunks = result.steps, result.seqs, result.seq_chunks
    save(cache_dir, parts, th, seal(covered, end, parts[end - 1].step_min))


SEAL_EVERY = 16  # parts between two seals of the streaming merge


class Stream:
    """partials.merge of every part's partial, merged as they arrive in part order (the engine's
    cold path): rows of steps below the next part's step_min are final and are sealed, merged
    from the same partials in the same order as a full merge, so the result equals it bit for bit
    while only the open rows (and the run's sealed merge) stay in memory."""

    def __init__(self, parts: Sequence[PartInfo], top_k: int, spill_to: Path | None = None):
        self.parts, self.top_k, self.spill_to = parts, top_k, spill_to
        self.open: list[partials.Partial] = []
        self.sealed: dict[str, list] = {t: [] for t in STEP_TABLES}  # seqs: spilled chunks first (spill.py)
        self.pending: list[keyed.Keyed] = []  # sealed seqs rows not yet spilled, after sealed["seqs"]
        self.whole = partials.Partial()
        self.added = 0  # the index the next part should have (a gap: an unreadable part was skipped)
        self.cut = -(1 << 62)  # the last seal's cut: rows of steps below it are sealed

    def add(self, i: int, p: partials.Partial) -> None:
        self.added = i + 1
        self.open.append(partials.Partial(steps=p.steps, seqs=p.seqs))
        self.whole = whole_tables(None, [self.whole, p], self.top_k)
        # seal once enough parts wait and the cut has moved: with many ranks the next part's first
        # step often stays put, and sealing at every arrival would copy every open partial each time
        if len(self.open) >= SEAL_EVERY and i + 1 < len(self.parts) and self.parts[i + 1].step_min > self.cut:
            self.seal(self.parts[i + 1].step_min)

    def seal(self, cut: int) -> None:
        """Merge and keep aside the open rows of steps < cut: no later part has such a step."""
        self.cut = cut
        for t in STEP_TABLES:
            low = keyed.merge([rows_where(getattr(p, t), getattr(p, t)["step"] < cut) for p in self.open
                               if getattr(p, t)])
            if t == "steps":
                self.sealed[t].append(low)
            elif low:
                self.pending.append(low)
        if sum(keyed.rows(c) for c in self.pending) >= spill.SPILL_CHUNK_ROWS:  # to disk, out of memory
            self.sealed["seqs"].append(spill.spill(keyed.concat(self.pending), self.spill_to))
            self.pending = []
        self.open = [at_or_above(p, cut) for p in self.open]
        self.open = [p for p in self.open if any(keyed.rows(getattr(p, t)) for t in STEP_TABLES if getattr(p, t))]

    def result(self, chunked: bool = False) -> partials.Partial:
        """The merge of the partials added so far (the stream may go on). chunked: its seqs rows as
        the sealed chunks and the open rows' merge (Partial.seq_chunks), not concatenated."""
        w = self.whole
        chunks = [*self.sealed["seqs"], *self.pending, keyed.merge([p.seqs for p in self.open])]
        out = partials.Partial(steps=keyed.concat([*self.sealed["steps"], keyed.merge([p.steps for p in self.open])]),
                               top=w.top, bad=w.bad, superseded=w.superseded, rows=w.rows)
        if chunked:
            out.seq_chunks = [c for c in chunks if spill.rows(c)]
        else:
            out.seqs = keyed.concat(list(spill.loaded(chunks)))
        return out
