"""Compile kvspec.impl.COMPILED_MODULES with mypyc (part of mypy) into C extensions.

One place says how kvspec's hot modules are compiled, for both builds that do it:

* a checkout: ``python scripts/compile.py`` from the repo root (``make compile``; ``make
  setup`` runs it) builds the extensions in place, beside their sources in impl/, which Python
  then imports instead (``--clean`` removes them);
* a wheel: setup.py takes ``mypyc_extensions()``, so ``pip install`` of kvspec installs the
  compiled build.

Where there is no C compiler, Python headers or mypyc, or KVSPEC_PURE_PYTHON=1 is set, nothing
is compiled (with a note): the pure-Python build is complete on its own.

What a build costs (docs/plugin.md has the figures): mypyc type-checks the modules and writes
their C, one file per group (``groups()``), then the C compiler compiles the groups side by
side (``JOBS``). mypyc's type check reads only what it needs (``MYPY_CONFIG``): kvspec's own
modules and msgspec's stubs.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import shutil
import sys
import sysconfig
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build" / "mypyc"

# mypyc's groups: each is one C file, one gcc process and one shared library
# (impl/compiled_pool__mypyc.*.so, impl/compiled_managers__mypyc.*.so) beside a small shim
# per module. One group of all six modules was one 5.6 MB C file, ~40 s of one core at -O3;
# these two, the pool layer and the managers above it, are about equal halves that compile
# at once on two cores. Calls between groups go through mypyc's export tables instead of
# direct C calls, and gcc cannot inline across them: the pool and manager benchmarks execute
# within 0.7% of the one group's instructions (docs/benchmarks.md, "Issue 28 as a whole").
POOL_GROUP = "kvspec.impl.compiled_pool"
POOL_GROUP_MODULES = ("kv_cache_blocks", "block_pool", "request_hasher")
MANAGERS_GROUP = "kvspec.impl.compiled_managers"  # every other module of COMPILED_MODULES
# Parallel compile jobs (setuptools' build_ext --parallel): one per group, at most the cores.
JOBS = max(1, min(2, os.cpu_count() or 1))

# The mypy configuration of mypyc's type check (not `make check`'s, which is pyproject.toml's).
# mypy follows impl's imports, function-level ones too, into whatever the building Python has
# installed (pip's build isolation hides the environment from imports, not from mypy, which
# asks the interpreter for its site-packages): torch, and inside a vLLM environment vLLM and
# transformers. mypyc keeps every function body it reads (mypy's preserve_asts), so the check
# read 2,548 modules (~90 s CPU) in .venv and more in a vLLM environment, most of the 14-17
# minutes `pip install` took there. None of it reaches the C: impl's compiled modules use those
# packages' objects as plain Python objects. So only kvspec's own modules and msgspec's stubs
# (kv_events' classes) are read, ~110 modules and ~2 s, and the rest is Any whether installed
# or not (numpy's stubs too, which mypy would read despite follow_imports): the C mypyc writes
# is byte for byte what the full check gave, with or without those packages installed.
MYPY_CONFIG = """\
[mypy]
follow_imports = skip
ignore_missing_imports = True
cache_dir = /dev/null

[mypy-kvspec.*,msgspec.*]
follow_imports = normal

[mypy-numpy.*]
follow_imports_for_stubs = True
"""


def _load_package_view() -> Any:
    # By path: setup.py loads this file the same way, with no package around it.
    spec = importlib.util.spec_from_file_location(
        "kvspec_package_view", Path(__file__).resolve().parent / "package_view.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_package_view = _load_package_view()


def compiled_modules() -> tuple[str, ...]:
    """impl's COMPILED_MODULES, read from impl/__init__.py without importing kvspec."""
    tree = ast.parse((ROOT / "impl" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "COMPILED_MODULES" for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    raise LookupError("impl/__init__.py defines no COMPILED_MODULES")


def compiled_files() -> list[Path]:
    return [*ROOT.glob("kvspec_impl__mypyc*"),  # where earlier versions put the library
            *(ROOT / "impl").glob("*.so"), *(ROOT / "impl").glob("*.pyd")]


def clean() -> None:
    for path in compiled_files():
        path.unlink()


def why_not_compiled() -> str | None:
    """Why this Python cannot (or must not) compile kvspec, or None when it can."""
    if os.environ.get("KVSPEC_PURE_PYTHON", "") not in ("", "0"):
        return "KVSPEC_PURE_PYTHON is set"
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if not shutil.which(compiler) or not Path(sysconfig.get_paths()["include"],
                                               "Python.h").exists():
        return "no C compiler or Python headers here"
    try:
        import mypyc.build  # noqa: F401
    except ImportError:
        return "mypyc (part of mypy) is not installed"
    return None


def groups() -> list[tuple[str, tuple[str, ...]]]:
    """Each mypyc group's name and its modules (the comment on POOL_GROUP says why two)."""
    modules = compiled_modules()
    pool = tuple(m for m in modules if m in POOL_GROUP_MODULES)
    managers = tuple(m for m in modules if m not in POOL_GROUP_MODULES)
    return [(name, members) for name, members in ((POOL_GROUP, pool),
                                                  (MANAGERS_GROUP, managers)) if members]


def mypyc_extensions(target_dir: Path = BUILD / "c") -> list[Any]:
    """The setuptools extensions of impl's compiled modules ([] where it cannot compile)."""
    if why_not_compiled() is not None:
        return []
    from mypyc.build import mypycify

    # mypyc names a module by its folders: it compiles the copy laid out as the wheel lays
    # it out (build/view/kvspec/impl/), so that the modules are named kvspec.impl.*.
    view = _package_view.make_view(ROOT)
    impl = view / "kvspec" / "impl"
    separate: list[tuple[list[str], str | None]] = [
        ([str(impl / f"{m}.py") for m in members], name) for name, members in groups()]
    config = target_dir.parent / "mypy.ini"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(MYPY_CONFIG)
    # -g0: no debug information (the machine code is the same as with mypyc's -g1; gcc spends
    # about a tenth of its time on it).
    extensions: list[Any] = mypycify(
        ["--config-file", str(config), *(path for paths, _ in separate for path in paths)],
        opt_level="3", debug_level="0", separate=separate, target_dir=str(target_dir))
    return extensions


def main(argv: list[str]) -> int:
    clean()
    if "--clean" in argv:
        return 0
    reason = why_not_compiled()
    if reason is not None:
        print(f"compile: {reason}; impl/ stays pure Python")
        return 0
    from setuptools import Distribution  # type: ignore[import-untyped]

    BUILD.mkdir(parents=True, exist_ok=True)
    extensions = mypyc_extensions()
    # A bare Distribution, not setup(): setup() would read the project's pyproject.toml.
    # package_dir: build_ext --inplace puts kvspec.impl's extensions beside impl/'s sources.
    dist = Distribution({"name": "kvspec-impl-compiled", "ext_modules": extensions,
                         "package_dir": _package_view.package_dirs(ROOT)})
    dist.script_args = ["-q", "build_ext", "--inplace", "--build-temp", str(BUILD / "temp"),
                        "--parallel", str(JOBS)]
    dist.parse_command_line()
    dist.run_commands()
    for path in compiled_files():  # the per-module shims are rebuilt only when their C
        os.utime(path)             # changes; impl/ compares these times with the sources'
    print(f"compile: {len(compiled_modules())} modules of impl/ compiled with mypyc")
    return 0


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main(sys.argv[1:]))
