"""Cause `data_missing`: steps of the run whose rows the analysis never saw, so every figure and the
verdict speak only for the rest.

Two sources (the analysis keeps both facts: `Analysis.lost`, `Analysis.spans`, kldiag/analysis/runtime/lost.py):

- a part that is unreadable, 0 bytes or 0 rows: its file name gives its rank and steps
  (docs/format.md, "File naming and publishing");
- a gap inside a rank: a step on the run's step grid, between the rank's first and last recorded
  step, with no row of that rank. The grid is the run's recorded steps' stride (the greatest common
  divisor of their differences: a recorder with `every_n_steps = n` records multiples of n only,
  so its skipped steps are off the grid and never gaps). Where the recorder samples sequences
  (`seq_fraction < 1`), a step can legitimately hold no sampled sequence, so gaps are not judged,
  only lost parts; nor when the grid from the first to the last step is longer than MAX_GRID (steps
  that jump by far more than their stride). Per-rank rows come from `steps_by_rank` (analysis with per_rank), from the steps
  table in a one-rank run, else from the step ranges of the rank's parts that were read.

Steps past a rank's last published part are not gaps: a live run's newest part is still being
written under a temp name, and ranks publish at different times. Rows of a lost part that a later
attempt of its rank re-recorded (a restart, docs/format.md "Attempts") are not missing.
Severity: warning, critical when the missing steps exceed DiagnosisConfig.missing_critical_share of
the run's steps (its grid from the first to the last step of any part).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kldiag.diagnosis.types import Cause, DiagnosisConfig
from kldiag.frameworks import fix_for

CAUSE = "data_missing"
LISTED = 200  # parts and gaps listed in the evidence at most (the counts are always whole)
MAX_GRID = 1 << 20  # grid steps from the first to the last step past which gaps are not judged (memory, time)


@dataclass
class Coverage:
    """What is missing: lost parts and gaps (evidence dicts), the missing steps, the run's grid."""

    parts: list[dict]
    gaps: list[dict]
    missing: np.ndarray  # int64: distinct steps where some rank lost rows
    expected: int  # grid steps from the run's first to its last step
    stride: int
    judged_gaps: bool  # False when sequence sampling makes an empty step legitimate, or the grid is too long
    not_judged: str = ""  # why gaps were not judged


def _grid(lo: int, hi: int, origin: int, stride: int) -> np.ndarray:
    """Steps origin + k * stride inside [lo, hi]."""
    first = lo + (origin - lo) % stride
    return np.arange(first, hi + 1, stride, dtype=np.int64)


def _grid_len(lo: int, hi: int, origin: int, stride: int) -> int:
    """len(_grid(lo, hi, origin, stride)), without making it."""
    first = lo + (origin - lo) % stride
    return max(0, (hi - first) // stride + 1)


def _runs(steps: np.ndarray, stride: int) -> list[tuple[int, int, int]]:
    """(first, last, count) of each run of consecutive grid steps."""
    if not len(steps):
        return []
    cut = np.flatnonzero(np.diff(steps) > stride) + 1
    return [(int(s[0]), int(s[-1]), len(s)) for s in np.split(steps, cut)]


def _present(analysis, rank: int, one_rank: bool, spans, origin: int, stride: int) -> np.ndarray:
    """Steps holding rows of `rank` (module doc: by rank, the steps table, or the parts' ranges)."""
    by_rank = analysis.steps_by_rank
    if by_rank is not None and by_rank.num_rows:
        r = by_rank.column("rank").to_numpy()
        return np.unique(by_rank.column("step").to_numpy()[r == rank])
    if one_rank:
        return np.unique(analysis.steps.column("step").to_numpy())
    got = [_grid(a, b, origin, stride) for rk, _, a, b in spans if rk == rank]
    return np.unique(np.concatenate(got)) if got else np.zeros(0, np.int64)


def _hulls(analysis) -> dict[tuple[int, int], tuple[int, int]]:
    """(rank, attempt) -> [first step, last step] over its parts, read or lost (which steps a restart re-recorded)."""
    hulls: dict[tuple[int, int], tuple[int, int]] = {}
    for rk, at, a, b in [*analysis.spans, *((x.rank, x.attempt, x.step_min, x.step_max) for x in analysis.lost)]:
        lo, hi = hulls.get((rk, at), (a, b))
        hulls[(rk, at)] = (min(lo, a), max(hi, b))
    return hulls


def _lost_steps(x, hulls: dict, origin: int, stride: int) -> np.ndarray:
    """The grid steps of lost part `x` (its first and last step always), less those a later attempt of its
    rank re-recorded."""
    cover = np.union1d(_grid(x.step_min, x.step_max, origin, stride), [x.step_min, x.step_max])
    for (rk, at), (lo, hi) in hulls.items():
        if rk == x.rank and at > x.attempt:
            cover = cover[(cover < lo) | (cover > hi)]
    return cover


def _holes(analysis, rank: int, ranks: list[int], lost: np.ndarray, origin: int, stride: int) -> np.ndarray:
    """Grid steps between the rank's first and last step with no row of it, other than its lost parts' steps."""
    ends = [(b[2], b[3]) for b in analysis.spans if b[0] == rank]
    if not ends:
        return np.zeros(0, np.int64)
    ends += [(x.step_min, x.step_max) for x in analysis.lost if x.rank == rank]
    lo, hi = min(e[0] for e in ends), max(e[1] for e in ends)
    present = _present(analysis, rank, len(ranks) == 1, analysis.spans, origin, stride)
    return np.setdiff1d(np.setdiff1d(_grid(lo, hi, origin, stride), present), lost)


def coverage(analysis) -> Coverage:
    """The lost parts and the gaps of the run (module doc); empty lists when nothing is missing."""
    lost, spans = list(analysis.lost), list(analysis.spans)
    judged = float(analysis.manifest.sampling.get("seq_fraction") or 1.0) >= 1.0
    steps = np.unique(analysis.steps.column("step").to_numpy()).astype(np.int64)
    diffs = np.diff(steps)
    stride = int(np.gcd.reduce(diffs)) if len(diffs) else int(analysis.manifest.sampling.get("every_n_steps") or 1)
    bounds = [(b[2], b[3]) for b in spans] + [(x.step_min, x.step_max) for x in lost]
    if not bounds:
        return Coverage([], [], np.zeros(0, np.int64), 0, stride, judged)
    origin = int(steps[0]) if len(steps) else lost[0].step_min
    lo, hi = min(b[0] for b in bounds), max(b[1] for b in bounds)
    grid = _grid_len(lo, hi, origin, stride)
    why = "" if judged else "the recorder samples sequences, seq_fraction < 1"
    if judged and grid > MAX_GRID:  # steps that jump by far more than their stride (e.g. 0, 1, 2,000,000)
        judged, why = False, f"the step grid spans {grid:,} steps (stride {stride}), more than {MAX_GRID:,}"
    ranks = sorted({b[0] for b in spans} | {x.rank for x in lost})
    hulls = _hulls(analysis)
    parts, gaps, missing = [], [], [np.zeros(0, np.int64)]
    for rank in ranks:
        taken = [(x, _lost_steps(x, hulls, origin, stride)) for x in lost if x.rank == rank]
        taken = [(x, cover) for x, cover in taken if len(cover)]  # all re-recorded by a restart: nothing lost
        parts += [{**x.to_dict(), "steps": len(cover)} for x, cover in taken]
        gone = np.unique(np.concatenate([c for _, c in taken])) if taken else np.zeros(0, np.int64)
        hole = _holes(analysis, rank, ranks, gone, origin, stride) if judged else np.zeros(0, np.int64)
        gaps += [{"rank": rank, "first": a, "last": b, "steps": n} for a, b, n in _runs(hole, stride)]
        missing += [gone, hole]
    gone = np.unique(np.concatenate(missing))
    off_grid = int(np.count_nonzero((gone - origin) % stride)) if len(gone) else 0  # a lost part's own ends
    return Coverage(parts, gaps, gone, grid + off_grid, stride, judged, why)


def _where(cov: Coverage) -> str:
    said = [f"{p['part']} (rank {p['rank']}, steps {p['step_min']}-{p['step_max']}) is {p['reason']}"
            for p in cov.parts[:5]]
    said += [f"rank {g['rank']} has no rows at step" + (f"s {g['first']}-{g['last']}" if g["steps"] > 1
                                                         else f" {g['first']}") for g in cov.gaps[:5]]
    more = len(cov.parts) + len(cov.gaps) - len(said)
    return "; ".join(said) + (f"; and {more} more" if more > 0 else "")


def data_missing(analysis, ctx) -> list[Cause]:
    """Cause data_missing (module doc): warning, critical past missing_critical_share of the steps."""
    found = cause_of(analysis, ctx.config)
    return [found] if found is not None else []


def cause_of(analysis, config: DiagnosisConfig = DiagnosisConfig()) -> Cause | None:
    """The data_missing Cause of an analysed run, None when nothing is missing (also for faces that do
    not diagnose, such as `kldiag audit --fail-on data_missing`)."""
    cov = coverage(analysis)
    if not cov.parts and not cov.gaps:
        return None
    n, share = len(cov.missing), len(cov.missing) / max(cov.expected, 1)
    limit = config.missing_critical_share
    sampling = analysis.manifest.sampling
    ev = {"parts": cov.parts[:LISTED], "gaps": cov.gaps[:LISTED], "parts_lost": len(cov.parts),
          "gap_count": len(cov.gaps), "steps_missing": n, "steps_expected": cov.expected, "share": share,
          "step_stride": cov.stride, "every_n_steps": sampling.get("every_n_steps", 1),
          "seq_fraction": sampling.get("seq_fraction", 1.0), "gaps_judged": cov.judged_gaps,
          "critical_share": limit}
    summary = (f"rows of {n} of the run's {cov.expected} steps ({share:.0%}) are missing: {_where(cov)}. "
               "Every figure and the verdict cover only the steps that were read")
    if not cov.judged_gaps:
        summary += f" (gaps between steps are not judged: {cov.not_judged})"
    fix = fix_for(CAUSE, analysis.manifest)
    severity = "critical" if share > limit else "warning"
    return Cause(CAUSE, int(cov.missing[0]) if n else None, severity, ev, fix, summary)


