"""Lay out kvspec's sources as the installed package, ``build/view/kvspec/``, for the static tools.

The repository keeps each layer as a real top-level folder (spec/, impl/, models/,
conformance/) and one import name over them: pyproject.toml's ``[tool.setuptools.package-dir]``
maps ``kvspec.spec`` to ``spec/`` and so on (a wheel, pip and the runtime follow it). mypy and
mypyc name a module by the folders it sits in, not by that table, so they read a copy of the
sources laid out as the wheel lays them out: ``build/view/kvspec/spec/pool.py`` and so on.

The copy is made anew by every command that needs it (``make check``, scripts/compile.py);
nothing in build/ is edited by hand. ``python scripts/package_view.py`` prints its path;
``--unview`` turns paths in the view back into repository paths on standard input (mypy's
messages then name the files you edit).
"""

from __future__ import annotations

import shutil
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VIEW = ROOT / "build" / "view"


def package_dirs(root: Path = ROOT) -> dict[str, str]:
    """pyproject.toml's table: import package -> folder of the repository."""
    with open(root / "pyproject.toml", "rb") as file:
        table: dict[str, str] = tomllib.load(file)["tool"]["setuptools"]["package-dir"]
    return table


def _skipped(_directory: str, names: list[str]) -> list[str]:
    return [n for n in names if n == "__pycache__" or n.endswith((".so", ".pyd", ".pyc"))]


def make_view(root: Path = ROOT, view: Path = VIEW) -> Path:
    """Copy each package's own files to where the wheel puts them; returns the view's root."""
    shutil.rmtree(view, ignore_errors=True)
    for package, folder in sorted(package_dirs(root).items()):
        target = view.joinpath(*package.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for source in (root / folder).iterdir():
            if source.is_file() and not _skipped("", [source.name]):
                shutil.copy2(source, target / source.name)
            elif source.is_dir() and source.name != "__pycache__" \
                    and not (source / "__init__.py").exists():
                shutil.copytree(source, target / source.name, ignore=_skipped)
    return view


def unview(line: str, root: Path = ROOT, view: Path = VIEW) -> str:
    """A path of the view in ``line`` as the repository's path (for tools' messages)."""
    for package, folder in sorted(package_dirs(root).items(), key=lambda kv: -len(kv[0])):
        for prefix in (str(view.joinpath(*package.split("."))),
                       str(view.relative_to(root).joinpath(*package.split(".")))):
            line = line.replace(prefix + "/", folder + "/")
    return line


if __name__ == "__main__":
    if "--unview" in sys.argv[1:]:
        for text in sys.stdin:
            sys.stdout.write(unview(text))
    else:
        print(make_view())
