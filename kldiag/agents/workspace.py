"""The roots an agent may read, the runs under them, and the analyses of those runs (kept in memory).

A run path is absolute or relative to a root (the first root where it exists); it is resolved
(symlinks, `..`) before the check, so a link or a `..` out of the roots is refused like any
other path outside them. A root may also be an object-store prefix (s3://bucket/runs): a URI run
must start with it and hold no `..` segment.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kldiag import format as F
from kldiag.agents.paging import AgentToolError
from kldiag.analysis.types import Analysis, AnalysisConfig
from kldiag.diagnosis import diagnose
from kldiag.diagnosis.types import Diagnosis
from kldiag.report.summary import analyze_run, summary

KEEP_ANALYSES = 4  # analyses kept in memory (each is a run's tables; a changed run is analysed again)
SKIP_DIRS = {".git", ".kldiag", ".venv", "node_modules", "__pycache__"}


@dataclass
class Analysed:
    analysis: Analysis
    diagnosis: Diagnosis
    summary: dict[str, Any]  # `kldiag analyze --json`


class Workspace:
    """The roots (default: the current directory) and an in-memory cache of analyses.

    use_cache: the engine's on-disk cache (RUN/.kldiag/), as `kldiag analyze` uses it; False
    writes nothing anywhere.
    """

    def __init__(self, roots: list[str | os.PathLike] | None = None, use_cache: bool = True):
        self.roots: list[Path | str] = [_root(r) for r in (roots or [os.getcwd()])]
        self.config = AnalysisConfig(use_cache=use_cache)
        self._analysed: OrderedDict[tuple, Analysed] = OrderedDict()
        self._lock = threading.Lock()

    # -- paths

    def resolve(self, path: str, what: str = "run") -> Path | str:
        """The absolute path (or URI) of `path` if it lies inside a root, else AgentToolError."""
        path = str(path).strip()
        if not path:
            raise AgentToolError(f"give the {what} as a path, absolute or relative to a root ({self.describe()})")
        if F.is_uri(path):
            if ".." not in path.split("/") and any(isinstance(r, str) and path.rstrip("/").startswith(r + "/")
                                                   for r in self.roots):
                return path.rstrip("/")
            raise AgentToolError(f"{what} {path!r} is outside the roots ({self.describe()})")
        candidates = [Path(path)] if os.path.isabs(path) else [r / path for r in self.roots if isinstance(r, Path)]
        outside = None
        for c in candidates:
            real = c.resolve()
            if not any(_inside(real, r) for r in self.roots if isinstance(r, Path)):
                outside = real
            elif real.is_file() and what == "run":  # a run is a directory: name the one to pass
                parent = real.parent if (real.parent / F.MANIFEST).is_file() else None
                hint = f"pass its directory {self.label(parent)!r}" if parent else "pass the run's directory"
                raise AgentToolError(f"run {path!r} is a file, not a run directory: {hint}")
            elif real.exists():
                return real
        if outside is not None:
            raise AgentToolError(f"{what} {path!r} resolves to {outside}, outside the roots ({self.describe()})")
        raise AgentToolError(f"{what} {path!r} does not exist under the roots ({self.describe()}); "
                             "list_runs shows the runs")

    def root(self, root: str | None) -> Path | str:
        """A root, or a directory inside one (None: the first root)."""
        return self.roots[0] if root is None or root == "" else self.resolve(root, "root")

    def describe(self) -> str:
        return ", ".join(str(r) for r in self.roots)

    def label(self, path: Path | str) -> str:
        """`path` relative to its root (how the tools name runs back to the agent)."""
        for r in self.roots:
            if isinstance(r, Path) and isinstance(path, Path) and _inside(path, r):
                return str(path.relative_to(r)) or "."
        return str(path)

    # -- analyses

    def analysed(self, run: str) -> Analysed:
        """The analysis, diagnosis and JSON summary of a run (analysed again when its parts changed)."""
        path = self.resolve(run)
        F.read_manifest(path)  # a NotARunError naming the fix, before any analysis
        key = (str(path), tuple(p.key for p in F.list_parts(path)))
        with self._lock:
            hit = self._analysed.get(key)
            if hit is not None:
                self._analysed.move_to_end(key)
                return hit
        a = analyze_run(path, self.config)
        dg = diagnose(a)
        hit = Analysed(a, dg, summary(a, dg))
        with self._lock:
            self._analysed[key] = hit
            while len(self._analysed) > KEEP_ANALYSES:
                self._analysed.popitem(last=False)
        return hit


def _root(r: str | os.PathLike) -> Path | str:
    if F.is_uri(str(r)):
        return str(r).rstrip("/")
    p = Path(r).expanduser().resolve()
    if not p.is_dir():
        raise AgentToolError(f"root {r!r} is not a directory: pass --root DIR with an existing directory")
    return p


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def find_runs(root: Path, max_depth: int = 6, max_dirs: int = 20_000) -> list[Path]:
    """Run directories (holding a run.json) under `root`, sorted; a run's own subdirectories and
    hidden/tool directories are not searched, nor symlinked directories (they may leave the root)."""
    found: list[Path] = []
    seen = 0
    base = len(root.parts)
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        seen += 1
        here = Path(dirpath)
        if F.MANIFEST in filenames:
            found.append(here)
            dirnames[:] = []
            continue
        if seen >= max_dirs or len(here.parts) - base >= max_depth:
            dirnames[:] = []
            continue
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
    return sorted(found)
