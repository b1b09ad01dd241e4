"""Checks of the command line's paths, ports and numbers, done before a subcommand reads or writes
anything: each raises KldiagError (or, as an argparse `type=`, ArgumentTypeError) with one line that
names the fix, so a bad input never leaves a traceback, a half-written output or a changed run."""

from __future__ import annotations

import argparse
import socket
from pathlib import Path

from kldiag.errors import KldiagError

RUN_MANIFEST = "run.json"
REPORT_MARK = "<title>kldiag report:"  # what kldiag.report.render writes near the top of every report


def _is_uri(text: str) -> bool:
    return "://" in str(text)


def run_dir(text: str) -> str:
    """argparse type of a RUN argument: a local path that is a file is refused here (a run is a
    directory); a missing path or a URI is left to kldiag.format.open_run, which names the fix."""
    if _is_uri(text) or not Path(text).is_file():
        return text
    parent = Path(text).parent
    if Path(text).name == RUN_MANIFEST or (parent / RUN_MANIFEST).is_file():
        raise argparse.ArgumentTypeError(f"{text} is a file, not a run directory: pass its directory {parent}")
    raise argparse.ArgumentTypeError(f"{text} is a file, not a run directory: pass the directory given to "
                                     "kldiag.Recorder (the one holding run.json)")


def inside(path: str | Path, run: str) -> bool:
    """Whether the local `path` is the run directory or lies under it."""
    if _is_uri(run) or _is_uri(str(path)):
        return False
    p, r = Path(path).resolve(), Path(run).resolve()
    return p == r or r in p.parents


def out_dir(path: str | Path, flag: str, run: str | None = None) -> Path:
    """An output directory: new or an existing directory, never a file, never inside the run."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise KldiagError(f"{flag} {path} is a file: pass a directory (new, or one holding earlier output)")
    if run is not None and inside(path, run):
        raise KldiagError(f"{flag} {path} is inside the run {run}: pass a directory outside it "
                          "(a run's files stay as recorded)")
    return path


def out_file(path: str | Path, flag: str, run: str, mark: str = REPORT_MARK) -> Path:
    """An output file: new, or an earlier kldiag output (its first 4 KiB hold `mark`) that is replaced;
    never a directory, never another file, never inside the run."""
    path = Path(path)
    if path.is_dir():
        raise KldiagError(f"{flag} {path} is a directory: pass a file name, e.g. {flag} {path / 'report.html'}")
    if inside(path, run):
        raise KldiagError(f"{flag} {path} is inside the run {run}: write it outside the run "
                          "(a run's files stay as recorded)")
    if path.exists():
        with open(path, "rb") as f:
            head = f.read(4096).decode("utf-8", "replace")
        if mark not in head:
            raise KldiagError(f"{flag} {path} exists and is not a kldiag report: pass a new file name "
                              "(an earlier report is replaced, any other file kept)")
    return path


def port(text: str) -> int:
    """argparse type of --port: an integer in 1..65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number: pass 1 to 65535") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port number: pass 1 to 65535")
    return value


def positive(kind: type = float):
    """argparse type: a number of `kind` above 0."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text} must be above 0")
        return value
    parse.__name__ = f"positive {kind.__name__}"
    return parse


def non_negative(text: str) -> float:
    """argparse type: a float at or above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text} must be 0 or more")
    return value


def _bindable(host: str, number: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        # as the server binds (SO_REUSEADDR on POSIX): a port in TIME_WAIT is free, a listening one is not
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, number))
        except OSError:
            return False
    return True


def check_port(host: str, number: int, flag: str = "--port") -> None:
    """Raise KldiagError when host:number cannot be bound (in use, or a host not of this machine),
    naming a free port to pass instead. Checked before anything is announced."""
    try:
        socket.getaddrinfo(host, number)
    except OSError as e:
        raise KldiagError(f"--host {host} cannot be resolved ({e.strerror}): pass an address of this machine, "
                          "e.g. --host 127.0.0.1") from None
    if _bindable(host, number):
        return
    free = next((p for p in range(number + 1, min(number + 200, 65536)) if _bindable(host, p)), None)
    hint = f", e.g. {flag} {free}" if free is not None else ""
    raise KldiagError(f"port {number} on {host} is in use (another dashboard or server holds it) or not bindable: "
                      f"pass a free one with {flag}{hint}")
