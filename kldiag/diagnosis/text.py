"""Plain-text rendering of a Diagnosis (kldiag analyze, report, watch)."""

from __future__ import annotations

import textwrap

from kldiag.diagnosis.types import Diagnosis

MARK = {"healthy": "HEALTHY", "warning": "WARNING", "unstable": "UNSTABLE"}


def verdict_line(dg: Diagnosis) -> str:
    """'verdict: UNSTABLE: k3_weight_blowup from step 30, numerical_fault from step 5'."""
    if not dg.causes:
        extra = f" ({len(dg.episodes)} alert episode(s), no cause identified)" if dg.episodes else ""
        return f"verdict: {MARK[dg.verdict]}{extra}"
    named = ", ".join(c.cause + (f" from step {c.onset}" if c.onset is not None else "") for c in dg.causes)
    return f"verdict: {MARK[dg.verdict]}: {named}"


def format_diagnosis(dg: Diagnosis, width: int = 100) -> str:
    """The verdict, then each cause: its summary, onset and fix (wrapped at `width`)."""
    lines = [verdict_line(dg)]
    for c in dg.causes:
        lines.append(f"  {c.cause} [{c.severity}]" + (f", onset step {c.onset}" if c.onset is not None else ""))
        lines += textwrap.wrap(c.summary, width, initial_indent="    ", subsequent_indent="    ")
        lines += textwrap.wrap("fix: " + c.fix, width, initial_indent="    ", subsequent_indent="         ")
    return "\n".join(lines)
