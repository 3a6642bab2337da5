"""Reload mutants: kvspec in place of vLLM meets vLLM's own tests, which reload
``kv_cache_utils`` (``test_none_hash``). Killed by tests/test_kv_cache_utils.py.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from kvspec.impl import kv_cache_blocks, kv_cache_utils
from tests.mutants import Mutant

RELOAD = "tests/test_kv_cache_utils.py"


class _ClassesInKvCacheUtils(importlib.machinery.SourceFileLoader):
    """Executes kv_cache_utils, then the block classes' source into the same namespace: the
    layout before the fix, where kv_cache_utils defined ``KVCacheBlock`` and the free queue
    itself, so that a reload re-created them."""

    def exec_module(self, module: ModuleType) -> None:
        super().exec_module(module)
        source = Path(kv_cache_blocks.__file__ or "").read_text()
        exec(compile(source, kv_cache_blocks.__file__ or "", "exec"), vars(module))


class _Finder:
    """Finds kv_cache_utils with the loader above (a reload looks its module up again)."""

    def __init__(self, name: str, origin: str) -> None:
        self.name, self.origin = name, origin

    def find_spec(self, name: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        if name != self.name:
            return None
        return importlib.util.spec_from_file_location(
            name, self.origin, loader=_ClassesInKvCacheUtils(name, self.origin))


def block_classes_defined_in_kv_cache_utils() -> None:
    """The block classes live in kv_cache_utils again: a reload of it makes new classes, whose
    checks refuse the blocks made before it."""
    spec = kv_cache_utils.__spec__
    if spec is None or spec.origin is None:
        raise AttributeError("kv_cache_utils has no spec to plant into: the mutant is out of date")
    sys.meta_path.insert(0, _Finder(spec.name, spec.origin))


MUTANTS: list[Mutant] = [
    Mutant(
        "reload-new-block-classes",
        "a reload of kv_cache_utils (vLLM's test_none_hash) re-creates KVCacheBlock and the "
        "free queue, refusing the blocks made before it",
        block_classes_defined_in_kv_cache_utils,
        (f"{RELOAD}::test_reload_keeps_the_classes_and_the_blocks_made_before",),
    ),
]
