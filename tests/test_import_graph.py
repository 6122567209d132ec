"""The package's import graph, read with `ast` (nothing is imported): no cycles, and the layers hold.

Every `import`/`from ... import` of a `megatron_rl` module counts, at module level or inside a function, since a
function-level import only defers a cycle to the first call.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "megatron_rl"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str) -> list[tuple[str, ast.stmt]]:
    """The absolute names of everything `name` imports (a module, or a module's attribute), with the statement."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found += [(f"{base}.{alias.name}", node) for alias in node.names]
    return found


def _target(imported: str) -> str | None:
    """The package module an imported name lives in (`a.b.c` -> `a.b.c` if a module, else `a.b`), or None."""
    while imported:
        if imported in MODULES:
            return imported
        imported = imported.rpartition(".")[0]
    return None


def _graph() -> dict[str, set[str]]:
    graph = {}
    for name in MODULES:
        targets = {_target(imported) for imported, _ in _imports(name)}
        graph[name] = {t for t in targets if t is not None and t != name and t != "megatron_rl"}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def _third_party(prefix: str, modules: list[str], roots: set[str]) -> list[str]:
    """`module: import statement` for each import of a top-level package in `roots` by `modules`."""
    return [
        f"{name}:{node.lineno} imports {imported}"
        for name in modules
        for imported, node in _imports(name)
        if imported.split(".")[0] in roots and imported.startswith(prefix)
    ]


def test_the_graph_is_read() -> None:
    graph = _graph()
    assert "megatron_rl.formats.checkpoint_format" in graph["megatron_rl.megatron_backend.checkpoint.dist_checkpoint"]
    assert "megatron_rl.formats.checkpoint_format" in graph["megatron_rl.megatron_backend.weights.conversion"]
    # A cycle is found when there is one.
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle() -> None:
    assert _cycles(_graph()) == []


def test_checkpoint_and_conversion_do_not_import_each_other() -> None:
    graph = _graph()
    checkpoint = "megatron_rl.megatron_backend.checkpoint.dist_checkpoint"
    conversion = "megatron_rl.megatron_backend.weights.conversion"
    assert conversion not in graph[checkpoint]
    assert checkpoint not in graph[conversion]


def test_backend_does_not_import_rollout_or_trainer() -> None:
    graph = _graph()
    backend = [m for m in graph if m.startswith("megatron_rl.megatron_backend")]
    wrong = [
        f"{m} -> {t}" for m in backend for t in graph[m] if t.startswith(("megatron_rl.rollout", "megatron_rl.trainer"))
    ]
    assert wrong == []


def test_algorithms_import_no_megatron_or_sglang() -> None:
    algorithms = [m for m in MODULES if m.startswith("megatron_rl.algorithms")]
    assert algorithms
    assert _third_party("", algorithms, {"megatron", "sglang", "sglang_router"}) == []
    graph = _graph()
    reached, todo = set(), list(algorithms)
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo += graph[module]
    assert sorted(m for m in reached if not m.startswith("megatron_rl.algorithms")) == []


def test_trainer_loop_imports_no_megatron_core_and_builds_no_sglang_flags() -> None:
    assert _third_party("megatron.core", ["megatron_rl.trainer.loop"], {"megatron"}) == []
    source = (PACKAGE / "trainer" / "loop.py").read_text()
    assert re.findall(r"[\"']--[a-z][a-z-]+", source) == []  # SGLang flags live in rollout/engines/engine_factory.py


def test_routing_imports_no_megatron() -> None:
    routing = [m for m in MODULES if m.startswith("megatron_rl.routing")]
    assert routing
    assert _third_party("", routing, {"megatron", "sglang", "sglang_router"}) == []
