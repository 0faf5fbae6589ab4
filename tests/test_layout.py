"""The package's shape, checked from the source: imports point one way, no cycles, no private
names across modules, the host bookkeeping never imports jax, no module grows past ~600 lines.

Every `import` counts, function-level ones too (a lazy import that goes against the layers is
still a cycle), except under `if TYPE_CHECKING:`.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "jtp"

# Lower layers never import higher ones; a layer may import itself and anything below.
LAYERS = {
    "jtp.errors": 0, "jtp.demo": 0,
    # The demo's builder (the `demo` extra; a subprocess of its own) trains with jtp's model layers.
    "jtp.demo.build": 3, "jtp.demo.__main__": 3,
    "jtp.config": 1,
    "jtp.core": 2,
    "jtp.models": 3, "jtp.kernels": 3, "jtp.parallel": 3, "jtp.loading": 3,
    "jtp.worker": 4,
    "jtp.distributed": 5,
    "jtp.engine": 6,
    "jtp.entrypoints": 7,
}
MAX_LINES = 600


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(dotted: str) -> bool:
    path = ROOT.parent.joinpath(*dotted.split("."))
    return path.with_suffix(".py").exists() or path.is_dir()


def layer_of(module: str) -> int | None:
    for prefix in sorted(LAYERS, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return LAYERS[prefix]
    return None


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def imports_of(path: Path) -> list[tuple[str, list[str], int]]:
    """(module, names imported from it, line) for every runtime import of a jtp module."""
    tree = ast.parse(path.read_text())
    found = []

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for grandchild in child.orelse:
                    visit(grandchild)
                continue
            if isinstance(child, ast.Import):
                found.extend((a.name, [], child.lineno) for a in child.names if a.name.startswith("jtp"))
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and (child.module or "").startswith("jtp"):
                names = [a.name for a in child.names]
                # `from jtp.pkg import submodule` imports the submodule
                subs = [f"{child.module}.{n}" for n in names if is_module(f"{child.module}.{n}")]
                found.extend((s, [], child.lineno) for s in subs)
                if len(subs) < len(names):
                    found.append((child.module, [n for n in names if f"{child.module}.{n}" not in subs], child.lineno))
            visit(child)

    visit(tree)
    return found


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}
GRAPH = {m: imports_of(p) for m, p in MODULES.items()}


def test_every_module_has_a_layer():
    assert [m for m in MODULES if m != "jtp" and layer_of(m) is None] == []


def upward_imports(graph) -> list[str]:
    return [
        f"{m}:{line} imports {target}"
        for m, deps in graph.items() if m != "jtp"
        for target, _, line in deps
        if layer_of(target) is not None and layer_of(target) > layer_of(m)
    ]


def test_imports_point_down_the_layers():
    assert upward_imports(GRAPH) == []


def cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    edges = {m: {t for t, _, _ in deps if t in graph and t != m and "jtp" not in (m, t)} for m, deps in graph.items()}
    index, low, stack, on, out = {}, {}, [], set(), []

    def strong(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
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
                out.append(sorted(comp))

    for v in edges:
        if v not in index:
            strong(v)
    return out


def test_no_import_cycles():
    assert cycles(GRAPH) == []


def test_no_private_names_across_modules():
    private = [
        f"{m}:{line} imports {name} from {target}"
        for m, deps in GRAPH.items()
        for target, names, line in deps
        for name in names
        if name.startswith("_") and not (name.startswith("__") and name.endswith("__")) and target != m  # dunders are public
    ]
    assert private == []


def test_core_never_imports_jax():
    heavy = []
    for m, path in MODULES.items():
        if layer_of(m) is not None and layer_of(m) <= LAYERS["jtp.core"]:
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                    [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                heavy += [f"{m}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in ("jax", "jaxlib", "torch")]
    assert heavy == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_size(module):
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= MAX_LINES, f"{MODULES[module]} has {lines} lines (at most {MAX_LINES}): split it by job"


def test_the_checks_see_a_planted_cycle_and_upward_import():
    """The checks above are not vacuous."""
    planted = {
        "jtp.core.page_pool": [("jtp.core.scheduler", [], 1), ("jtp.engine.engine", [], 2)],
        "jtp.core.scheduler": [("jtp.core.page_pool", [], 3)],
        "jtp.engine.engine": [("jtp.core.scheduler", [], 4)],
    }
    assert cycles(planted) == [["jtp.core.page_pool", "jtp.core.scheduler"]] or len(cycles(planted)) == 1
    assert upward_imports(planted) == ["jtp.core.page_pool:2 imports jtp.engine.engine"]
