"""Early warning (issue 24 item 4): lead times on blow-ups, false-warning rates on healthy controls.

    python bench/early_warning.py                    # every run below, seeds 0 1 2, plain tables on stdout
    python bench/early_warning.py --markdown         # the same tables in markdown (docs/metrics.md, "Early warning")
    python bench/early_warning.py --seeds 0 --small  # a quick look: one seed, the truth runs at the tests' size

Blow-ups: the demo's K3 run (sample_logs/demo_k3, which `kldiag demo` trains with seed 0; other seeds are
trained with kldiag.tools.demo.run_pair), the known-truth scenarios with a K3 blow-up (kldiag/tools/truth.py:
those of the suite, whose blow-up is a step, and RAMP_LIST, whose blow-up has a lead-up) and synthetic runs
(kldiag.tools.synth, blowup_step=150). Per run: the first early-warning episode (kinds
kldiag.analysis.rules.early.EARLY_KINDS, severity warning), the first critical episode's start, the
k3_weight_blowup cause's onset, and the lead time in steps to each (positive: the warning came first; "-": no
early warning before it). Entropy collapses (the suite's two): the lead of early_entropy_drop to the step where
entropy_collapse is confirmed (evidence confirmed_step) and to its onset. Healthy controls (the suite's
healthy scenarios at full size, and synthetic runs without a blow-up): early-warning episodes per 1,000 steps,
and how near they came to the K3 rules' floors (the largest recent level of each indicator). `--others` adds
the suite's scenarios of the other causes to that table (a warning there is not a false one by definition).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SYNTH_STEPS = {"blowup": 300, "healthy": 2000}


def diagnosed(run: Path):
    """(analysis, diagnosis) of a run, with the diagnosis's reducers."""
    from kldiag.analysis import AnalysisConfig, analyze
    from kldiag.diagnosis import diagnose
    from kldiag.diagnosis.core import reducers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = analyze(run, AnalysisConfig(), reducers())
        return a, diagnose(a)


def _lead(target: int | None, first: int | None) -> str:
    if target is None:
        return "n/a"
    return str(target - first) if first is not None and first < target else "-"


def blowup_row(group: str, name: str, run: Path, check=None) -> dict:
    """The lead-time figures of one blow-up run."""
    from kldiag.analysis.rules.early import EARLY_KINDS

    a, dg = diagnosed(run)
    early = [e for e in dg.episodes if e.kind in EARLY_KINDS and e.severity == "warning"]
    first = min(early, key=lambda e: e.start, default=None)
    crit = min((e.start for e in dg.episodes if e.severity == "critical"), default=None)
    cause = next((c.onset for c in dg.causes if c.cause == "k3_weight_blowup"), None)
    start = first.start if first else None
    wrong = check(dg) if check is not None else []
    return {"group": group, "run": name, "steps": a.steps.num_rows,
            "first": f"{first.kind} @{start}" if first else "none", "critical": crit, "cause": cause,
            "lead_critical": _lead(crit, start), "lead_cause": _lead(cause, start), "verdict": dg.verdict,
            "truth": "; ".join(wrong) or ("ok" if check is not None else "")}


def entropy_row(name: str, run: Path) -> dict:
    a, dg = diagnosed(run)
    early = [e.start for e in dg.episodes if e.kind == "early_entropy_drop" and e.severity == "warning"]
    cause = next((c for c in dg.causes if c.cause == "entropy_collapse"), None)
    confirmed = cause.evidence["confirmed_step"] if cause else None
    first = min(early, default=None)
    return {"run": name, "steps": a.steps.num_rows, "first": first, "onset": cause.onset if cause else None,
            "confirmed": confirmed, "lead_confirmed": _lead(confirmed, first),
            "lead_onset": _lead(cause.onset if cause else None, first), "verdict": dg.verdict}


def closest(a) -> dict:
    """How near a run came to the K3 rules' floors: the largest recent level (warning.levels) of the weight
    tail (p99 or p999), of the blame share and of the flagged tokens a step."""
    import numpy as np

    from kldiag.analysis.rules import early as W

    def top(v) -> float:
        r, _ = W.levels(np.asarray(v, dtype=np.float64), W.EarlyWarning())
        return float(np.nanmax(r, initial=0.0))

    c = {k: a.steps.column(k).to_numpy(zero_copy_only=False) for k in
         ("weight_k3_abs_p99", "weight_k3_abs_p999", "blame_share", "flagged_frac", "tokens")}
    return {"tail": max(top(c["weight_k3_abs_p99"]), top(c["weight_k3_abs_p999"])), "blame": top(c["blame_share"]),
            "flagged": top(c["flagged_frac"] * c["tokens"])}


def control_row(group: str, name: str, run: Path) -> dict:
    from kldiag.analysis.rules.early import EARLY_KINDS

    a, dg = diagnosed(run)
    early = [e for e in dg.episodes if e.kind in EARLY_KINDS]
    warn = [e for e in early if e.severity == "warning"]
    steps = a.steps.num_rows
    return {"group": group, "run": name, "steps": steps, "warnings": len(warn), "notes": len(early) - len(warn),
            "per_1000": 1000.0 * len(warn) / steps, **closest(a), "verdict": dg.verdict,
            "kinds": ", ".join(f"{e.kind} @{e.start}" for e in warn) or "-"}


def truth_runs(T, seeds: list[int], small: bool, others: bool):
    """(kind, name, scenario) of the known-truth runs: "blowup", "entropy", "healthy" (and, with `others`, the
    suite's scenarios of other causes, "other")."""
    causes = {s.name: {e.cause for e in s.expect} for s in (*T.SCENARIO_LIST, *T.RAMP_LIST)}
    for sc in (*T.SCENARIO_LIST, *T.RAMP_LIST):
        kind = ("blowup" if "k3_weight_blowup" in causes[sc.name] else "entropy" if "entropy_collapse" in
                causes[sc.name] else "healthy" if not sc.expect else "other" if others else None)
        if kind is None:
            continue
        for seed in seeds:
            run = dataclasses.replace(T.small(sc) if small else sc, seed=seed)
            yield kind, f"{sc.name} (seed {seed})", run


def demo_runs(tmp: Path, seeds: list[int]):
    """(name, run dir) of the demo's K3 run: the shipped one for seed 0, trained for the others."""
    from kldiag.tools import demo

    for seed in seeds:
        if seed == 0 and (ROOT / "sample_logs" / "demo_k3").exists():
            yield "demo_k3 (sample_logs, seed 0)", ROOT / "sample_logs" / "demo_k3"
            continue
        runs = demo.run_pair(tmp / f"demo_seed{seed}", seed=seed)
        yield f"demo_k3 (seed {seed}, trained now)", next(r.run_dir for r in runs if r.estimator == "k3")


def collect(args, tmp: Path) -> tuple[list[dict], list[dict], list[dict]]:
    from kldiag.tools import synth
    from kldiag.tools import truth as T

    blow, ent, ctrl = [], [], []
    for name, run in demo_runs(tmp, args.demo_seeds):
        blow.append(blowup_row("demo", name, run))
        progress(blow[-1])
    for kind, name, sc in truth_runs(T, args.seeds, args.small, args.others):
        run = T.make_run(tmp / f"{sc.name}_{sc.seed}", sc)
        if kind == "blowup":
            group = "truth, ramp" if sc.name in T.RAMP_SCENARIOS else "truth, step"
            row = blowup_row(group, name, run, lambda dg, sc=sc: T.check(sc, dg))
        else:
            row = entropy_row(name, run) if kind == "entropy" else control_row(f"truth, {kind}", name, run)
        {"blowup": blow, "entropy": ent, "healthy": ctrl, "other": ctrl}[kind].append(row)
        progress(row)
    for seed in args.seeds:
        for blown in (True, False):
            cfg = synth.SynthConfig(steps=SYNTH_STEPS["blowup" if blown else "healthy"], seed=seed,
                                    blowup_step=150 if blown else None)
            run = tmp / f"synth_{seed}_{blown}"
            synth.make_run(run, cfg)
            name = f"synth, {cfg.steps} steps{', blowup_step 150' if blown else ''} (seed {seed})"
            row = blowup_row("synth, step", name, run) if blown else control_row("synth, healthy", name, run)
            (blow if blown else ctrl).append(row)
            progress(row)
    return blow, ent, ctrl


def progress(row: dict) -> None:
    print("  " + ", ".join(f"{k}={v}" for k, v in row.items()), file=sys.stderr, flush=True)


def table(rows: list[dict], cols: list[tuple[str, str]], markdown: bool) -> list[str]:
    head = [h for _, h in cols]
    body = [["-" if r[k] is None else f"{r[k]:.2f}" if isinstance(r[k], float) else str(r[k]) for k, _ in cols]
            for r in rows]
    if markdown:
        return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *("| " + " | ".join(b) + " |" for b in body)]
    width = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
    return ["  ".join(x.ljust(w) for x, w in zip(line, width, strict=True)) for line in (head, *body)]


def summary(blow: list[dict], ctrl: list[dict]) -> list[str]:
    out = []
    for group in dict.fromkeys(r["group"] for r in blow):
        rows = [r for r in blow if r["group"] == group]
        leads = [int(r["lead_critical"]) for r in rows if r["lead_critical"].lstrip("-").isdigit()]
        span = f", lead {min(leads)}-{max(leads)} steps (mean {sum(leads) / len(leads):.1f})" if leads else ""
        out.append(f"- {group}: {len(leads)} of {len(rows)} runs warned before the critical episode{span}")
    for group in dict.fromkeys(r["group"] for r in ctrl if r["group"] != "truth, other"):
        rows = [r for r in ctrl if r["group"] == group]
        steps, warns = sum(r["steps"] for r in rows), sum(r["warnings"] for r in rows)
        out.append(f"- {group}: {warns} early-warning episodes in {steps:,} steps "
                   f"({1000.0 * warns / steps:.2f} per 1,000 steps), {sum(r['notes'] for r in rows)} info notes")
    return out


BLOW_COLS = [("group", "group"), ("run", "run"), ("steps", "steps"), ("first", "first early warning"),
             ("critical", "critical episode"), ("cause", "k3_weight_blowup onset"),
             ("lead_critical", "lead to critical"), ("lead_cause", "lead to cause"), ("verdict", "verdict"),
             ("truth", "truth check")]
ENT_COLS = [("run", "run"), ("steps", "steps"), ("first", "early_entropy_drop"), ("onset", "entropy_collapse onset"),
            ("confirmed", "confirmed at"), ("lead_confirmed", "lead to confirmation"), ("lead_onset", "lead to onset"),
            ("verdict", "verdict")]
CTRL_COLS = [("group", "group"), ("run", "run"), ("steps", "steps"), ("warnings", "early warnings"),
             ("notes", "info notes"), ("per_1000", "per 1,000 steps"), ("tail", "top recent p99/p999 (floor 5)"),
             ("blame", "top recent blame (floor 0.1)"), ("flagged", "top recent flagged tokens (min 10)"),
             ("verdict", "verdict"), ("kinds", "which")]


def render(blow, ent, ctrl, markdown: bool, command: str) -> str:
    return "\n".join([f"Command: `{command}`.", "", *table(blow, BLOW_COLS, markdown), "",
                      *table(ent, ENT_COLS, markdown), "", *table(ctrl, CTRL_COLS, markdown), "",
                      *summary(blow, ctrl)])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds of the truth and synthetic runs")
    ap.add_argument("--demo-seeds", type=int, nargs="*", default=[0, 1, 2],
                    help="demo seeds (0: sample_logs/demo_k3; others are trained, a few seconds each)")
    ap.add_argument("--small", action="store_true", help="the truth runs at the tests' size (TEST_SIZE)")
    ap.add_argument("--markdown", action="store_true", help="markdown tables (for docs/metrics.md)")
    ap.add_argument("--others", action="store_true", help="also the suite's scenarios of other causes (clamp, drift, "
                    "mismatch, temperature, numerical fault), in the controls table as \"truth, other\"")
    ap.add_argument("--keep", help="write the runs under this directory and keep them")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        blow, ent, ctrl = collect(args, Path(args.keep or tmp))
    command = " ".join(["python", "bench/early_warning.py", *(argv if argv is not None else sys.argv[1:])])
    print(render(blow, ent, ctrl, args.markdown, command))
    print(f"\n{len(blow) + len(ent) + len(ctrl)} runs in {time.perf_counter() - t0:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
