"""The package's layer rule, checked over every import in kldiag/ (lazy ones inside functions too).

Layers, lowest first (docs/architecture.md): a module may import its own layer and the layers
below it, never one above. No import cycles between modules or between packages, and no private
name (`_x`) imported from another package.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "kldiag"

# Each entry is a layer: the top-level names of kldiag (a package or a module) that live in it.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "version", "estimators", "fmt", "_compat", "jit"),  # the maths reference, number formats, the exceptions
    ("format",),  # the run format and its storage
    ("frameworks",),  # what each RL framework computes, names and accepts (numpy only)
    ("record",),  # the recorder, its writer and rows
    ("analysis",),  # the analysis: kernels, its own reducer, cache, runtime, side reducers, rules (ANALYSIS_ROOMS)
    ("mismatch",),  # trainer/engine parity, decomposition, what-if
    ("crosswalk",),  # each framework's logged metrics from the tokens
    ("diagnosis",),  # episodes, causes, verdict, fixes
    ("live",),  # the guard and the watcher
    ("export",),  # TensorBoard / W&B (the TRL hook sends its live histograms through it)
    ("importers",),  # framework dumps into runs
    ("integrations",),  # trainer hooks
    ("views",),  # display shaping, no Streamlit
    ("report",),  # the HTML / text post-mortem
    ("tools",),  # lab, demo, synthetic runs
    ("agents",),  # read-only tools for coding agents and their MCP server
    ("cli",),  # one module per subcommand
    ("__init__", "__main__"),  # the public facade
)
LAYER_OF = {name: i for i, names in enumerate(LAYERS) for name in names}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def top(module: str) -> str:
    """The top-level name under kldiag of a module ("kldiag" itself: "__init__")."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports(module: str) -> list[tuple[str, list[str], bool, int]]:
    """(imported kldiag module, names taken from it, inside a function, line) for every import."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    out = []

    def visit(node: ast.AST, in_func: bool) -> None:
        for child in ast.iter_child_nodes(node):
            lazy = in_func or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                out.extend((a.name, [], in_func, child.lineno) for a in child.names if a.name.startswith("kldiag"))
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = module.split(".")[: None if is_pkg else -1]
                    base = base[: len(base) - (child.level - 1)]
                    src = ".".join(base + ([child.module] if child.module else []))
                else:
                    src = child.module or ""
                if src.startswith("kldiag"):
                    for a in child.names:
                        sub = f"{src}.{a.name}"
                        out.append((sub, [], in_func, child.lineno) if sub in MODULES
                                   else (src, [a.name], in_func, child.lineno))
            visit(child, lazy)

    visit(tree, False)
    return out


def resolve(name: str) -> str:
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


EDGES = {m: [(resolve(t), names, lazy, line) for t, names, lazy, line in imports(m)] for m in MODULES}


def test_every_module_is_in_a_layer():
    assert sorted({top(m) for m in MODULES} - set(LAYER_OF)) == []


def test_no_import_points_up_a_layer():
    bad = [f"{m}:{line} imports {t} ({top(m)} is below {top(t)})"
           for m, edges in EDGES.items() for t, _, _, line in edges
           if t != m and LAYER_OF[top(t)] > LAYER_OF[top(m)]]
    assert bad == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return found


@pytest.mark.parametrize("level", ["module", "package"])
def test_no_import_cycles(level):
    graph: dict[str, set[str]] = defaultdict(set)
    for m, edges in EDGES.items():
        for t, _, _, _ in edges:
            a, b = (m, t) if level == "module" else (top(m), top(t))
            if a != b:
                graph[a].add(b)
    assert _cycles(graph) == []


def test_no_private_name_crosses_packages():
    bad = [f"{m}:{line} takes {n} from {t}" for m, edges in EDGES.items() for t, names, _, line in edges
           for n in names if n.startswith("_") and not n.startswith("__") and top(t) != top(m)]
    bad += [f"{m}:{line} imports private module {t}" for m, edges in EDGES.items() for t, _, _, line in edges
            if top(t) != top(m) and m != "kldiag"
            and any(p.startswith("_") and not p.startswith("__") for p in t.split(".")[1:])]
    assert bad == []


# ---- inside kldiag.analysis: rooms by role, lowest first, behind a public face ---------------------------------

ANALYSIS = "kldiag.analysis"
# Each entry is an inner layer of kldiag.analysis: its rooms (subpackages) and top-level modules.
ANALYSIS_ROOMS: tuple[tuple[str, ...], ...] = (
    ("kernels",),  # numba loops only: no pyarrow, no files
    ("types", "protocol"),  # the contract (AnalysisConfig, Analysis) and the reducer protocol
    ("core",),  # the analysis's own reducer: one record batch -> partials -> tables
    ("cache",),  # RUN/.kldiag: merged prefixes, derived results
    ("runtime",),  # the runner, part reading, threads, Ray, lost parts
    ("reducers",),  # the side reducers, one module a feature
    ("rules",),  # per-step alert rules and episodes
    ("pipeline",),  # analyze()
    ("__init__",),  # the public face
)
ROOM_OF = {name: i for i, names in enumerate(ANALYSIS_ROOMS) for name in names}


def room(module: str) -> str:
    """The room (or top-level module) of a module under kldiag.analysis; "__init__" for the face."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 else "__init__"


def public_modules(room_name: str) -> set[str]:
    """A room's public modules: the names in its __init__'s __all__ (read from the file, not imported)."""
    tree = ast.parse((PKG / "analysis" / room_name / "__init__.py").read_text())
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        if isinstance(target, ast.Name) and target.id == "__all__" and node.value is not None:
            return set(ast.literal_eval(node.value))
    return set()


def test_every_analysis_module_is_in_a_room():
    inside = {m for m in MODULES if m.startswith(ANALYSIS + ".") or m == ANALYSIS}
    assert sorted({room(m) for m in inside} - set(ROOM_OF)) == []


def test_the_analysis_rooms_import_downwards_only():
    bad = [f"{m}:{line} imports {t} ({room(m)} is below {room(t)})"
           for m, edges in EDGES.items() if m.startswith(ANALYSIS + ".")
           for t, _, _, line in edges
           if t.startswith(ANALYSIS + ".") and t != m and ROOM_OF[room(t)] > ROOM_OF[room(m)]]
    assert bad == []


def test_kernels_are_numba_only():
    heavy = ("pyarrow", "pandas", "kldiag.format", "os", "pathlib")
    bad = []
    for path in sorted((PKG / "analysis" / "kernels").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{path.name} imports {n}" for n in names if n.split(".")[0] in heavy or n.startswith(heavy)]
    assert bad == []


def _reaches_inside(t: str, names: list[str]) -> str | None:
    """Why an import of `t` (taking `names`) from outside kldiag.analysis is not allowed, or None."""
    if t in (ANALYSIS, f"{ANALYSIS}.types"):
        return None
    parts = t.split(".")
    r = parts[2]
    if not (PKG / "analysis" / r / "__init__.py").exists():
        return f"the internal module {r}"  # protocol, pipeline: through the face
    public = public_modules(r)
    if len(parts) == 3:
        return None if set(names) <= public else f"{sorted(set(names) - public)} not in {r}.__all__"
    return None if parts[3] in public else f"the internal module {r}.{parts[3]}"


def test_nothing_outside_reaches_an_analysis_internal():
    """Outside kldiag.analysis: the face, types, or a room's public modules; never a kernel."""
    bad = [f"{m}:{line} imports {t}: {why}" for m, edges in EDGES.items() if not m.startswith(ANALYSIS)
           for t, names, _, line in edges if t.startswith(ANALYSIS)
           for why in [_reaches_inside(t, names)] if why]
    assert bad == []
    assert public_modules("kernels") == set()


# ---- ratchets: they only go down --------------------------------------------------------------------------------

LAZY_IMPORTS_MAX = 12  # inside functions: an optional heavy dependency (torch, Ray, plotly, tensorboard, mcp,
# prometheus_client) or the start-up time of the CLI and the trainer-side Guard
TOP_LEVEL_MODULES_MAX = 6


def test_few_imports_inside_functions():
    lazy = sorted({(m, line) for m, edges in EDGES.items() for _, _, in_func, line in edges if in_func})
    assert len(lazy) <= LAZY_IMPORTS_MAX, lazy


def test_few_top_level_modules():
    top_modules = sorted(p.stem for p in PKG.glob("*.py") if p.stem not in ("__init__", "__main__"))
    assert len(top_modules) <= TOP_LEVEL_MODULES_MAX, top_modules


APP = ROOT / "app"


def test_no_import_cycle_in_the_app():
    """app/ is a flat folder of scripts importing each other by bare name; no two may import each other."""
    local = {p.stem for p in APP.glob("*.py")}
    graph: dict[str, set[str]] = defaultdict(set)
    for p in APP.glob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            graph[p.stem] |= {n for n in names if n in local and n != p.stem}
    assert _cycles(graph) == []
