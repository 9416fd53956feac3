"""Dependency direction is machine-checked: core <- storage <- train <- runs <- tasks <- flows <- ops <- cli.

We parse every module's imports (static AST, including imports inside functions) instead of
importing the package, so a violation is caught even on a code path no test executes.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "atoll"

# Lower index = lower layer. A module may import its own layer and any lower one.
# `sim` (the fleet simulator) sits beside storage: it may use core, and nothing below cli uses it.
# `runs` (run management, reporting, the healing policy) is Prefect-free; `tasks` is where Prefect starts;
# `ops` (local stack, deployments, launching runs) operates the flows.
LAYERS = ["core", "storage", "sim", "train", "runs", "tasks", "flows", "ops", "cli"]
RANK = {"core": 0, "storage": 1, "sim": 1, "train": 2, "runs": 3, "tasks": 4, "flows": 5, "ops": 6, "cli": 7}
PREFECT_FREE = ("core", "storage", "sim", "train", "runs")


def _layer_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "atoll" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in RANK else None


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import: resolve against the package
                pkg = path.relative_to(SRC.parent).with_suffix("").parts[: -node.level]
                base = ".".join(pkg)
                found.append((node.lineno, f"{base}.{node.module}" if node.module else base))
            elif node.module:
                found.append((node.lineno, node.module))
    return found


def _modules() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(SRC)))
def test_imports_point_down(path: Path) -> None:
    rel = path.relative_to(SRC)
    own = rel.parts[0]
    if own not in RANK:
        return  # atoll/__init__.py and other top-level helpers
    for lineno, module in _imports(path):
        target = _layer_of(module)
        if target is None or target == own:
            continue
        assert RANK[target] < RANK[own] or (own == "cli"), (
            f"{rel}:{lineno} imports {module}: layer {own!r} must not depend on {target!r} "
            f"(order: {' <- '.join(LAYERS)})"
        )
        assert not (own == "storage" and target == "sim") and not (own == "sim" and target == "storage"), (
            f"{rel}:{lineno}: storage and sim are independent siblings"
        )


def test_core_imports_only_torch_and_stdlib() -> None:
    allowed = set(sys.stdlib_module_names) | {"torch", "atoll", "__future__"}
    for path in sorted((SRC / "core").rglob("*.py")):
        for lineno, module in _imports(path):
            top = module.split(".")[0]
            assert top in allowed, f"core/{path.name}:{lineno} imports {module}; core may use torch + stdlib only"
            if top == "atoll":
                assert module.startswith("atoll.core"), f"core/{path.name}:{lineno} imports {module}"


@pytest.mark.parametrize("layer", PREFECT_FREE)
def test_layers_below_tasks_import_no_prefect(layer: str) -> None:
    for path in sorted((SRC / layer).rglob("*.py")):
        for lineno, module in _imports(path):
            assert module.split(".")[0] != "prefect", (
                f"{layer}/{path.relative_to(SRC / layer)}:{lineno} imports {module}; {layer} must run without Prefect")


def test_every_package_has_a_layer() -> None:
    packages = {p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages == set(RANK), f"packages without a layer: {packages - set(RANK)}"



def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _import_graph() -> dict[str, set[str]]:
    """atoll module -> the atoll modules it imports (anywhere in it, functions included)."""
    names = {_module_name(p) for p in _modules()}
    graph: dict[str, set[str]] = {}
    for path in _modules():
        own = _module_name(path)
        edges = graph.setdefault(own, set())
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = ".".join(path.relative_to(SRC.parent).with_suffix("").parts[: -node.level])
                    base = f"{pkg}.{base}" if base else pkg
                # ``from atoll.x import y`` imports module atoll.x.y when there is one
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in names else base for a in node.names]
            else:
                continue
            for module in targets:
                while module and module not in names:
                    module = module.rpartition(".")[0]
                if module and module != own and not _is_package(module):
                    edges.add(module)
    return graph


def test_no_import_circle() -> None:
    """No two modules import each other, directly or around a loop (a package's __init__ aside)."""
    graph = _import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                loop = path[path.index(nxt):] + [nxt]
                raise AssertionError(f"import circle: {' -> '.join(loop)} (move what both need into a module "
                                     "both can import)")
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state and not _is_package(node):
            visit(node)


def _is_package(module: str) -> bool:
    return (SRC.parent / module.replace(".", "/") / "__init__.py").exists()
