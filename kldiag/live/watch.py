"""The watcher behind `kldiag watch`: follows a run incrementally and renders what changed."""

from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kldiag.analysis import analyze as analyze_run
from kldiag.analysis.types import AnalysisConfig
from kldiag.diagnosis import diagnose
from kldiag.diagnosis.core import reducers as diagnosis_reducers
from kldiag.diagnosis.text import verdict_line
from kldiag.diagnosis.types import Diagnosis, Episode
from kldiag.errors import EmptyRunError, NotARunError
from kldiag.fmt import num
from kldiag.format import open_run


@dataclass
class Update:
    """What one poll found: new parts, the diagnosis, episodes that started or ended."""

    parts_new: int = 0  # parts this watcher had not seen at its last look (every part at its first)
    first: bool = False  # the watcher's first analysed look: what it found is the run's state, not news
    analysis: Any = None
    diagnosis: Diagnosis | None = None
    started: list[Episode] = field(default_factory=list)
    ended: list[Episode] = field(default_factory=list)
    waiting: str = ""  # why there is nothing to show yet (no run.json, no part, no readable row)
    unreadable: list[str] = field(default_factory=list)  # with `waiting`: parts published but none readable


class Watcher:
    """Follows a run incrementally; `poll()` returns an Update (no printing here)."""

    def __init__(self, run: str, config=None, analyze: Callable[..., Any] | None = None):
        self.run = run
        self.config = config or AnalysisConfig()
        # the diagnosis's reducers ride along: one read of each new part, cached like the analysis
        self._analyze = analyze or functools.partial(analyze_run, reducers=diagnosis_reducers())
        self.keys: tuple[str, ...] = ()
        self.known: dict[tuple[str, int], Episode] = {}  # (kind, start) -> last seen episode

    def _part_keys(self) -> tuple[str, ...]:
        return tuple(p.key for p in open_run(self.run).parts())

    def poll(self) -> Update:
        try:
            keys = self._part_keys()
        except NotARunError as e:
            return Update(waiting=f"no run yet ({e})")
        if not keys:
            return Update(waiting="no part published yet")
        if keys == self.keys:
            return Update()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                a = self._analyze(self.run, self.config)
            except EmptyRunError as e:
                return Update(waiting=str(e), unreadable=list(getattr(e, "skipped", [])))
            dg = diagnose(a)
        up = Update(parts_new=len(set(keys) - set(self.keys)), first=not self.keys, analysis=a, diagnosis=dg)
        self.keys = keys
        for e in dg.episodes:
            old = self.known.get((e.kind, e.start))
            if old is None:
                up.started.append(e)
            if e.end is not None and (old is None or old.end is None):
                up.ended.append(e)
            self.known[(e.kind, e.start)] = e
        return up


FIGURES = (("k3_mean", "k3"), ("k3_is_mean", "k3_is"), ("weight_k3_abs_max", "max|w_k3|"),
           ("weight_k3_is_abs_max", "max|w_k3_is|"), ("blame_share", "blame"), ("flagged_frac", "flagged"),
           ("rho_ess", "rho_ess"), ("mismatch_kl", "mismatch_kl"), ("nonfinite_count", "nonfinite"))


def step_line(analysis) -> str:
    """The latest step's key figures on one line."""
    row = analysis.steps.slice(analysis.steps.num_rows - 1, 1).to_pylist()[0]
    figs = "  ".join(f"{label} {num(row.get(col), 3)}" for col, label in FIGURES if col in row)
    return f"step {row['step']}  tokens {row['tokens']:,}  {figs}"


def episode_line(e: Episode, what: str) -> str:
    return f"{what} [{e.severity}] {e.kind}: {e.message}"


def render(up: Update, last_verdict: str | None) -> list[str]:
    """The lines one Update prints."""
    if up.diagnosis is None:
        return []
    if up.first:  # a (re)start: the run's state so far, no past episode told as news
        return [f"{time.strftime('%H:%M:%S')} {step_line(up.analysis)}  ({up.parts_new} part(s))",
                *first_look_lines(up), verdict_line(up.diagnosis)]
    lines = [f"{time.strftime('%H:%M:%S')} {step_line(up.analysis)}  ({up.parts_new} new part(s))"]
    lines += [episode_line(e, ">> started") for e in up.started]
    lines += [episode_line(e, "<< ended") for e in up.ended]
    if up.diagnosis.verdict != last_verdict:
        lines.append(verdict_line(up.diagnosis))
    return lines


def first_look_lines(up: Update) -> list[str]:
    """The first look's episodes: how many ended before it, and each one still going on."""
    eps = up.diagnosis.episodes
    ongoing = [e for e in eps if e.end is None]
    if not eps:
        return []
    head = [f"episodes so far: {len(eps)} ({len(eps) - len(ongoing)} ended, {len(ongoing)} ongoing)"]
    return head + [episode_line(e, "== ongoing") for e in ongoing]
