"""Plain-text rendering of a Diagnosis (kldiag analyze, report, watch)."""

from __future__ import annotations

import textwrap

from kldiag.analysis.rules.early import EARLY_KINDS
from kldiag.diagnosis.types import Diagnosis

MARK = {"healthy": "HEALTHY", "warning": "WARNING", "unstable": "UNSTABLE"}


def verdict_line(dg: Diagnosis) -> str:
    """'verdict: UNSTABLE: k3_weight_blowup from step 30 (notes: engine_mismatch from step 0)'."""
    def named(causes) -> str:
        return ", ".join(c.cause + (f" from step {c.onset}" if c.onset is not None else "") for c in causes)

    main = [c for c in dg.causes if c.severity != "info"]
    notes = [c for c in dg.causes if c.severity == "info"]
    line = f"verdict: {MARK[dg.verdict]}" + (f": {named(main)}" if main else "")
    if notes:
        line += f" (notes: {named(notes)})"
    if not main and dg.episodes:
        line += f" ({len(dg.episodes)} alert episode(s), no cause of instability)"
    return line + early_note(dg)


def early_note(dg: Diagnosis) -> str:
    """'; early warning: early_weight_trend from step 124 (ongoing)': the early-warning episodes (warning
    severity) of a run that is not unstable yet; '' when there is none (docs/metrics.md, "Early warning")."""
    early = [e for e in dg.episodes if e.kind in EARLY_KINDS and e.severity == "warning"]
    if dg.verdict == "unstable" or not early:
        return ""
    return "; early warning: " + ", ".join(f"{e.kind} from step {e.start}" + (" (ongoing)" if e.end is None else "")
                                           for e in early)


def format_diagnosis(dg: Diagnosis, width: int = 100) -> str:
    """The verdict, then each cause: its summary, onset and fix (wrapped at `width`)."""
    lines = [verdict_line(dg)]
    for c in dg.causes:
        lines.append(f"  {c.cause} [{c.severity}]" + (f", onset step {c.onset}" if c.onset is not None else ""))
        lines += textwrap.wrap(c.summary, width, initial_indent="    ", subsequent_indent="    ")
        lines += textwrap.wrap("fix: " + c.fix, width, initial_indent="    ", subsequent_indent="         ")
    return "\n".join(lines)
