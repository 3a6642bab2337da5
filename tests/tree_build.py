"""One setuptools build in the source tree at a time, across pytest-xdist's workers.

setuptools builds in the tree (``build/``, ``kvspec.egg-info``), so two builds at once trip
over each other's files ("File exists: build/bdist.linux-x86_64/wheel/...dist-info"), the
more often the slower the machine, as the builds then overlap for longer. Tests that build
(a wheel, a PEP 517 hook) hold this lock, a file lock under ``build/``, while they do; so do
the editable installs of kvspec into .venv (Makefile) and into the vLLM environments
(scripts/vllm_env.sh).
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def building_in_tree() -> Iterator[None]:
    """Wait until no other test process builds in the tree, then build."""
    path = ROOT / "build" / ".tree-build.lock"
    path.parent.mkdir(exist_ok=True)
    with path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
