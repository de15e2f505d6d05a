"""The package's import graph: every import points down the layers of docs/ARCHITECTURE.md
(or stays inside its layer), and no module imports itself back through others (no circle),
function-level imports included. Read from the source with ``ast``, not by importing."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_fp8state"

# Lowest first: a module may import only from its own layer or the layers below it.
LAYERS = [
    ("base", {"errors", "formats", "config", "shipped"}),
    ("ops", {"ops"}),
    ("state", {"state"}),
    ("sac, encoders, recompute", {"sac", "encoders", "recompute"}),
    ("quant_recipes", {"quant_recipes"}),
    ("protocol", {"protocol"}),
    ("defects, nn", {"defects", "nn"}),
    ("facade, audit, graphs, collector", {"fp8state", "audit", "graphs", "collector"}),
    ("models, telemetry", {"models", "telemetry"}),
    ("lightning", {"lightning"}),
    ("cli", {"cli", "__main__", "__init__"}),
]
RANK = {top: i for i, (_, tops) in enumerate(LAYERS) for top in tops}


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Package-internal modules imported anywhere in ``path`` (as dotted names under the package)."""
    name = module_name(path)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    if path.name == "__init__.py" and name == "__init__":
        package = []
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else list(package)
                target = ".".join([*base, *(node.module.split(".") if node.module else [])])
                if node.module is None:  # from . import x: each name may be a module
                    for alias in node.names:
                        found.add(".".join([*base, alias.name]))
                    continue
                found.add(target)
            elif node.module and node.module.startswith("lightning_fp8state"):
                found.add(node.module.removeprefix("lightning_fp8state").lstrip("."))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("lightning_fp8state."):
                    found.add(alias.name.removeprefix("lightning_fp8state."))
    return {f for f in found if f and f != name}


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    out = {}
    for name, path in modules.items():
        deps = set()
        for target in imports_of(path):
            # resolve "pkg.name" to a module of the package (a name imported from a package)
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                deps.add(target)
        out[name] = deps
    return out


def top(name: str) -> str:
    return name.split(".")[0]


def test_every_module_has_a_layer():
    missing = sorted({top(m) for m in graph()} - set(RANK))
    assert not missing, f"modules with no layer in this test (add them to LAYERS and docs/ARCHITECTURE.md): {missing}"


def test_imports_point_down_the_layers():
    up = [
        f"{a} -> {b} ({LAYERS[RANK[top(a)]][0]} -> {LAYERS[RANK[top(b)]][0]})"
        for a, deps in graph().items()
        for b in deps
        if RANK[top(b)] > RANK[top(a)]
    ]
    assert not up, "imports that point up the layers:\n" + "\n".join(sorted(up))


def test_the_import_graph_has_no_circle():
    g = graph()
    # a package's __init__ re-exports its own modules: those edges are not a circle back up
    edges = {
        a: {b for b in deps if not (b.startswith(a + ".") and "." not in b[len(a) + 1 :])} for a, deps in g.items()
    }
    edges = {a: {b for b in deps if not a.startswith(b + ".")} for a, deps in edges.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            circle = visit(node)
            assert circle is None, "an import circle: " + " -> ".join(circle)


def test_the_protocol_does_not_import_the_defects_or_the_modules():
    deps = {d for name, ds in graph().items() if top(name) == "protocol" for d in ds}
    assert "defects" not in deps
    assert not any(top(d) == "nn" for d in deps)
