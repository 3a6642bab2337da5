"""Compile kvspec.impl.COMPILED_MODULES with mypyc (part of mypy) into C extensions beside them.

``python scripts/compile.py`` from the repo root (``make compile``; ``make setup`` runs it).
Exits 0 without compiling, with a note, where there is no C compiler or Python headers: the
pure-Python build is complete on its own. ``--clean`` removes the extensions.
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build" / "mypyc"
GROUP = "kvspec.impl.compiled"  # mypyc's shared library: impl/compiled__mypyc.*.so


def compiled_files() -> list[Path]:
    return [*ROOT.glob("kvspec_impl__mypyc*"),  # where earlier versions put the library
            *(ROOT / "impl").glob("*.so"), *(ROOT / "impl").glob("*.pyd")]


def clean() -> None:
    for path in compiled_files():
        path.unlink()


def main(argv: list[str]) -> int:
    clean()
    if "--clean" in argv:
        return 0
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if not shutil.which(compiler) or not Path(sysconfig.get_paths()["include"],
                                               "Python.h").exists():
        print("compile: no C compiler or Python headers here; impl/ stays pure Python")
        return 0
    sys.path.insert(0, str(ROOT))
    try:
        from mypyc.build import mypycify
        from setuptools import Distribution  # type: ignore[import-untyped]
    except ImportError as missing:
        print(f"compile: {missing.name} is not installed; impl/ stays pure Python")
        return 0

    from kvspec import impl

    # Through the kvspec/impl link, so that mypyc names the modules kvspec.impl.*.
    sources = [f"kvspec/impl/{m}.py" for m in impl.COMPILED_MODULES]
    BUILD.mkdir(parents=True, exist_ok=True)
    # A bare Distribution, not setup(): setup() would read the project's pyproject.toml.
    dist = Distribution({
        "name": "kvspec-impl-compiled",
        "ext_modules": mypycify(sources, opt_level="3", group_name=GROUP,
                                target_dir=str(BUILD / "c")),
    })
    dist.script_args = ["-q", "build_ext", "--inplace", "--build-temp", str(BUILD / "temp")]
    dist.parse_command_line()
    dist.run_commands()
    for path in compiled_files():  # the per-module shims are rebuilt only when their C
        os.utime(path)             # changes; impl/ compares these times with the sources'
    print(f"compile: {len(sources)} modules of impl/ compiled with mypyc")
    return 0


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main(sys.argv[1:]))
