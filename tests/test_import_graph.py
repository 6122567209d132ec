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


def _package(module: str) -> str:
    """The top-level part of `megatron_rl` a module belongs to (`megatron_rl.rollout.sglang.x` -> `rollout`)."""
    return module.split(".")[1] if module.count(".") else module


# The layers, bottom up: each may import only the layers below it (and itself). `commands`, `api` and `cli` sit
# on top and may import anything.
LAYERS = [
    {"jsonl", "net", "optional_deps", "accelerator", "parallel_layout", "algorithms", "formats", "models", "data"},
    {"kernels", "routing", "tiny_model"},
    {"config"},
    {"launch", "rollout", "megatron_backend"},
    {"evaluation"},
    {"trainer"},
]


def test_no_arrow_runs_back_up_between_the_layers() -> None:
    level = {name: i for i, layer in enumerate(LAYERS) for name in layer}
    wrong = []
    for module, targets in _graph().items():
        source = _package(module)
        if source not in level:
            continue
        for target in targets:
            if level.get(_package(target), -1) > level[source]:
                wrong.append(f"{module} -> {target}")
    assert wrong == []


def test_no_package_level_cycle() -> None:
    graph: dict[str, set[str]] = {}
    for module, targets in _graph().items():
        graph.setdefault(_package(module), set()).update(
            _package(t) for t in targets if _package(t) != _package(module)
        )
    for name in list(graph):
        for target in graph[name]:
            graph.setdefault(target, set())
    assert _cycles(graph) == []


def test_launch_config_rollout_and_models_import_nothing_of_the_backend() -> None:
    """Plain data and the rollout side never import Megatron's side: model families, layouts, formats and the
    config are Megatron-free, and the rollout runs without the trainer's package."""
    wrong = [
        f"{m} -> {t}"
        for m, targets in _graph().items()
        if _package(m) in {"launch", "config", "rollout", "models", "formats", "parallel_layout", "accelerator"}
        for t in targets
        if _package(t) == "megatron_backend"
    ]
    assert wrong == []


def test_rollout_evaluation_and_models_take_their_sections_not_the_whole_config() -> None:
    """Each part takes the config sections it reads; only the trainer, the commands and the config itself (its
    loader and cross-section validation) handle `RLConfig`."""
    wrong = [
        f"{name}:{node.lineno}"
        for name in MODULES
        if _package(name) in {"rollout", "evaluation", "models", "megatron_backend"}
        for imported, node in _imports(name)
        if imported == "megatron_rl.config.schema.RLConfig"
    ]
    assert wrong == []


def test_models_formats_and_layout_import_no_megatron_at_module_level() -> None:
    """The families, the on-disk formats and the layout arithmetic load without Megatron (function-level imports
    only: the layout builds Megatron's groups when asked)."""
    modules = [m for m in MODULES if _package(m) in {"models", "formats", "parallel_layout", "accelerator"}]
    tree = {m: ast.parse(MODULES[m].read_text()) for m in modules}
    wrong = [
        f"{m}:{node.lineno}"
        for m, module in tree.items()
        for node in module.body
        if isinstance(node, ast.Import | ast.ImportFrom)
        and any(n.startswith("megatron.") or n == "megatron" for n in _names(node))
    ]
    assert wrong == []


def _names(node: ast.Import | ast.ImportFrom) -> list[str]:
    return [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]


def test_no_module_over_500_lines_and_no_folder_over_15_modules() -> None:
    long = {
        str(p.relative_to(PACKAGE.parent)): n for p in MODULES.values() if (n := len(p.read_text().splitlines())) > 500
    }
    folders: dict[Path, int] = {}
    for path in MODULES.values():
        folders[path.parent] = folders.get(path.parent, 0) + 1
    crowded = {str(f.relative_to(PACKAGE.parent)): n for f, n in folders.items() if n > 15}
    assert long == {} and crowded == {}
