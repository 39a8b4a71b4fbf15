"""The layout: the engine's import map has no circle and nothing in it imports upward; above it, each part of app/
imports only the parts below it (ALLOWED).

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
    "service": {"engine", "store"},
    "api": {"service", "engine", "store"},
    # The traffic workloads render tool calls as the chat route does (app.api.tools).
    "bench": {"api", "engine", "store"},
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


def test_every_part_of_app_has_its_rule() -> None:
    parts = {_part(m) for m in _all_imports()} - {"app"}
    assert parts == set(ALLOWED), "a new folder of app/ needs its line in ALLOWED"


def test_the_parts_of_app_import_only_what_their_rule_allows() -> None:
    wrong = sorted(
        (module, dep)
        for module, deps in _all_imports().items()
        for dep in deps
        if _part(module) != "app"
        and _part(dep) not in ("app", _part(module))
        and _part(dep) not in ALLOWED[_part(module)]
    )
    assert wrong == []
