"""Size limits are machine-checked: every module, class and function of atoll stays readable whole.

* a module: at most 600 lines;
* a class: at most 30 methods defined in its own body (inherited ones do not count);
* a function or method: at most 60 lines, from its ``def`` line to its last line, docstring
  included (decorators not counted; a nested function counts on its own and inside its parent).

Like test_layers.py, this parses every module (static AST) instead of importing the package.
A failure names each offender as ``path:line`` with its size and the limit.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "atoll"
ROOT = SRC.parents[1]

MAX_MODULE_LINES = 600
MAX_CLASS_METHODS = 30
MAX_FUNCTION_LINES = 60

Function = ast.FunctionDef | ast.AsyncFunctionDef


def _modules() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def _where(path: Path) -> str:
    """``path`` as a failure names it: relative to the repository when it lies inside."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


@cache
def _parse(path: Path) -> tuple[int, ast.Module]:
    text = path.read_text()
    return len(text.splitlines()), ast.parse(text, filename=str(path))


def _definitions(tree: ast.AST, prefix: str = "") -> list[tuple[str, ast.ClassDef | Function]]:
    """Every class and function in ``tree``, nested ones included, with its qualified name."""
    found: list[tuple[str, ast.ClassDef | Function]] = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            name = f"{prefix}{node.name}"
            found.append((name, node))
            found += _definitions(node, f"{name}.")
        else:
            found += _definitions(node, prefix)
    return found


def module_too_long(path: Path) -> list[str]:
    lines, _ = _parse(path)
    if lines <= MAX_MODULE_LINES:
        return []
    return [f"{_where(path)}:1: {lines} lines; the limit is {MAX_MODULE_LINES} lines per module"]


def classes_with_too_many_methods(path: Path) -> list[str]:
    _, tree = _parse(path)
    out = []
    for name, node in _definitions(tree):
        if isinstance(node, ast.ClassDef):
            methods = sum(isinstance(b, ast.FunctionDef | ast.AsyncFunctionDef) for b in node.body)
            if methods > MAX_CLASS_METHODS:
                out.append(f"{_where(path)}:{node.lineno}: class {name} defines {methods} methods; "
                           f"the limit is {MAX_CLASS_METHODS} methods per class")
    return out


def functions_too_long(path: Path) -> list[str]:
    _, tree = _parse(path)
    out = []
    for name, node in _definitions(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                out.append(f"{_where(path)}:{node.lineno}: {name} is {lines} lines (def to last line); "
                           f"the limit is {MAX_FUNCTION_LINES} lines per function")
    return out


_IDS = {"ids": lambda p: str(p.relative_to(SRC))}


@pytest.mark.parametrize("path", _modules(), **_IDS)
def test_module_at_most_600_lines(path: Path) -> None:
    problems = module_too_long(path)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", _modules(), **_IDS)
def test_classes_at_most_30_methods(path: Path) -> None:
    problems = classes_with_too_many_methods(path)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", _modules(), **_IDS)
def test_functions_at_most_60_lines(path: Path) -> None:
    problems = functions_too_long(path)
    assert not problems, "\n".join(problems)


# -- the checks themselves, on a synthetic module (a check that never fires proves nothing) ------


def _function(name: str, lines: int, indent: str = "") -> str:
    """Source of a function of exactly ``lines`` lines (def line included), with a decorator."""
    body = "".join(f"{indent}    x = {i}\n" for i in range(lines - 2))
    return f"{indent}@staticmethod\n{indent}def {name}():\n{indent}    '''doc'''\n{body}"


def test_the_checks_fire_at_the_limits_and_name_file_line_and_limit(tmp_path: Path) -> None:
    methods = "".join(_function(f"m{i}", 3, "    ") for i in range(MAX_CLASS_METHODS))
    ok = tmp_path / "ok.py"
    ok.write_text(_function("at_limit", MAX_FUNCTION_LINES) + f"class Full:\n{methods}")
    assert (module_too_long(ok), classes_with_too_many_methods(ok), functions_too_long(ok)) == ([], [], [])

    nested = "def outer():\n" + _function("inner", MAX_FUNCTION_LINES + 1, "    ")
    over = tmp_path / "over.py"
    over.write_text(f"class Big:\n{methods}{_function('extra', 3, '    ')}" + nested
                    + "x = 0\n" * MAX_MODULE_LINES)
    big_line = 1
    outer_line = 2 + 4 * (MAX_CLASS_METHODS + 1)  # after the class line and its methods (decorator + 3 lines)
    assert module_too_long(over) == [
        f"{over}:1: {outer_line + MAX_FUNCTION_LINES + 2 + MAX_MODULE_LINES} lines; "
        f"the limit is {MAX_MODULE_LINES} lines per module"]
    assert classes_with_too_many_methods(over) == [
        f"{over}:{big_line}: class Big defines {MAX_CLASS_METHODS + 1} methods; "
        f"the limit is {MAX_CLASS_METHODS} methods per class"]
    assert functions_too_long(over) == [
        f"{over}:{outer_line}: outer is {MAX_FUNCTION_LINES + 3} lines (def to last line); "
        f"the limit is {MAX_FUNCTION_LINES} lines per function",
        f"{over}:{outer_line + 2}: outer.inner is {MAX_FUNCTION_LINES + 1} lines (def to last line); "
        f"the limit is {MAX_FUNCTION_LINES} lines per function"]
