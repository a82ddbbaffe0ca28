"""The package graph, checked on the source: which folder may import which, and no cycles
between files or folders. Imports inside functions count too; TYPE_CHECKING blocks do not.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from support.paths import REPO_ROOT, SOURCE_FOLDERS

# Each unit (a folder, or a module at the top of loomllm) and the units it may import. A new
# edge is a design decision: add it here on purpose, never to make this test pass.
ALLOWED: dict[str, set[str]] = {
    # The wire format: what crosses a process boundary.
    "loomllm.protocols": set(),
    # The user's side.
    "loomllm.errors": set(),
    "loomllm.config": {"loomllm.protocols"},
    "loomllm.outputs": {"loomllm.protocols"},
    "loomllm.core": {"loomllm.config", "loomllm.protocols"},
    "loomllm.text": set(),
    "loomllm.metrics": set(),
    "loomllm.clients": {"loomllm.errors", "loomllm.protocols"},
    "loomllm.engine": {
        "loomllm.clients",
        "loomllm.config",
        "loomllm.core",
        "loomllm.errors",
        "loomllm.metrics",
        "loomllm.outputs",
        "loomllm.protocols",
        "loomllm.text",
    },
    # LLM.get_tokenizer() hands out the engine's tokenizer.
    "loomllm.llm": {"loomllm.engine", "loomllm.outputs", "loomllm.protocols", "loomllm.text"},
    "loomllm.server.parsers": set(),
    # The request bodies' models: SamplingParams' field rules make their sampling fields.
    "loomllm.server.bodies": {"loomllm.protocols"},
    "loomllm.server.openai": {
        "loomllm.engine",
        "loomllm.server.bodies",
        "loomllm.errors",
        "loomllm.outputs",
        "loomllm.protocols",
        "loomllm.server.parsers",
    },
    # Each model's engine, supervised; its errors are the OpenAI routes' ApiError.
    "loomllm.server.fleet": {
        "loomllm.config",
        "loomllm.engine",
        "loomllm.errors",
        "loomllm.protocols",
        "loomllm.server.openai",
    },
    # Ollama's API builds on the OpenAI routes' request checks and errors.
    "loomllm.server.ollama": {
        "loomllm.engine",
        "loomllm.server.bodies",
        "loomllm.errors",
        "loomllm.outputs",
        "loomllm.protocols",
        "loomllm.server.fleet",
        "loomllm.server.openai",
    },
    "loomllm.server": {
        "loomllm.engine",
        "loomllm.errors",
        "loomllm.metrics",
        "loomllm.outputs",
        "loomllm.protocols",
        "loomllm.server.bodies",
        "loomllm.server.fleet",
        "loomllm.server.ollama",
        "loomllm.server.openai",
        "loomllm.server.parsers",
    },
    # The flags offer the tool-call and reasoning parsers' names (a light import).
    "loomllm.cli": {
        "loomllm.clients",
        "loomllm.config",
        "loomllm.engine",
        "loomllm.errors",
        "loomllm.protocols",
        "loomllm.server",
        "loomllm.server.fleet",
        "loomllm.server.parsers",
    },
    # The device side.
    # protocols/choices.py names the dtypes a model may load in.
    "loomllm.workers.device": {"loomllm.protocols"},
    "loomllm.workers.kernels": {"loomllm.workers.device"},
    "loomllm.workers.attention": {"loomllm.workers.device", "loomllm.workers.kernels"},
    "loomllm.workers.sample": {
        "loomllm.protocols",
        "loomllm.workers.device",
        "loomllm.workers.kernels",
    },
    "loomllm.workers.models.llama": {"loomllm.workers.attention", "loomllm.workers.kernels"},
    "loomllm.workers.models": {
        "loomllm.protocols",
        "loomllm.workers.attention",
        "loomllm.workers.device",
        "loomllm.workers.kernels",
        "loomllm.workers.models.llama",
    },
    # The batched LoRA kernel (kernels/lora.py) runs in the runner's adapter layers.
    "loomllm.workers.runner": {
        "loomllm.protocols",
        "loomllm.workers.attention",
        "loomllm.workers.device",
        "loomllm.workers.kernels",
        "loomllm.workers.sample",
    },
    # The worker sizes a CPU worker's threads to the cores it gets (device/cpu_threads.py).
    "loomllm.workers.worker": {
        "loomllm.protocols",
        "loomllm.workers.device",
        "loomllm.workers.models",
        "loomllm.workers.runner",
        "loomllm.workers.sample",
    },
    # The manager places the worker's Ray actor class (which imports no torch) on a cluster,
    # and downloads models from the Hub where its workers load them (models/hub.py).
    # It sets OpenMP's spin count for its workers (device/cpu_threads.py).
    "loomllm.workers.manager": {
        "loomllm.protocols",
        "loomllm.workers.device",
        "loomllm.workers.models",
        "loomllm.workers.worker",
    },
    "loomllm.workers": set(),  # workers/__init__.py, and any module put at the top of workers/
}
# Benchmarks measure everything; nothing imports them (`loom bench` finds them by name).
ANYTHING = {"loomllm.benchmarks"}
USER_SIDE_TOP_MODULES = {"errors", "config", "outputs", "llm"}


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in SOURCE_FOLDERS.items():
        for path in (REPO_ROOT / folder).rglob("*.py"):
            parts = path.relative_to(REPO_ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


MODULES = modules()


def unit(module: str) -> str:
    """The folder a module belongs to; modules at the top of loomllm are units of their own."""
    if MODULES[module].name == "__init__.py":
        return module
    parent, _, name = module.rpartition(".")
    if parent == "loomllm" and name in USER_SIDE_TOP_MODULES:
        return module
    return parent


def is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


# Statements whose bodies run when the module is imported (functions' and classes' bodies
# that are not called at import are walked only for the whole-file graph).
MODULE_LEVEL_BLOCKS = (ast.If, ast.Try, ast.With)


def imported(tree: ast.AST, module_level_only: bool = False) -> list[tuple[int, str]]:
    """(line, module) of every import, resolving `from package import submodule`; with
    `module_level_only`, those that run when the module is imported."""
    found = []
    nodes = list(tree.body) if module_level_only else [tree]
    while nodes:
        node = nodes.pop()
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.append((node.lineno, sub if sub in MODULES else node.module))
        if is_type_checking(node):  # only its `else:` runs
            nodes.extend(node.orelse)
        elif not module_level_only:
            nodes.extend(ast.iter_child_nodes(node))
        elif isinstance(node, MODULE_LEVEL_BLOCKS):
            nodes.extend(n for n in ast.iter_child_nodes(node) if isinstance(n, ast.stmt))
    return found


def test_no_relative_imports():
    """Every import names its module in full, so that the graph below sees all of them."""
    relative = [
        f"{path.relative_to(REPO_ROOT)}:{node.lineno}"
        for path in MODULES.values()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.level > 0
    ]
    assert not relative


def graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        targets = imported(ast.parse(path.read_text(), str(path)))
        edges[module] = {target for _, target in targets if target in MODULES} - {module}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in edges.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def unit_graph() -> dict[str, set[str]]:
    units: dict[str, set[str]] = {}
    for module, targets in graph().items():
        if module == "loomllm":  # the lazy public names: string lookups, not imports
            continue
        units.setdefault(unit(module), set()).update(unit(t) for t in targets)
    return {name: targets - {name} for name, targets in units.items()}


def test_no_import_cycles_between_files():
    assert cycles(graph()) == []


def test_no_import_cycles_between_folders():
    assert cycles(unit_graph()) == []


def test_every_folder_imports_only_what_the_package_graph_allows():
    units = unit_graph()
    unknown = sorted(set(units) - set(ALLOWED) - ANYTHING)
    assert not unknown, f"units missing from ALLOWED: {unknown}"
    offenders = [
        f"{name} imports {sorted(targets - ALLOWED[name])}"
        for name, targets in sorted(units.items())
        if name in ALLOWED and targets - ALLOWED[name]
    ]
    assert not offenders, "\n".join(offenders)


def test_nothing_imports_the_benchmarks():
    importers = [
        m
        for m, targets in graph().items()
        if unit(m) not in ANYTHING and ANYTHING & {unit(t) for t in targets}
    ]
    assert not importers


@pytest.mark.parametrize(
    ("folder", "banned", "module_level_only"),
    [
        ("protocols", {"torch", "loomllm"}, False),
        ("runtime", {"torch"}, False),
        ("workers/manager", {"torch"}, True),
    ],
)
def test_third_party_rules(folder, banned, module_level_only):
    """protocols is pure Python; the user's side never imports torch, the daemon only lazily."""
    offenders = []
    for path in sorted((REPO_ROOT / folder).rglob("*.py")):
        for line, name in imported(ast.parse(path.read_text()), module_level_only):
            top = name.split(".")[0]
            if top in banned and not name.startswith("loomllm.protocols"):
                offenders.append(f"{path.relative_to(REPO_ROOT)}:{line} imports {name}")
    assert not offenders, "\n".join(offenders)
