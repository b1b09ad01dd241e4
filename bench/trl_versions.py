"""Do the GRPOTrainer internals kldiag's TRL hook wraps differ between TRL releases? (read, never imported)

    pip download --no-deps trl==1.14.0 -d /tmp/trl && pip download --no-deps trl==1.15.0 -d /tmp/trl
    python bench/trl_versions.py /tmp/trl/trl-1.14.0-*.whl /tmp/trl/trl-1.15.0-*.whl /tmp/trl/trl-1.16.0-*.whl

For each wheel: the parameters of the methods kldiag.integrations.trl wraps (its _REQUIRED_METHODS), and
against the last wheel given (the supported release) how many source lines of each differ.
"""

from __future__ import annotations

import ast
import difflib
import sys
import zipfile

sys.path.insert(0, __file__.rsplit("/bench/", 1)[0])
from kldiag.integrations.trl import _REQUIRED_METHODS  # noqa: E402

MEMBER = "trl/trainer/grpo_trainer.py"


def methods(wheel: str) -> dict[str, tuple[list[str], str] | None]:
    text = zipfile.ZipFile(wheel).read(MEMBER).decode()
    cls = next(n for n in ast.parse(text).body if isinstance(n, ast.ClassDef) and n.name == "GRPOTrainer")
    fns = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}
    return {m: ([a.arg for a in fns[m].args.args][1:], ast.get_source_segment(text, fns[m])) if m in fns else None
            for m in _REQUIRED_METHODS}


def main(wheels: list[str]) -> None:
    found = {w: methods(w) for w in wheels}
    base = found[wheels[-1]]
    for w, ms in found.items():
        print(w.rsplit("/", 1)[-1])
        for m, got in ms.items():
            if got is None:
                print(f"  {m}: missing")
                continue
            diff = difflib.unified_diff((base[m] or ("", ""))[1].splitlines(), got[1].splitlines(), lineterm="", n=0)
            changed = sum(1 for line in diff if line[:1] in "+-" and not line.startswith(("+++", "---")))
            print(f"  {m}({', '.join(got[0][:6])}{', ...' if len(got[0]) > 6 else ''}): {changed} lines differ")


if __name__ == "__main__":
    main(sys.argv[1:])
