"""The package's import graph and size, for any checkout: modules, kldiag-internal imports (and how many
sit inside functions), module- and package-level cycles, imports that point up a layer, lines per package.

    python bench/import_graph.py                 # this checkout
    python bench/import_graph.py /path/to/other  # another checkout of kldiag (e.g. a git worktree)

Layers are tests/test_architecture.py's LAYERS. A checkout from before the stage layout has its modules
placed by kldiag/_compat.py's MOVED table (old path -> new path), so "up a layer" means the same there.
Reads source text only (ast); imports nothing of the checkout it measures.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import Counter, defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE / "tests"))
sys.path.insert(0, str(HERE))

from test_architecture import LAYER_OF, _cycles  # noqa: E402

from kldiag._compat import MOVED  # noqa: E402

EXTRA = {"kldiag.cli": "kldiag.cli", "kldiag.report": "kldiag.report.build", "kldiag.views": "kldiag.views.pages",
         "kldiag.diagnosis.parity": "kldiag.mismatch.parity",  # moved without an alias, or split
         "kldiag.integrations.importers._sink": "kldiag.importers.sink"}


def modules(root: Path) -> dict[str, Path]:
    out = {}
    for p in sorted((root / "kldiag").rglob("*.py")):
        parts = list(p.relative_to(root).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def stage(module: str, old_layout: bool) -> str:
    """The top-level name of the module's place in the stage layout (an old layout's module: where it moved)."""
    new = (EXTRA.get(module) or MOVED.get(module)) if old_layout else None
    parts = (new or module).split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def edges(mods: dict[str, Path]) -> tuple[dict[str, set[str]], int]:
    graph, lazy = defaultdict(set), 0
    for m, path in mods.items():
        is_pkg = path.name == "__init__.py"

        def visit(node: ast.AST, in_func: bool, m: str = m, is_pkg: bool = is_pkg) -> None:
            nonlocal lazy
            for ch in ast.iter_child_nodes(node):
                names = []
                if isinstance(ch, ast.Import):
                    names = [a.name for a in ch.names]
                elif isinstance(ch, ast.ImportFrom):
                    base = m.split(".")[: None if is_pkg else -1]
                    src = ".".join(base[: len(base) - (ch.level - 1)] + ([ch.module] if ch.module else [])) \
                        if ch.level else (ch.module or "")
                    names = [f"{src}.{a.name}" if f"{src}.{a.name}" in mods else src for a in ch.names]
                for t in (n for n in names if n.startswith("kldiag")):
                    while t not in mods and "." in t:
                        t = t.rsplit(".", 1)[0]
                    if t != m:
                        graph[m].add(t)
                        lazy += in_func
                visit(ch, in_func or isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef)))

        visit(ast.parse(path.read_text()), False)
    return graph, lazy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", nargs="?", default=str(HERE), help="a checkout of kldiag (default: this one)")
    root = Path(ap.parse_args().root)
    mods = modules(root)
    graph, lazy = edges(mods)
    top = lambda m: m.split(".")[1] if "." in m else "__init__"  # noqa: E731
    packages = defaultdict(set)
    for a, bs in graph.items():
        packages[top(a)].update(top(b) for b in bs if top(b) != top(a))
    old = not (root / "kldiag" / "record").is_dir()
    layer = {m: LAYER_OF.get(stage(m, old)) for m in mods}
    up = [(a, b) for a, bs in graph.items() for b in bs
          if layer[a] is not None and layer[b] is not None and layer[b] > layer[a]]
    lines = Counter()
    for m, p in mods.items():
        where = top(m) if (root / "kldiag" / top(m)).is_dir() else "(top-level modules)"
        lines[where] += len(p.read_text().splitlines())
    print(f"checkout: {root}")
    n_top = sum(1 for m in mods if m.count(".") == 1 and not (root / "kldiag" / top(m)).is_dir())
    print(f"modules: {len(mods)}; top-level modules in kldiag/: {n_top}")
    print(f"kldiag-internal imports: {sum(map(len, graph.values()))} module edges; "
          f"import statements inside functions: {lazy}")
    print(f"module cycles: {_cycles(graph)}")
    print(f"package cycles: {_cycles(packages)}")
    print(f"imports pointing up a layer: {len(up)}" + "".join(f"\n  {a} -> {b}" for a, b in sorted(up)))
    print("lines per package: " + ", ".join(f"{k} {v}" for k, v in sorted(lines.items(), key=lambda kv: -kv[1])))
    print(f"lines in all: {sum(lines.values())}")


if __name__ == "__main__":
    main()
