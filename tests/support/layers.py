"""Which way imports go: find every import of a layer that points where the layer must not look.

Two looks, because each sees what the other cannot:

* ``static_violations`` reads every file of a package with ``ast`` and lists every import in it -
  at module level, inside functions (the lazy imports the CLI uses), under ``TYPE_CHECKING``,
  relative or absolute, and ``importlib.import_module("...")`` calls with a literal name - that
  names a forbidden module, with its file and line;
* ``loaded_modules`` imports every module of a package in a fresh interpreter, resolves every name
  of every ``__all__`` (the packages export lazily), and returns what ``sys.modules`` then holds:
  what the layer pulls in at run time, through other packages too.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path


def module_files(root: Path, package: str, exclude: Iterable[str] = ()) -> Iterator[tuple[str, Path]]:
    """``(module name, file)`` for every ``.py`` file of ``package`` under ``root``, sorted;
    modules named in ``exclude`` (and their submodules) are left out."""
    skipped = tuple(exclude)
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if not any(_within(name, prefix) for prefix in skipped):
            yield name, path


def imports_in(path: Path, module: str) -> Iterator[tuple[int, str]]:
    """``(line, imported module)`` for every import statement and literal ``import_module`` call."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            target = _absolute(package, node.level, node.module)
            yield node.lineno, target
            for alias in node.names:  # ``from pkg import submodule`` imports pkg.submodule
                yield node.lineno, f"{target}.{alias.name}"
        elif isinstance(node, ast.Call) and _is_import_call(node):
            yield node.lineno, node.args[0].value  # type: ignore[attr-defined]


def static_violations(
    root: Path, package: str, forbidden: Iterable[str], exclude: Iterable[str] = ()
) -> list[str]:
    """``file:line imports name`` for every import in ``package`` of a ``forbidden`` module."""
    banned = tuple(forbidden)
    found = []
    for module, path in module_files(root, package, exclude):
        for line, name in imports_in(path, module):
            if any(_within(name, prefix) for prefix in banned):
                found.append(f"{path.relative_to(root)}:{line} imports {name}")
    return sorted(set(found))


def outside(root: Path, package: str, allowed: Iterable[str]) -> list[str]:
    """``file:line imports name`` for every absolute import of a top-level package that is neither
    the standard library nor one of ``allowed``."""
    permitted = set(allowed) | set(sys.stdlib_module_names) | {"__future__", package}
    found = []
    for module, path in module_files(root, package):
        for line, name in imports_in(path, module):
            if name.split(".")[0] not in permitted:
                found.append(f"{path.relative_to(root)}:{line} imports {name}")
    return sorted(set(found))


def import_cycles(root: Path, package: str) -> list[list[str]]:
    """Every set of ``package``'s modules that import one another in a circle (each sorted), by the
    imports ``imports_in`` lists (a package's ``__init__`` is left out: its lazy names import
    nothing)."""
    files = {name: path for name, path in module_files(root, package) if path.name != "__init__.py"}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        graph[name] = set()
        for _, imported in imports_in(path, name):
            while imported and imported not in files:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                graph[name].add(imported)
    return sorted(sorted(c) for c in _circles(graph))


def _circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            node, successors = work[-1]
            step = next(successors, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    work.append((step, iter(sorted(graph[step]))))
                elif step in stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


_LOAD = """
import importlib, json, sys
for name in {modules!r}:
    module = importlib.import_module(name)
    for export in getattr(module, "__all__", ()):
        getattr(module, export)
print(json.dumps(sorted(sys.modules)))
"""


def loaded_modules(root: Path, modules: Iterable[str], timeout: float = 240) -> set[str]:
    """Every module loaded once ``modules`` (and every name they export) are imported, in a fresh
    interpreter whose path puts ``root`` first."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", _LOAD.format(modules=sorted(modules))],
        capture_output=True, text=True, env=env, cwd=root, timeout=timeout, check=False,
    )
    if done.returncode != 0:
        raise AssertionError(f"importing the layer failed:\n{done.stderr}")
    return set(json.loads(done.stdout.splitlines()[-1]))


def forbidden_loaded(loaded: Iterable[str], forbidden: Iterable[str]) -> list[str]:
    """The loaded modules that are, or live inside, a forbidden one."""
    banned = tuple(forbidden)
    return sorted(name for name in loaded if any(_within(name, prefix) for prefix in banned))


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _absolute(package: str, level: int, module: str | None) -> str:
    if not level:
        return module or ""
    parts = package.split(".")
    base = parts[: len(parts) - level + 1]
    return ".".join([*base, module] if module else base)


def _is_import_call(node: ast.Call) -> bool:
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    first = node.args[0] if node.args else None
    return name in ("import_module", "__import__") and isinstance(first, ast.Constant) and isinstance(
        first.value, str
    )
