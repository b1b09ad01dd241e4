"""The known-truth confusion table (issue 24): every scenario of kldiag/tools/truth.py, diagnosed.

    python bench/truth_table.py                       # every scenario at full size, tables on stdout
    python bench/truth_table.py --markdown            # ... and into docs/metrics.md, between the truth-table markers
    python bench/truth_table.py --only k3_blowup --small
    python bench/truth_table.py --small --moe          # ... and the tiny-MoE scenarios (kldiag/tools/truth_moe.py)
    # another checkout of kldiag (a "before" table, kept beside the current one in its own markers); the
    # generator is loaded by its file path:
    PYTHONPATH=/tmp/kl_before python bench/truth_table.py --generator kldiag/tools/truth.py --label 9cb43d0 --before

Per cause: true positives (named on a scenario that has it), false negatives, false positives (named
on a scenario that does not have it), onsets within the scenario's tolerance, mean and max onset
error in steps. Per healthy control: the verdict and the episodes by severity.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import shlex
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- truth-table:begin -->", "<!-- truth-table:end -->"
BEFORE_BEGIN, BEFORE_END = "<!-- truth-table-before:begin -->", "<!-- truth-table-before:end -->"


def load_generator(path: str | None):
    """kldiag.tools.truth, or the module at `path` (or this checkout's file when kldiag has none)."""
    if path is None:
        try:
            return importlib.import_module("kldiag.tools.truth")
        except ImportError:
            path = str(ROOT / "kldiag" / "tools" / "truth.py")
    spec = importlib.util.spec_from_file_location("kldiag_truth_generator", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


def run_all(T, names: list[str], small: bool, keep: str | None, moe=None) -> list[dict]:
    """Each scenario written, analysed and diagnosed; `moe` (kldiag.tools.truth_moe) holds the names T lacks."""
    import kldiag
    from kldiag.diagnosis import diagnose

    out = []
    for name in names:
        T = T if name in T.SCENARIOS else moe
        sc = T.small(T.SCENARIOS[name]) if small else T.SCENARIOS[name]
        with tempfile.TemporaryDirectory() as tmp:
            run = Path(keep, name) if keep else Path(tmp, name)
            t0 = time.perf_counter()
            T.make_run(run, sc)
            t1 = time.perf_counter()
            analysis = kldiag.analyze(run)
            dg = diagnose(analysis)
            t2 = time.perf_counter()
            tokens = int(sum(analysis.steps.column("tokens").to_pylist()))
        out.append({"sc": sc, "verdict": dg.verdict, "causes": {c.cause: (c.onset, c.severity) for c in dg.causes},
                    "episodes": Counter(e.severity for e in dg.episodes), "wrong": T.check(sc, dg),
                    "tokens": tokens, "write_s": t1 - t0, "diagnose_s": t2 - t1})
        print(f"{name}: {dg.verdict}, {', '.join(f'{c.cause}@{c.onset}' for c in dg.causes) or 'no cause'} "
              f"({t1 - t0:.1f} s to write, {t2 - t1:.1f} s to analyze and diagnose)", file=sys.stderr)
    return out


def cause_table(T, rows: list[dict]) -> list[str]:
    names = list(_cause_names())
    names += sorted({c for r in rows for c in r["causes"]} - set(names))
    lines = ["| cause | scenarios with it | TP | FN | FP | onset within tolerance | mean onset error | "
             "max onset error |", "|---|---|---|---|---|---|---|---|"]
    for cause in names:
        tp = fn = fp = ok = 0
        errs = []
        for r in rows:
            exp = {e.cause: e for e in r["sc"].expect}
            named = cause in r["causes"]
            if cause in exp:
                tp, fn = tp + named, fn + (not named)
                onset = r["causes"][cause][0] if named else None
                if onset is not None:
                    errs.append(abs(onset - exp[cause].onset))
                    ok += errs[-1] <= exp[cause].tol
            else:
                fp += named
        n = sum(cause in {e.cause for e in r["sc"].expect} for r in rows)
        mean = f"{sum(errs) / len(errs):.1f}" if errs else "-"
        lines.append(f"| `{cause}` | {n} | {tp} | {fn} | {fp} | {ok}/{tp} | {mean} | {max(errs) if errs else '-'} |")
    return lines


def _cause_names() -> tuple[str, ...]:
    from kldiag.diagnosis import CAUSE_NAMES

    return tuple(CAUSE_NAMES)


def scenario_table(rows: list[dict]) -> list[str]:
    lines = ["| scenario | expected | named (onset) | verdict | result |", "|---|---|---|---|---|"]
    for r in rows:
        sc = r["sc"]
        exp = ", ".join(f"`{e.cause}` @{e.onset}±{e.tol}" for e in sc.expect) or "none"
        got = ", ".join(f"`{c}` @{o} ({s})" for c, (o, s) in r["causes"].items()) or "none"
        verdict = r["verdict"] if r["verdict"] == sc.verdict else f"**{r['verdict']}** (expected {sc.verdict})"
        lines.append(f"| {sc.name} | {exp} | {got} | {verdict} | {'ok' if not r['wrong'] else '; '.join(r['wrong'])} |")
    return lines


def control_table(rows: list[dict]) -> list[str]:
    lines = ["| healthy control | steps | tokens | verdict | episodes info / warning / critical | causes named |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if r["sc"].expect:
            continue
        e = r["episodes"]
        got = ", ".join(f"`{c}` @{o} ({s})" for c, (o, s) in r["causes"].items()) or "none"
        lines.append(f"| {r['sc'].name} | {r['sc'].steps} | {r['tokens']:,} | {r['verdict']} | "
                     f"{e['info']} / {e['warning']} / {e['critical']} | {got} |")
    return lines


def render(T, rows: list[dict], label: str, command: str) -> str:
    ok = sum(not r["wrong"] for r in rows)
    return "\n".join([
        f"Checkout: {label}. Command: `{command}`. {ok} of {len(rows)} scenarios diagnosed exactly "
        "(verdict, every expected cause with its onset within tolerance, no other cause).", "",
        *cause_table(T, rows), "", *scenario_table(rows), "", *control_table(rows)])


SECTION = """## Known-truth suite: what the diagnosis names, and when (`bench/truth_table.py`)

`kldiag/tools/truth.py` writes runs whose cause and onset are known, with `kldiag.Recorder`, from
real categorical distributions: at every position pi_theta, pi_old, pi_ref and the engine's mu are
exact log-softmaxes of their own logits over a 64-token vocabulary (tokens that share a step, prompt
group and prefix share their logits), the sampled token is drawn from mu (from pi_old without an
engine), and the entropy is pi_theta's exact entropy. Each scenario declares the verdict, the causes
with their onset and a tolerance (5 steps; 2 for a temperature present from step 0; 10 for a mismatch that
ramps up over 20 steps; 25 for an entropy collapse, a quarter of its 100-step fall), and any other cause counts
as a false positive.
`tests/test_truth_suite.py` runs them all at a reduced size (8 sequences of 24-48 tokens a step) and
marks with `xfail(strict=True)` the ones today's detectors get wrong, with the defect (none since issue 24's
fixes: persistence, the temperature/noise fit, the entropy trend, one cause per root cause; the table from
before them follows this one).

TP: the cause is named on a scenario that has it (onset aside); FN: not named there; FP: named on
a scenario that does not have it. Onset error: |onset named - onset expected| over the TPs.

### After: the detectors of this checkout

{body}
"""
BEFORE_SECTION = """### Before: the detectors before issue 24's fixes, kept for comparison (`--before`)

{body}
"""


def write_markdown(doc: Path, text: str, begin: str = BEGIN, end: str = END) -> None:
    """Replace the block between `begin` and `end` (a new block goes after the main one, else at the end)."""
    old = doc.read_text() if doc.exists() else ""
    block = f"{begin}\n{text.rstrip()}\n{end}"
    if begin in old and end in old:
        head, rest = old.split(begin, 1)
        new = head + block + rest.split(end, 1)[1]
    elif begin != BEGIN and END in old:
        head, rest = old.split(END, 1)
        new = head + END + "\n\n" + block + rest
    else:
        new = old.rstrip("\n") + "\n\n" + block + "\n"
    doc.write_text(new)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--generator", help="path of a truth.py to load (default: kldiag.tools.truth, else the file "
                    "in this checkout)")
    ap.add_argument("--only", nargs="*", help="scenario names (default: all)")
    ap.add_argument("--small", action="store_true", help="the tests' reduced sizes instead of full size")
    ap.add_argument("--markdown", nargs="?", const=str(ROOT / "docs" / "metrics.md"),
                    help="write the section between the truth-table markers of this file (default docs/metrics.md)")
    ap.add_argument("--label", help="what checkout this is, for the table's heading (default: this checkout, or "
                    "kldiag's path)")
    ap.add_argument("--before", action="store_true", help="with --markdown: write the table as the kept \"before\" "
                    "table (its own markers), leaving the current one")
    ap.add_argument("--keep", help="write the runs under this directory and keep them")
    ap.add_argument("--moe", action="store_true", help="add the tiny-MoE routing scenarios (needs transformers)")
    args = ap.parse_args(argv)
    T = load_generator(args.generator)
    import kldiag

    moe = importlib.import_module("kldiag.tools.truth_moe") if args.moe else None
    names = args.only or [*T.SCENARIOS, *(moe.SCENARIOS if moe else ())]
    t0 = time.perf_counter()
    rows = run_all(T, names, args.small, args.keep, moe)
    command = shlex.join(["python", "bench/truth_table.py", *(argv if argv is not None else sys.argv[1:])])
    other = Path(kldiag.__file__).resolve().parents[1]
    label = args.label or ("this checkout" if other == ROOT else f"kldiag from `{Path(kldiag.__file__).parent}`")
    if other != ROOT:  # another checkout of kldiag, on PYTHONPATH
        command = f"PYTHONPATH={other} {command}"
    text = render(T, rows, label, command)
    print(text)
    print(f"\n{len(rows)} scenarios in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    if args.markdown and args.before:
        write_markdown(Path(args.markdown), BEFORE_SECTION.format(body=text), BEFORE_BEGIN, BEFORE_END)
    elif args.markdown:
        write_markdown(Path(args.markdown), SECTION.format(body=text))


if __name__ == "__main__":
    main()
