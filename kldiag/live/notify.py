"""Alert webhooks: one Slack-compatible JSON message when a cause or a critical episode starts.

    n = Notifier("https://hooks.slack.com/services/...", run="runs/x")   # or Notifier("env:KLDIAG_WEBHOOK")
    n.diagnosis(dg)        # `kldiag watch --notify`: each new cause (warning or critical) and critical episode
    n.episode(e)           # `kldiag.Guard(action="notify", notify=URL)`: each episode the guard acts on
    n.close()

The message is a JSON object whose "text" is what Slack (and Mattermost, Rocket.Chat, Discord's
/slack endpoint) shows; the other top-level keys ("run", "cause", "severity", "onset", "evidence",
"fix") carry the same facts for a program. The caller never waits: a message is queued (bounded;
past `max_queue` the newest are dropped and counted) and a daemon thread POSTs it, at most one per
`min_interval_s`, retrying a 5xx, a 429 or a network failure `retries` times with exponential
backoff (`backoff_s`, 2x, 4x ...), each try with a `timeout_s` socket timeout, then giving up with one warning
on the `kldiag.live.notify` logger naming it; a message given up is queued again at the next `diagnosis()`
(the next look of `kldiag watch`), and each one still unsent at `close()` is named. Each episode (kind,
start) and each cause (name) is sent once; with `remember=True` what was delivered is kept per run and
destination (kldiag.live.sent), so a restart or a cron `watch --once` sends only what is new. At a
destination's first look at a run, critical episodes that already ended are recorded as history, not
sent: the causes and the episodes still going on say what matters now.

The URL is a secret (a Slack webhook URL is its own credential): it is kept out of repr(), of every
log record and error message (the HTTP status or the exception's type is what they say), and no
manifest holds it.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from kldiag.diagnosis.types import Cause, Diagnosis, Episode
from kldiag.live.sent import SentLog

log = logging.getLogger("kldiag.live.notify")
NOTIFY_SEVERITIES = ("warning", "critical")  # info causes leave the verdict healthy: no message


@dataclass
class NotifyConfig:
    """How messages are delivered; every default on this screen."""

    min_interval_s: float = 1.0  # Slack's incoming webhooks accept about one message per second
    retries: int = 3  # tries after the first, for a 5xx, a 429 or a network failure
    backoff_s: float = 1.0  # wait before the first retry; doubled for each next one
    timeout_s: float = 10.0  # socket timeout of one HTTP try (connect, and each read)
    max_queue: int = 100  # messages waiting; newer ones are dropped (and counted) past it


def resolve_url(url: str) -> str:
    """The webhook URL: `env:NAME` reads it from the environment (out of `ps` and shell history).
    Errors never quote it."""
    url = (url or "").strip()
    if url.startswith("env:"):
        name = url[4:].strip()
        if not name:
            raise ValueError("--notify env: names no variable: write env:NAME, e.g. env:KLDIAG_WEBHOOK "
                             "(after export KLDIAG_WEBHOOK=https://...)")
        url = os.environ.get(name, "").strip()
        if not url:
            raise ValueError(f"the notify URL variable {name} is not set (export {name}=https://...)")
    if not url.lower().startswith(("http://", "https://")):
        raise ValueError("the notify URL must start with http:// or https:// (it is not shown: it is a secret)")
    if not urllib.parse.urlsplit(url).hostname:
        raise ValueError("the notify URL names no host: write http(s)://HOST/PATH, e.g. "
                         "https://hooks.slack.com/services/... (it is not shown: it is a secret)")
    return url


def episode_message(e: Episode, run: str, fix: str = "") -> dict[str, Any]:
    """The message for an episode that started."""
    if not fix and run:
        fix = f"run `kldiag analyze {run}` for the cause and its fix"
    text = f"kldiag [{e.severity}] {e.kind} episode in {run or 'the run'} from step {e.start}: {e.message}"
    return {"text": text + (f"\nFix: {fix}" if fix else ""), "run": run, "cause": e.kind, "kind": "episode",
            "severity": e.severity, "onset": int(e.start), "evidence": e.message, "fix": fix}


def cause_message(c: Cause, run: str) -> dict[str, Any]:
    """The message for a cause the diagnosis names."""
    where = f" from step {c.onset}" if c.onset is not None else ""
    headline = c.summary or c.cause
    text = f"kldiag [{c.severity}] {c.cause} in {run or 'the run'}{where}: {headline}\nFix: {c.fix}"
    return {"text": text, "run": run, "cause": c.cause, "kind": "cause", "severity": c.severity,
            "onset": c.onset, "evidence": headline, "fix": c.fix}


class Notifier:
    """Sends each new cause / critical episode once to a webhook, from a daemon thread."""

    def __init__(self, url: str, run: str = "", config: NotifyConfig = NotifyConfig(), remember: bool = False):
        """remember: keep what was delivered in the run's cache (kldiag.live.sent), so that a restart sends
        only what is new (`kldiag watch --notify`); else in memory, for this Notifier's life."""
        self.__url = resolve_url(url)  # name-mangled: not in repr(), vars() shows it mangled only
        self.run, self.config = run, config
        self.sent = self.failed = self.dropped = 0
        self._delivered = SentLog.for_run(run, self.__url) if remember and run else SentLog(None)
        self._pending: dict[tuple, dict] = {}  # queued, not yet delivered
        self._given_up: dict[tuple, dict] = {}  # tried and failed: queued again at the next diagnosis()
        self._first = not self._delivered.existed  # the first look: episodes already over are history, not news
        self._guard = threading.Lock()
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, config.max_queue))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._work, name="kldiag-notify", daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        return f"Notifier(url=<hidden>, run={self.run!r}, sent={self.sent}, failed={self.failed})"

    # -- the caller's thread: never blocks, never raises
    def diagnosis(self, dg: Diagnosis | None) -> int:
        """Queue the causes (warning or critical) and critical episodes not sent before; how many."""
        n = self._retry()
        if dg is None:
            return n
        if self._first:  # what ended before this destination's first look is recorded, never sent
            self._first = False
            for e in dg.episodes:
                if e.severity == "critical" and e.end is not None:
                    self._delivered.add(("episode", e.kind, e.start))
        for c in dg.causes:
            if c.severity in NOTIFY_SEVERITIES:
                n += self._send(("cause", c.cause), lambda c=c: cause_message(c, self.run))
        for e in dg.episodes:
            if e.severity == "critical":
                fix = next((c.fix for c in dg.causes if c.severity == "critical"), "")
                n += self._send(("episode", e.kind, e.start), lambda e=e, fix=fix: episode_message(e, self.run, fix))
        return n

    def episode(self, e: Episode, run: str | None = None) -> int:
        """Queue one episode (any severity: the guard's `on` chose it) unless sent before."""
        return self._send(("episode", e.kind, e.start), lambda: episode_message(e, self.run if run is None else run))

    def _retry(self) -> int:
        with self._guard:
            again, self._given_up = self._given_up, {}
        return sum(self._send(key, lambda m=msg: m) for key, msg in again.items())

    def _send(self, key: tuple, build) -> int:
        try:
            with self._guard:
                if key in self._delivered or key in self._pending:
                    return 0
                msg = build()
                self._queue.put_nowait((key, msg))
                self._pending[key] = msg
            return 1
        except queue.Full:
            self.dropped += 1
            log.warning("kldiag notify: queue full (%d messages); a message was dropped", self.config.max_queue)
        except Exception as ex:  # a message that cannot be built is skipped, never raised into training
            self.failed += 1
            log.warning("kldiag notify: message skipped (%s)", type(ex).__name__)
        return 0

    def close(self, timeout: float | None = None) -> None:
        """Send what is queued (waiting at most `timeout` seconds, default timeout_s), then stop; each
        message still unsent is named in a warning (a remembering Notifier's next start sends it)."""
        self._stop.set()
        self._thread.join(self.config.timeout_s if timeout is None else timeout)
        with self._guard:
            left = {**self._given_up, **self._pending}
        then = "the next start sends it" if self._delivered.path is not None else "it is lost"
        for msg in left.values():
            log.warning("kldiag notify: message for %s not sent before exit; %s", msg.get("cause"), then)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every queued message was sent or given up (True), at most `timeout` seconds."""
        end = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < end:
            time.sleep(0.01)
        return not self._queue.unfinished_tasks

    # -- the worker
    def _work(self) -> None:
        last = -float("inf")
        while not (self._stop.is_set() and self._queue.empty()):
            try:
                key, msg = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            delivered = False
            try:
                time.sleep(max(0.0, last + self.config.min_interval_s - time.monotonic()))
                delivered = self._deliver(msg)
                last = time.monotonic()
            except Exception as ex:  # never lets the thread die on one message
                self.failed += 1
                log.warning("kldiag notify: message for %s not sent (%s)", msg.get("cause"), type(ex).__name__)
            finally:
                with self._guard:
                    self._pending.pop(key, None)
                    if delivered:
                        self._delivered.add(key)
                    else:
                        self._given_up[key] = msg
                self._queue.task_done()

    def _deliver(self, msg: dict) -> bool:
        body = json.dumps(msg, default=str).encode()
        why = ""
        for attempt in range(self.config.retries + 1):
            if attempt:
                time.sleep(self.config.backoff_s * 2 ** (attempt - 1))
            req = urllib.request.Request(self.__url, data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=self.config.timeout_s) as r:  # noqa: S310 - http(s) only
                    r.read()
                self.sent += 1
                return True
            except urllib.error.HTTPError as ex:
                why = f"HTTP {ex.code}"
                if ex.code < 500 and ex.code != 429:
                    break  # the endpoint refuses this message: retrying will not change that
            except (urllib.error.URLError, OSError) as ex:  # refused, timed out, DNS: no URL in the text
                why = type(getattr(ex, "reason", ex)).__name__
        self.failed += 1
        log.warning("kldiag notify: message for %s not delivered (%s); given up for now, tried again at the "
                    "next look", msg.get("cause"), why)
        return False
