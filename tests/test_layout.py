"""The layout: the engine's import map has no circle and nothing in it imports upward; above it, each part of app/
imports only the parts below it (ALLOWED).

app/engine is layered along the decoding loop: kernels < model < memory < decoding < drafting < step < generation
< batch < engine (defaults and threads, which import nothing of the engine, sit beside; memory, what a KV cache
and a draft session allocate, reads the model's shapes and every drafter reports through it). A module may import
from its own layer or those below it, never above: so a newcomer finds where a change goes, and a change in a
stage cannot reach back into the loop that drives it. Only module-level imports count (an import inside a function
runs when called, and the layers hold without any).

Every check first asserts that the map it reads holds what it expects (every layer and part with its modules, and
their imports), so that a wrong path or a parser that finds no import fails it rather than passing it vacuously."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

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


def _engine_graph() -> dict[str, set[str]]:
    """`_imports()`, asserted to be the engine's: every layer holds a module, and every layer but defaults and
    threads (which import nothing of the engine) imports some module of it."""
    graph = _imports()
    layers = {_layer(m) for m in graph if m != "app.engine"}
    assert layers == set(LAYERS), (
        f"layers without a module: {sorted(set(LAYERS) - layers)}; unknown: {layers - set(LAYERS)}"
    )
    importing = {_layer(m) for m, deps in graph.items() if m != "app.engine" and deps}
    silent = set(LAYERS) - {"defaults", "threads"} - importing
    assert not silent, f"layers that import nothing of the engine: {sorted(silent)}"
    return graph


def test_every_engine_module_has_a_layer() -> None:
    assert {_layer(m) for m in _engine_graph() if m != "app.engine"} <= set(LAYERS)


def test_nothing_in_the_engine_imports_upward() -> None:
    upward = [
        (m, d)
        for m, deps in _engine_graph().items()
        for d in deps
        if m != "app.engine" and LAYERS.index(_layer(d)) > LAYERS.index(_layer(m))
    ]
    assert upward == []


def test_the_engine_import_map_has_no_circle() -> None:
    graph = _engine_graph()
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


# Above the engine, app/ is cut by what each part is for, and a part may import only the parts listed here
# (every import counts, those inside functions too: a lazy import couples the parts as much as any). The request
# flows one way, and every arrow points down: the routes and the app that composes them (app/api, its server
# module the composition root) -> the scheduler, runtime, metrics and settings (app/service) -> the engine -> the
# model store, which resolves a Hugging Face Hub id through app.hub (the bottom: huggingface_hub, nothing of app).
APP = ENGINE.parent
ALLOWED = {
    "hub": set(),
    "store": {"hub"},
    "engine": {"store"},
    "distill": {"engine", "store"},
    # The worker's idle time trains each tenant's draft adapter as train-draft trains a draft (app.distill.online).
    "service": {"distill", "engine", "store"},
    "api": {"service", "engine", "store"},
    # The traffic workloads render tool calls as the chat route does (app.api.tools); `--learn` drives the draft
    # learner (app.distill.online).
    "bench": {"api", "distill", "engine", "store"},
    "cli": {"api", "service", "bench", "distill", "engine", "store"},
}


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "app"


def _all_imports() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in APP.rglob("*.py"):
        name = ".".join(path.relative_to(APP.parent).with_suffix("").parts).removesuffix(".__init__")
        deps = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "app":
                # `from app import store` names a module of app (`__version__` is app's own); `from app.x import y`,
                # one of app.x
                if node.module != "app":
                    deps.add(node.module)
                for alias in node.names if node.module == "app" else ():
                    mine = (APP / alias.name).is_dir() or (APP / f"{alias.name}.py").is_file()
                    deps.add(f"app.{alias.name}" if mine else "app")
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.split(".")[0] == "app")
    return graph


def _app_graph() -> dict[str, set[str]]:
    """`_all_imports()`, asserted to be app's: every part of ALLOWED holds a module, and every part whose rule names
    others imports at least one of them."""
    graph = _all_imports()
    parts = {_part(m) for m in graph}
    assert set(ALLOWED) <= parts, f"parts without a module: {sorted(set(ALLOWED) - parts)}"
    crossing = {_part(m) for m, deps in graph.items() for d in deps if _part(d) in ALLOWED.get(_part(m), ())}
    silent = {part for part, allowed in ALLOWED.items() if allowed} - crossing
    assert not silent, f"parts that import none of the parts their rule allows: {sorted(silent)}"
    return graph


def test_every_part_of_app_has_its_rule() -> None:
    parts = {_part(m) for m in _app_graph()} - {"app"}
    assert parts == set(ALLOWED), "a new folder of app/ needs its line in ALLOWED"


def test_the_parts_of_app_import_only_what_their_rule_allows() -> None:
    wrong = sorted(
        (module, dep)
        for module, deps in _app_graph().items()
        for dep in deps
        if _part(module) != "app"
        and _part(dep) not in ("app", _part(module))
        and _part(dep) not in ALLOWED[_part(module)]
    )
    assert wrong == []


CHECKS = [
    test_every_engine_module_has_a_layer,
    test_nothing_in_the_engine_imports_upward,
    test_the_engine_import_map_has_no_circle,
    test_every_part_of_app_has_its_rule,
    test_the_parts_of_app_import_only_what_their_rule_allows,
]


@pytest.mark.parametrize("tree", ["empty", "no imports"])
def test_every_check_fails_on_a_map_without_modules_or_imports(
    tree: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pointed at a tree with nothing in it (a wrong path), or with every layer's and part's module but not one
    import (a parser that finds none), each check fails rather than finding nothing wrong."""
    engine = tmp_path / "app" / "engine"
    engine.mkdir(parents=True)
    if tree == "no imports":
        for layer in LAYERS:
            (engine / f"{layer}.py").write_text('"""A module that imports nothing."""\n')
        for part in ALLOWED:
            if part != "engine":
                (tmp_path / "app" / f"{part}.py").write_text("X = 1\n")
    here = sys.modules[__name__]
    monkeypatch.setattr(here, "ENGINE", engine)
    monkeypatch.setattr(here, "APP", engine.parent)
    for check in CHECKS:
        with pytest.raises(AssertionError):
            check()
