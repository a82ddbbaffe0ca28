"""The house layering rules, checked on the source: who may import whom.

protocols/ imports neither runtime nor workers nor torch; runtime/ never imports torch
or workers at module level (the user's process stays light and CUDA-free); workers/
never imports runtime.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = {
    "protocols": ({"runtime", "workers", "torch"}, "anywhere"),
    "runtime": ({"torch", "workers"}, "module level"),
    "workers": ({"runtime"}, "anywhere"),
}


def imports(tree: ast.Module, module_level_only: bool) -> list[tuple[int, str]]:
    nodes = tree.body if module_level_only else list(ast.walk(tree))
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module.split(".")[0]))
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_layering(package):
    banned, scope = FORBIDDEN[package]
    offenders = []
    for path in sorted((ROOT / package).rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for lineno, name in imports(tree, module_level_only=scope == "module level"):
            if name in banned:
                offenders.append(f"{path.relative_to(ROOT)}:{lineno} imports {name}")
    assert not offenders, f"{package}/ must not import {sorted(banned)} ({scope}):\n" + "\n".join(
        offenders
    )
