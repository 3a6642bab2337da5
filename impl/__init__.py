"""kvspec's fast, vLLM 0.13-compatible KV-cache block management (checked against spec/).

Two builds of the same sources. ``make setup`` compiles the modules in ``COMPILED_MODULES``
with mypyc (scripts/compile.py) into C extensions beside their ``.py`` files, which Python
then imports instead, and a wheel (``pip install``) carries them the same way; without a C
compiler they stay pure Python. The sources are used
when ``KVSPEC_PURE_PYTHON=1`` is set (the mutant runner sets it: compiled classes cannot be
monkeypatched) or when a source is newer than its extension (an edit after the last
compile: the stale extension is ignored, with a warning, rather than shadowing the edit).
``COMPILED`` says which build this process runs.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
import warnings
from pathlib import Path

COMPILED_MODULES = (
    "kv_cache_blocks",  # not kv_cache_utils, which re-exports it: vLLM's tests reload that
    "block_pool",
    "block_pool_033",  # vLLM 0.33's pool: the hot one inside a vLLM 0.33 process
    "single_type_kv_cache_manager",
    "kv_cache_coordinator",
    "kv_cache_manager",
    "request_hasher",  # the block hasher's no-new-block calls (impl/hashing.py)
)

_HERE = Path(__file__).resolve().parent


def _extension(module: str) -> Path | None:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = _HERE / f"{module}{suffix}"
        if path.exists():
            return path
    return None


def _use_compiled_build() -> bool:
    extensions = {m: _extension(m) for m in COMPILED_MODULES}
    if not any(extensions.values()):
        return False
    if os.environ.get("KVSPEC_PURE_PYTHON", "") not in ("", "0"):
        return False
    if not (_HERE.parent / "pyproject.toml").exists():
        # An installed wheel: its extensions were built from these very sources (and pip does
        # not keep file times, so a time comparison would call them stale).
        return all(extensions.values())
    stale = [m for m, ext in extensions.items()
             if ext is None or ext.stat().st_mtime < (_HERE / f"{m}.py").stat().st_mtime]
    if stale:
        warnings.warn(f"kvspec: the compiled build of impl/ is older than {', '.join(stale)}; "
                      "using the Python sources (run `make compile`)", stacklevel=2)
        return False
    return True


COMPILED = _use_compiled_build()
if not COMPILED:  # import impl/'s submodules from their .py files, not from extensions
    for _entry in __path__:
        sys.path_importer_cache[_entry] = importlib.machinery.FileFinder(
            _entry,
            (importlib.machinery.SourceFileLoader, importlib.machinery.SOURCE_SUFFIXES),
            (importlib.machinery.SourcelessFileLoader, importlib.machinery.BYTECODE_SUFFIXES),
        )
