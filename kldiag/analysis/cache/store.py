"""Result store: what faces derive from an analysed run (its diagnosis, the Mismatch page's views),
kept under RUN/.kldiag so that a fresh process on an unchanged run reads them instead of recomputing.

A result is stored under a key of
- the analysis's identity (`bind`, called by analyze): the digest of every part key it read (the
  one prefix.py and reducer_prefix.py use: rank, name, size, mtime, superseded steps), the vocab's
  stamp; None (nothing stored or read) when a part was skipped as unreadable or the analysis ran
  without its cache (use_cache=False);
- at lookup, the analysis's resolved settings (AnalysisConfig without the execution knobs) and its
  manifest, as the face sees them (`kldiag analyze --set` edits the manifest after the analysis);
- the result's name, its own settings (a JSON-able value), and the code: STORE_VERSION and a digest
  of the kldiag sources and the numpy/pandas/pyarrow versions (`code_version`).
A new part, a rewritten one, other thresholds or other code make another key: the old entry is never
read again, and is pruned (at most KEEP entries per result name, the least recently written first).

Entries: CACHE/results/<name>-<key>.res in reduce.save_arrays's layout (codec.py's arrays), written to
a temporary file and renamed; an absent, truncated, corrupt or undecodable entry is a miss (recomputed,
then rewritten); a read-only run computes and stores nothing. `cached` returns an equal value either way.
"""

from __future__ import annotations

import builtins
import dataclasses
import functools
import hashlib
import json
import re
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from kldiag.analysis import protocol as reduce
from kldiag.analysis.cache import codec
from kldiag.analysis.cache.prefix import digest

STORE_VERSION = 1
FOLDER = "results"
KEEP = 32  # entries kept per result name (the report's dozen what-ifs, a few thresholds, a few part sets)
MEMO = "result_store"  # Analysis.memo's key of the identity
EXECUTION = ("threads", "workers", "strict", "batch_size", "use_cache", "engine", "ray_address")  # no effect on results
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Identity:
    cache_dir: Path
    parts: str  # digest of the part keys read


def bind(analysis, cache_dir: Path, parts: Sequence, skipped: Sequence[str], use_cache: bool, vocab: int) -> None:
    """Give `analysis` its identity (engine.analyze, once its parts are read)."""
    if use_cache and not skipped:
        analysis.memo[MEMO] = Identity(Path(cache_dir), f"{digest(parts)}-{vocab}")


@functools.cache
def code_version() -> str:
    """A digest of every kldiag source file's bytes and the versions of the libraries results pass through."""
    import numpy
    import pandas
    import pyarrow

    h = hashlib.sha1(json.dumps([STORE_VERSION, numpy.__version__, pandas.__version__, pyarrow.__version__]).encode())
    root = Path(__file__).resolve().parents[2]  # kldiag/: the faces' code (a view, a fit) makes their results too
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:20]


def key(analysis, name: str, settings: Any) -> str | None:
    """The entry's key, None when the analysis has no identity (skipped parts, no cache)."""
    ident = getattr(analysis, "memo", {}).get(MEMO)
    if ident is None:
        return None
    cfg = {k: v for k, v in dataclasses.asdict(analysis.config).items() if k not in EXECUTION}
    text = json.dumps([code_version(), ident.parts, cfg, analysis.manifest.to_dict(), name, settings],
                      sort_keys=True, default=repr)
    return hashlib.sha1(text.encode()).hexdigest()[:24]


def cached(analysis, name: str, settings: Any, compute: Callable[[], T]) -> T:
    """compute()'s value, read from the store when an entry of this key is there, else computed and
    stored. The warnings compute() gave (kldiag's: "kldiag: ...") are stored with it and given again on
    a hit."""
    k = key(analysis, name, settings)
    if k is None:
        return compute()
    path = analysis.memo[MEMO].cache_dir / FOLDER / f"{_safe(name)}-{k}.res"
    hit = _read(path)
    if hit is not None:
        value, said = hit
        for category, message in said:
            warnings.warn(message, _category(category), stacklevel=2)
        return value
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = compute()
    # kldiag's own warnings only: catch_warnings is process-wide, so another thread's may be among them
    said = [[w.category.__name__, str(w.message)] for w in caught if str(w.message).startswith("kldiag")]
    for w in caught:  # given again to the caller's filters, as compute() would have
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    _write(path, value, said)
    return value


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", name)


def _category(name: str) -> type[Warning]:
    cls = getattr(builtins, name, None)  # the built-in categories; another one is given as UserWarning
    return cls if isinstance(cls, type) and issubclass(cls, Warning) else UserWarning


def _read(path: Path) -> tuple[Any, list] | None:
    raw = reduce.load_arrays(path)
    if raw is None:
        return None
    try:
        value, said = codec.decode(raw)
        return value, [[str(c), str(m)] for c, m in said]
    except Exception:  # a corrupt or foreign entry: recomputed and rewritten, never a crash
        return None


def _write(path: Path, value: Any, said: list) -> bool:
    try:
        arrays = codec.encode([value, said])
    except (codec.Uncacheable, TypeError, ValueError):
        return False
    if not reduce.save_arrays(path, arrays):
        return False
    prune(path.parent, path.name.rsplit("-", 1)[0], keep=path.name)
    return True


def prune(folder: Path, name: str, keep: str) -> None:
    """Leave at most KEEP entries of `name` (the newest written, `keep` always among them)."""
    try:
        entries = [(p.stat().st_mtime_ns, p) for p in folder.glob(f"{name}-*.res") if p.name != keep]
    except OSError:
        return
    entries.sort(reverse=True)
    for _, p in entries[KEEP - 1:]:
        try:
            p.unlink()
        except OSError:
            pass
