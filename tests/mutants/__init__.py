"""The mutant catalogue: realistic bugs planted into impl/ that the checkers must catch.

Each mutant module (``pool_mutants``, ``block_table_mutants``, ``manager_mutants``, ...)
exports ``MUTANTS: list[Mutant]``. A mutant's ``plant`` monkeypatches impl/ in the current
process; ``python -m tests.mutants`` runs each mutant's ``checker`` (pytest node ids) in a
fresh process with ``KVSPEC_MUTANT`` set and reports whether it was killed and how fast.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Mutant:
    name: str
    description: str
    plant: Callable[[], None]
    checker: tuple[str, ...]
    killed_by: str = ""  # the check expected to catch it: its name appears in the failure


def replace(owner: Any, name: str, replacement: Any) -> None:
    """Plant ``owner.name = replacement``, refusing a name the owner lacks: a mutant that
    patches nothing (its target renamed or inlined) would survive for the wrong reason."""
    if not hasattr(owner, name):
        raise AttributeError(f"{owner!r} has no {name!r} to replace: the mutant is out of date")
    setattr(owner, name, replacement)


def vllm_033_modules(*names: str) -> tuple[Any, ...] | None:
    """vLLM 0.33's modules ``vllm.<name>`` (``"v1.core.block_pool"``, ...), or None where
    this Python has no vLLM 0.33: a mutant planted into vLLM 0.33 plants nothing there (its
    checker reruns itself under .venv-vllm-0.33.0, which plants it)."""
    import os

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        import vllm

        modules = tuple(importlib.import_module(f"vllm.{name}") for name in names)
    except ImportError:
        return None
    if not str(getattr(vllm, "__version__", "")).startswith("0.33"):
        return None
    return modules


def catalogue() -> list[Mutant]:
    """Every mutant of every ``*_mutants`` module in this package, in module order."""
    found: list[Mutant] = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.endswith("_mutants"):
            module = importlib.import_module(f"{__name__}.{info.name}")
            found.extend(module.MUTANTS)
    names = [m.name for m in found]
    duplicated = {n for n in names if names.count(n) > 1}
    if duplicated:
        raise ValueError(f"duplicate mutant names: {sorted(duplicated)}")
    return found


def plant(name: str) -> None:
    """Plant the mutant called ``name`` into this process."""
    for mutant in catalogue():
        if mutant.name == name:
            mutant.plant()
            return
    raise LookupError(f"no mutant named {name!r}")
