"""Which build of impl/ a process runs: the mypyc extensions or the Python sources."""

from __future__ import annotations

import importlib.machinery
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvspec.impl.block_pool as block_pool
from kvspec import impl

ROOT = Path(__file__).resolve().parent.parent


def _module_file(module: str, **env: str) -> str:
    code = f"from kvspec import impl; import {module} as m; print(impl.COMPILED, m.__file__)"
    result = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **env),
                            cwd=ROOT, capture_output=True, text=True, check=True)
    return result.stdout.strip()


def test_this_process_runs_the_build_it_reports() -> None:
    compiled = block_pool.__file__.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))
    assert compiled == impl.COMPILED


def test_pure_python_switch_imports_the_sources() -> None:
    out = _module_file("kvspec.impl.kv_cache_manager", KVSPEC_PURE_PYTHON="1")
    assert out.startswith("False ") and out.endswith("kv_cache_manager.py"), out


@pytest.mark.skipif(not impl.COMPILED, reason="impl/ is not compiled here (make compile)")
def test_compiled_build_is_used_by_default() -> None:
    out = _module_file("kvspec.impl.kv_cache_manager", KVSPEC_PURE_PYTHON="0")
    assert out.startswith("True ") and not out.endswith(".py"), out


def test_typed_errors_in_either_build() -> None:
    """Compiled functions check annotated argument types with a bare TypeError; the public
    parameters that take user input are left unchecked so the typed error comes first."""
    pool = block_pool.BlockPool(4, True, 16)
    with pytest.raises(block_pool.InvalidBlockCountError, match=r"2\.5"):
        pool.get_new_blocks(2.5)  # type: ignore[arg-type]
    with pytest.raises(block_pool.InvalidBlockHashError, match="'abc'"):
        pool.get_cached_block("abc", [0])  # type: ignore[arg-type]
    with pytest.raises(block_pool.InvalidBlockCountError, match="'4'"):
        block_pool.BlockPool("4", True, 16)  # type: ignore[arg-type]
