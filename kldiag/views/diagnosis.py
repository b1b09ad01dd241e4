"""What the dashboard shows of a Diagnosis (the app only displays these)."""

from __future__ import annotations

import pandas as pd

from kldiag.diagnosis.types import Diagnosis

COLOR = {"healthy": "green", "warning": "orange", "unstable": "red"}  # Streamlit markdown colours


def headline(dg: Diagnosis) -> str:
    """Markdown: '### :red[Verdict: UNSTABLE]' then the causes and their onsets, or why none."""
    title = f"### :{COLOR[dg.verdict]}[Verdict: {dg.verdict.upper()}]"
    main = [c for c in dg.causes if c.severity != "info"]
    if not main:
        return f"{title}\nNo cause of instability found" + (
            f" ({len(dg.episodes)} alert episode(s), see below)." if dg.episodes else ".")
    named = ", ".join(f"`{c.cause}`" + (f" from step {c.onset}" if c.onset is not None else "") for c in main)
    return f"{title}\nCauses: {named}"


def md(text: str) -> str:
    """Markdown-safe text: * and _ escaped outside `code` spans (pi_theta, rho * k3 stay literal)."""
    parts = text.split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("\\", "\\\\").replace("*", "\\*").replace("_", "\\_")
    return "`".join(parts)


def cause_onsets(dg: Diagnosis) -> list[tuple[int, str]]:
    """(step, label) of each cause's onset (info-level notes left out), one line per step."""
    by_step: dict[int, list[str]] = {}
    for c in dg.causes:
        if c.onset is not None and c.severity != "info":
            by_step.setdefault(int(c.onset), []).append(c.cause)
    return [(s, ", ".join(names)) for s, names in sorted(by_step.items())]


def episodes_frame(dg: Diagnosis) -> pd.DataFrame:
    """One row per episode: kind, severity, start, end (None: ongoing), peak, message."""
    cols = ["kind", "severity", "start", "end", "peak_step", "peak_value", "steps", "message"]
    return pd.DataFrame([{k: getattr(e, k) for k in cols} for e in dg.episodes], columns=cols)


ALERT_ORDER = ("kind", "severity", "start", "end", "message", "peak_step", "peak_value", "metric", "value", "baseline",
               "steps", "step")


def alerts_frame(alerts: pd.DataFrame) -> pd.DataFrame:
    """The alerts table for display: the message beside the episode's span (not past the right edge), an
    ongoing episode's end written "ongoing" (not None), `step` (the start again) last."""
    if alerts.empty:
        return alerts
    out = alerts[[c for c in ALERT_ORDER if c in alerts.columns]].copy()
    if "end" in out:
        out["end"] = [("ongoing" if e is None or e != e else str(int(e))) for e in out["end"].astype(object)]
    return out
