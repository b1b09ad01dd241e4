"""Parts whose rows the analysis could not use: unreadable, 0 bytes or 0 rows, with their rank and steps.

A part's file name carries its rank, attempt and step range (docs/format.md, "File naming and
publishing"), so a part that cannot be read still says which steps of which rank it held. The
analysis keeps these facts (`Analysis.lost`) and the step ranges of the parts it read
(`Analysis.spans`), so the diagnosis (`data_missing`, kldiag/diagnosis/missing.py) can say which
steps are missing without listing the run again. Nothing here deletes or rewrites a file.

A 0-row part is found by the analysis's own read of it (its partial holds no row) and remembered
in the run's cache (CACHE/empty_parts.json), so a warm analysis, whose prefix covers the part,
still names it, and no part is opened a second time for it. The dashboard's message for a run
with no readable row (`no_tokens_reason`) reads the footers of parts of at most
EMPTY_PART_BYTES instead: there is no analysis to ask.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from kldiag.errors import KldiagError
from kldiag.format import PartInfo, open_run

EMPTY_PART_BYTES = 64 << 10  # no_tokens_reason reads the footer of parts up to this size
EMPTY_FILE = "empty_parts.json"  # in the run's cache: keys of the parts an analysis read with 0 rows
UNREADABLE, ZERO_BYTES, ZERO_ROWS = "unreadable", "empty: 0 bytes", "empty: 0 rows"
NOTHING_PUBLISHED = "nothing has been published yet"  # no_tokens_reason of a run that is only starting


@dataclass(frozen=True)
class LostPart:
    """A listed part none of whose rows reached the analysis; `reason` is one of UNREADABLE,
    ZERO_BYTES, ZERO_ROWS. Steps step_min..step_max of rank `rank` (attempt `attempt`) come
    from its file name."""

    path: str
    rank: int
    attempt: int
    step_min: int
    step_max: int
    reason: str

    @property
    def name(self) -> str:
        return self.path.replace("\\", "/").rsplit("/", 1)[-1]

    def to_dict(self) -> dict:
        return {**asdict(self), "part": self.name}


_FOOTER_ROWS: dict[tuple[str, str], int] = {}  # (path, part key) -> rows: published parts never change


def rows_in_footer(part: PartInfo) -> int | None:
    """The part's row count from its footer (remembered per part identity: `kldiag watch` asks at every
    look); None when the footer cannot be read (the reader skips the part with a warning saying why)."""
    key = (str(part.path), part.key)
    if key not in _FOOTER_ROWS:
        try:
            rows = part.open().metadata.num_rows
        except Exception:  # an unreadable footer is the reader's finding, not ours
            return None
        if len(_FOOTER_ROWS) > 1 << 16:
            _FOOTER_ROWS.clear()
        _FOOTER_ROWS[key] = rows
    return _FOOTER_ROWS[key]


def empty_parts(cache_dir: Path | None, found: Iterable[str]) -> set[str]:
    """The keys of the run's 0-row parts: those this analysis read (`found`) and those earlier ones did,
    remembered in CACHE/EMPTY_FILE (None: no cache; a cache that cannot be written is left as it is)."""
    found = set(found)
    if cache_dir is None:
        return found
    path = Path(cache_dir) / EMPTY_FILE
    try:
        known = set(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        known = set()
    if found - known:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{EMPTY_FILE}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(sorted(found | known)))
            os.replace(tmp, path)
        except OSError:
            pass  # the finding stands for this analysis; a read-only cache only forgets it
    return found | known


def lost_parts(parts: Sequence[PartInfo], skipped: Sequence[str], empty: set[str] = frozenset()) -> list[LostPart]:
    """The parts skipped as unreadable (by path, as the reader reported them) or read with 0 rows (their
    keys in `empty`), in part order."""
    gone = set(skipped)
    out = []
    for p in parts:
        if str(p.path) in gone:
            reason = ZERO_BYTES if p.size == 0 else UNREADABLE
        elif p.key in empty:
            reason = ZERO_ROWS
        else:
            continue
        out.append(LostPart(str(p.path), p.rank, p.attempt, p.step_min, p.step_max, reason))
    return out


def read_spans(parts: Sequence[PartInfo], lost: Sequence[LostPart]) -> list[tuple[int, int, int, int]]:
    """(rank, attempt, step_min, step_max) of every part whose rows the analysis read."""
    gone = {x.path for x in lost}
    return [(p.rank, p.attempt, p.step_min, p.step_max) for p in parts if str(p.path) not in gone]


def no_tokens_reason(run_dir: str | os.PathLike) -> str:
    """Why a run shows no tokens, in words: nothing published yet, or N parts published and every one
    unreadable or empty (naming them). For a face that got EmptyRunError: NOTHING_PUBLISHED is the one
    case where waiting helps."""
    try:
        parts = open_run(run_dir).parts()
    except KldiagError as e:
        return f"it cannot be opened as a run ({e})"
    if not parts:
        return NOTHING_PUBLISHED
    lost = []
    for p in parts:
        rows = None if p.size == 0 else rows_in_footer(p)
        if rows is None:
            lost.append(f"{p.name} ({ZERO_BYTES if p.size == 0 else UNREADABLE})")
        elif rows == 0:
            lost.append(f"{p.name} ({ZERO_ROWS})")
    if len(lost) < len(parts):
        return f"{len(parts)} part(s) published, none with readable token rows"
    named = ", ".join(lost[:5]) + (f" and {len(lost) - 5} more" if len(lost) > 5 else "")
    return f"every published part is unreadable or empty: {named}"
