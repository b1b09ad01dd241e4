"""What the mismatch fits derive from the token sample, kept across the analyses of a growing run.

A live dashboard analyses its run again at each new part. The token sample (kldiag.mismatch.sample) is
every k-th step's tokens, so a new part rarely adds to it; the refreshed analysis's sample then holds
the very arrays of the one before: the merged sample's chunks as the reducer prefix cache read them
(kldiag.analysis.cache.side_prefix, memory-mapped, read-only, remembered while the file is unchanged).
The thinned tokens, the parity fit, the signatures and the truncation test are functions of those
tokens and their settings alone (kldiag.mismatch.parity, .signatures, kldiag.diagnosis.truncation),
so `kept` gives the value computed for the latest sample whose arrays are the same objects, all
read-only, with the same stride and metadata: the same tokens, value for value. The arrays are held
here (one sample: the latest), so that an object compared is never a new one at a freed address.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

from kldiag.mismatch.tokenset import chunks

T = TypeVar("T")
_LOCK = threading.Lock()
_LATEST: list[_Entry] = []  # at most one: the sample whose values are kept


class _Entry:
    def __init__(self, arrays: dict[str, list], stride: int, meta: dict):
        self.arrays, self.stride, self.meta = arrays, stride, meta
        self.values: dict[tuple[str, Any], Any] = {}

    def holds(self, arrays: dict[str, list], stride: int, meta: dict) -> bool:
        """Whether these are this entry's arrays (the same objects, column for column), stride and meta."""
        return (stride == self.stride and arrays.keys() == self.arrays.keys() and meta == self.meta
                and all(len(arrays[c]) == len(self.arrays[c])
                        and all(a is b for a, b in zip(arrays[c], self.arrays[c], strict=True)) for c in arrays))


def _arrays(sample) -> dict[str, list] | None:
    """The sample's chunks per column, None when one of them is writable (its values could change)."""
    out = {c: list(chunks(v)) for c, v in sample.cols.items()}
    return None if any(a.flags.writeable for v in out.values() for a in v) else out


def kept(sample, name: str, settings: Any, compute: Callable[[], T]) -> T:
    """compute()'s value for this sample and (name, settings): the one kept for the latest sample when
    this sample is made of the same read-only arrays, else computed (and kept, the sample becoming the
    latest). `settings`: hashable (the fit's config)."""
    arrays = _arrays(sample)
    if arrays is None:
        return compute()
    with _LOCK:
        if not (_LATEST and _LATEST[0].holds(arrays, sample.stride, sample.meta)):
            _LATEST[:] = [_Entry(arrays, sample.stride, dict(sample.meta))]
        entry = _LATEST[0]
        if (name, settings) in entry.values:
            return entry.values[(name, settings)]
    value = compute()
    with _LOCK:
        entry.values.setdefault((name, settings), value)
        return entry.values[(name, settings)]


def forget() -> None:
    """Drop what is kept (tests; a caller that wants the memory back)."""
    with _LOCK:
        _LATEST.clear()
