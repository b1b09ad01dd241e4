"""What `kldiag analyze` and `kldiag report` print about what the run recorded, and what it lets them show:
the coverage lines (which optional inputs each step has), the staleness section (figures by how many updates
old the weights behind a sample were) and the per-step table's columns, chosen from what the run measured.

A run without logp_ref gets a step table of the figures it has (engine mismatch, drift, rho, routing,
staleness) instead of columns of dashes; an input no step has is named with how to record it.
"""

from __future__ import annotations

import html
from typing import Any

from kldiag.analysis.core.flagged import flagged_text, run_flagged
from kldiag.analysis.reducers.coverage_table import coverage_of
from kldiag.analysis.reducers.routing import routing_of
from kldiag.analysis.reducers.staleness import OPSM_DELTA, StalenessReducer
from kldiag.analysis.reducers.staleness import summary as staleness_summary
from kldiag.analysis.runtime.runner import reduced
from kldiag.fmt import num
from kldiag.views.leads import HOW_TO_RECORD, INPUT_NAMES, how_to_record, needs

REF_COLUMNS = ("step", "tokens", "k3_mean", "k3_is_mean", "weight_k3_abs_max", "weight_k3_abs_p99",
               "blame_share", "flagged_frac", "nonfinite_count", "rho_max")
NO_REF_COLUMNS = ("step", "tokens", "mismatch_kl", "drift_abs_mean", "rho_mean", "rho_max", "rho_clip_frac",
                  "nonfinite_count")

def has_reference(steps) -> bool:
    """Whether some step has a K3 mean (logp_ref recorded)."""
    return "k3_mean" in steps.column_names and steps.column("k3_mean").null_count < steps.num_rows


def flagged_line(steps) -> str:
    """'flagged: ...' as every face words it; on a run without logp_ref, that the flags were not measured
    (a 0 there would read as a clean run) and how many non-finite or invalid log-probs it has."""
    if steps.num_rows and not has_reference(steps):
        bad = sum(int(steps.column(c).to_numpy(zero_copy_only=False).sum()) for c in ("nonfinite_count",
                                                                                     "invalid_count"))
        return (f"flagged: not measured: the token flags need logp_ref ({HOW_TO_RECORD['logp_ref']}); "
                f"non-finite or invalid log-probs: {bad:,}")
    return "flagged: " + flagged_text(*run_flagged(steps))


def staleness_of(analysis) -> dict[str, Any]:
    return staleness_summary(reduced(analysis, StalenessReducer()), analysis.config.opsm_delta or OPSM_DELTA)


def step_rows(analysis) -> tuple[tuple[str, ...], list[dict[str, Any]]]:
    """The per-step table's columns and rows: the KL columns when logp_ref was recorded, else what the run
    measured; with routes, the share routed differently (`routed_differ`); with versions, the mean staleness."""
    steps = analysis.steps
    columns = REF_COLUMNS if has_reference(steps) else NO_REF_COLUMNS
    rows = steps.select(list(columns)).to_pylist()
    extra: dict[str, dict[int, Any]] = {}
    routing = routing_of(analysis)
    if routing["routed"] and routing["compared_tokens"]:
        extra["routed_differ"] = {r["step"]: r["differ_share"] for r in routing["steps"]}
    stale = staleness_of(analysis)
    if stale["versions"]:
        extra["staleness_mean"] = {r["step"]: r["staleness_mean"] for r in stale["steps"]}
    for row in rows:
        row.update({k: by_step.get(row["step"]) for k, by_step in extra.items()})
    return (*columns, *extra), rows


def coverage_lines(cov: dict[str, Any]) -> list[str]:
    """One line of what every step has, one of what some steps have, one per input no step has (with how to
    record it), and the recorder's note on routes when it wrote one."""
    inputs = cov["inputs"]
    full = [INPUT_NAMES[k] for k, v in inputs.items() if v["of"] and v["steps"] == v["of"]]
    part = [f"{INPUT_NAMES[k]} ({v['steps']} of {v['of']} steps)" for k, v in inputs.items()
            if 0 < v["steps"] < v["of"]]
    lines = ["coverage: every step has " + (", ".join(full) or "none of the optional inputs")]
    if part:
        lines.append("  some steps have " + ", ".join(part))
    absent = [k for k, v in inputs.items() if v["of"] and not v["steps"]]
    if absent:
        lines.append("  not recorded: " + ", ".join(INPUT_NAMES[k] for k in absent))
    if cov.get("routes"):
        lines.append(f"  the recorder's note on routes: {cov['routes']}")
    return lines


def staleness_lines(stale: dict[str, Any]) -> list[str]:
    """The staleness section of the text report: the histogram and the figures by staleness, or what it needs."""
    if not stale["versions"]:
        return ["staleness: not measured: " + needs("the staleness section", "policy_version")]
    hist = ", ".join(f"{k}: {v:,}" for k, v in stale["histogram"].items())
    lines = [f"staleness (updates between the weights that generated a sample and the step): sequences {hist}"]
    for b in stale["by_staleness"]:
        lines.append(f"  staleness {b['staleness']}: {b['tokens']:,} tokens, |drift| {num(b['drift_abs_mean'])}, "
                     f"rho max {num(b['rho_max'])}, clipped {num(b['rho_clip_frac'])}, "
                     f"sequences masked {num(b['opsm_masked_frac'])}")
    if stale["ahead_tokens"]:
        lines.append(f"  {stale['ahead_tokens']:,} tokens carry a version above their step (ahead: a bad version)")
    return lines


def section_html(analysis) -> str:
    """The HTML coverage and staleness sections (escaped)."""
    out = ["<h2>What this run recorded</h2>"]
    out += [f"<p>{html.escape(line)}</p>" for line in coverage_lines(coverage_of(analysis))]
    absent = [k for k, v in coverage_of(analysis)["inputs"].items() if v["of"] and not v["steps"]]
    if absent:
        out.append("<ul>" + "".join(f"<li>{html.escape(INPUT_NAMES[k])}: {html.escape(how_to_record(k))}</li>"
                                    for k in absent) + "</ul>")
    out.append("<h2>Staleness</h2>")
    out += [f"<p>{html.escape(line)}</p>" for line in staleness_lines(staleness_of(analysis))]
    return "".join(out)
