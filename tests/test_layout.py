"""The engine's layout: its import map has no circle, and nothing imports upward.

app/engine is layered along the decoding loop: kernels < model < memory < decoding < drafting < step < generation
< batch < engine (defaults and threads, which import nothing of the engine, sit beside; memory, what a KV cache
and a draft session allocate, reads the model's shapes and every drafter reports through it). A module may import
from its own layer or those below it, never above: so a newcomer finds where a change goes, and a change in a
stage cannot reach back into the loop that drives it. Only module-level imports count (an import inside a function
runs when called, and the layers hold without any)."""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parent.parent / "app" / "engine"
# Lowest first; a module's layer is its subpackage, or its own name at the top of app/engine.
LAYERS = ["defaults", "threads", "kernels", "model", "memory", "prefix_cache", "decoding", "drafting", "step"]
LAYERS += ["reference", "generation", "batch", "engine", "factory"]


def _module(path: Path) -> str:
    parts = path.relative_to(ENGINE.parent.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> str:
    return module.split(".")[2]


def _imports() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in ENGINE.rglob("*.py"):
        name = _module(path)
        deps = graph.setdefault(name, set())
        for node in ast.parse(path.read_text()).body:  # module level only
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("app.engine"):
                base = node.module
                for alias in node.names:  # `from app.engine import kernels` imports a module
                    sub = f"{base}.{alias.name}"
                    where = ENGINE.parent.parent / sub.replace(".", "/")
                    deps.add(sub if where.with_suffix(".py").exists() or (where / "__init__.py").exists() else base)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("app.engine."))
    return {name: {d for d in deps if d != "app.engine" and d != name} for name, deps in graph.items()}


def test_every_engine_module_has_a_layer() -> None:
    assert {_layer(m) for m in _imports() if m != "app.engine"} <= set(LAYERS)


def test_nothing_in_the_engine_imports_upward() -> None:
    upward = [
        (m, d)
        for m, deps in _imports().items()
        for d in deps
        if m != "app.engine" and LAYERS.index(_layer(d)) > LAYERS.index(_layer(m))
    ]
    assert upward == []


def test_the_engine_import_map_has_no_circle() -> None:
    graph = _imports()
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        assert node not in path, " -> ".join([*path, node])
        if node in done:
            return
        for dep in sorted(graph.get(node, ())):
            visit(dep, [*path, node])
        done.add(node)

    for module in sorted(graph):
        visit(module, [])
