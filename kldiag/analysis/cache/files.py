"""What a run's analysis cache (RUN/.kldiag) holds, and which of it this kldiag still reads.

Every cached file is named by what made it: a part's partial by its reducer's name, version and settings
and the part's identity (reduce.cache_key), a reducer's merged prefix by a digest of the reducer
(reducer_prefix.namespace), the analysis's prefix by its thresholds (prefix.settings_key). So a kldiag
upgrade that changes a reducer, a part rewritten or no longer listed, a token sample whose stride doubled
as the run grew, or an analysis at other thresholds leaves files that no read asks for again, and they
stay on disk. `usage` sorts the files into live (read by this kldiag's analysis, dashboard, report and
diagnosis of the run at their default settings, as the run is listed now) and stale; `prune` removes the
stale ones, which a later read at those settings would compute again.

Left alone: results/ (the derived-results store keeps store.KEEP entries per name itself), prefix/seqs
(a prefix removes the chunk files it stops listing), sequences/ (unnamed temporary files), any folder of a
reducer kldiag does not know (a user's own: kept), temporary files younger than TMP_AGE_S (a write in
flight in another process), and any file written since `since` (when the live set was listed: a reader
that went on meanwhile may have written a new part's partial or a newer prefix).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kldiag.analysis import protocol as reduce
from kldiag.analysis.cache import prefix
from kldiag.analysis.cache import side_prefix as reducer_prefix
from kldiag.analysis.core.batch import Thresholds
from kldiag.analysis.core.partials import AnalysisReducer
from kldiag.format import PartInfo

RETIRED = ("context",)  # per-part folders of reducers kldiag no longer has (the report's context: 1d55836)
TMP_AGE_S = 3600.0  # a temporary file this old is a write that died, not one in flight


@dataclass
class FolderUsage:
    """One folder of the cache: its files and bytes, and the stale ones (judged: whether it is sorted at all)."""

    folder: str
    files: int = 0
    bytes: int = 0
    stale_files: int = 0
    stale_bytes: int = 0
    judged: bool = True
    stale: list[Path] = field(default_factory=list, repr=False)


def live_files(cache_dir: Path, parts: Sequence[PartInfo], th: Thresholds,
               reducers: Sequence[reduce.Reducer]) -> dict[str, set[str]]:
    """{folder: the file names in it that a read of `parts` with `reducers` (bound to the run, as
    runner.bound makes them) and the analysis at `th` asks for}. Folders: each reducer's name (its
    per-part partials), reducers/ (their merged prefixes), prefix/ (the analysis's)."""
    cache_dir = Path(cache_dir)
    every = [AnalysisReducer(th), *[r for r in reducers if r.name != AnalysisReducer.name]]
    live: dict[str, set[str]] = {r.name: set() for r in every}
    for r in every:
        live[r.name].update(f"{reduce.cache_key(r, p)}.part" for p in parts)
    states = live.setdefault(reducer_prefix.FOLDER, set())
    for r in every[1:]:
        ns = reducer_prefix.namespace(r)
        meta = reducer_prefix._meta(cache_dir / reducer_prefix.FOLDER, ns) or {}
        states.add(f"{ns}.json")
        if isinstance(meta.get("digest"), str):
            states.update(f"{ns}-{meta['digest']}.{ext}" for ext in ("state", "result"))
    key = prefix.settings_key(th)
    meta = _json(cache_dir / "prefix" / f"{key}.json")
    live["prefix"] = {f"{key}.json", *([meta["file"]] if isinstance(meta.get("file"), str) else [])}
    return live


def _json(path: Path) -> dict:
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def usage(cache_dir: Path, live: dict[str, set[str]], since: float | None = None) -> list[FolderUsage]:
    """Every folder of the cache with its files, bytes and stale files (live: live_files', listed at time
    `since`, default now), by name."""
    cache_dir, since = Path(cache_dir), time.time() if since is None else since
    if not cache_dir.is_dir():
        return []
    out = []
    for folder in sorted(p for p in cache_dir.iterdir() if p.is_dir()):
        judged = folder.name in live or folder.name in RETIRED
        u = FolderUsage(folder.name, judged=judged)
        for f in sorted(folder.rglob("*")):
            if not f.is_file():
                continue
            size = _size(f)
            u.files, u.bytes = u.files + 1, u.bytes + size
            if judged and f.parent == folder and _stale(f, live.get(folder.name, set()), since):
                u.stale.append(f)
                u.stale_files, u.stale_bytes = u.stale_files + 1, u.stale_bytes + size
        out.append(u)
    return out


def _size(f: Path) -> int:
    try:
        return f.stat().st_size
    except OSError:  # removed meanwhile (another process's prune or rewrite)
        return 0


def _stale(f: Path, live: set[str], since: float) -> bool:
    """A file of a judged folder that no read asks for: not live, not written since the live set was listed,
    and not a temporary file young enough to be a write in flight (save_arrays' `.<name>.<pid>.<thread>.tmp`,
    the prefixes' `.<ns>.json.<pid>.tmp`)."""
    if f.name in live:
        return False
    try:
        mtime = f.stat().st_mtime
    except OSError:  # removed meanwhile
        return False
    if mtime >= since - 1.0:  # 1 s: file systems whose mtimes are coarse
        return False
    return not (f.name.startswith(".") and ".tmp" in f.name) or since - mtime > TMP_AGE_S


def prune(cache_dir: Path, live: dict[str, set[str]], since: float | None = None) -> list[FolderUsage]:
    """Remove usage()'s stale files; returns usage() as it was (what was removed: the stale counts). A file
    another process removed meanwhile is skipped; one that cannot be removed (read-only cache) stays."""
    before = usage(cache_dir, live, since)
    for u in before:
        for f in u.stale:
            try:
                f.unlink()
            except FileNotFoundError:
                continue
            except OSError:
                u.stale_files, u.stale_bytes = u.stale_files - 1, u.stale_bytes - _size(f)
    return before
