"""What a webhook was sent for one run, remembered across restarts of `kldiag watch --notify`.

    log = SentLog.for_run("runs/x", url)          # RUN/.kldiag/watch/sent-<digest>.json
    log.keys()                                    # {("cause", "k3_weight_blowup"), ("episode", "blowup", 36)}
    log.add(("cause", "k3_weight_blowup"))        # written at once (temporary file, then rename)

One file per run and destination: the file name is a digest of the destination (sha256 of the URL), so
the URL, a secret, is written nowhere, and two webhooks (or two runs) keep their own records. A key is
added only when its message was delivered: what was queued but not sent is sent by the next look or
the next start. A remote run keeps it in the run's local cache (kldiag.format Store.cache_dir). A
directory that cannot be written keeps the record in memory only, with one warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

from kldiag.format.storage import resolve

log = logging.getLogger("kldiag.live.notify")
FOLDER = "watch"  # under the run's cache directory (RUN/.kldiag)


def destination_digest(destination: str) -> str:
    """A short, stable name for a destination that does not reveal it (sha256, 16 hex digits)."""
    return hashlib.sha256(destination.encode("utf-8", "surrogateescape")).hexdigest()[:16]


class SentLog:
    """The keys of the messages delivered to one destination for one run (a JSON list in `path`)."""

    def __init__(self, path: Path | None):
        self.path = path
        self._keys: set[tuple] = set()
        self._warned = False
        self.existed = path is not None and path.exists()  # False: this destination's first look at the run
        if path is not None:
            self._keys = _read(path)

    @classmethod
    def for_run(cls, run: str, destination: str) -> SentLog:
        """The log of `run` (a path or URI) for `destination`; in memory when the run's cache is unknown."""
        try:
            folder = resolve(run).cache_dir() / FOLDER
        except Exception:  # noqa: BLE001 - a run path that cannot be resolved: nothing remembered, never an error
            return cls(None)
        return cls(folder / f"sent-{destination_digest(destination)}.json")

    def keys(self) -> set[tuple]:
        return set(self._keys)

    def __contains__(self, key: tuple) -> bool:
        return key in self._keys

    def add(self, key: tuple) -> None:
        """Remember `key` as delivered, on disk at once (a crash after this never sends it twice)."""
        self._keys.add(key)
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".sent-", suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(sorted(list(k) for k in self._keys), f)
            os.replace(tmp, self.path)
        except OSError as e:
            if not self._warned:
                self._warned = True
                log.warning("kldiag notify: cannot record what was sent in %s (%s): a restart may send it again",
                            self.path.parent, e.strerror or type(e).__name__)


def _read(path: Path) -> set[tuple]:
    try:
        items = json.loads(path.read_text())
    except FileNotFoundError:
        return set()
    except (OSError, ValueError) as e:  # a damaged record: messages may repeat, never fail the watch
        log.warning("kldiag notify: ignoring %s (%s): messages sent before may be sent again", path,
                    getattr(e, "strerror", None) or type(e).__name__)
        return set()
    return {tuple(k) for k in items if isinstance(k, list)} if isinstance(items, list) else set()
