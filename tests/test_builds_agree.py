"""The compiled build refuses exactly as the pure one does, under ``python -O``.

The hostile-input suite (tests/hostile/) runs twice, derandomized so that both runs draw the
same bad calls, once on impl's mypyc-compiled modules and once on their Python sources, each
recording every call's verdict and error class (``KVSPEC_HOSTILE_RECORD``). The two records
must be the same, call for call: the same typed error for the same input, never a compiled
build's bare ``TypeError`` where the sources raise the typed one. Both runs are under
``python -O`` (``PYTHONOPTIMIZE`` too), so the suite must also pass in each build with asserts
off: impl must not lean on them. ``make test`` runs the suite itself, compiled, without -O, and
``make test-pure`` on the sources.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvspec import impl

ROOT = Path(__file__).resolve().parent.parent
# Each run of the hostile suite took about 10 min with the cores shared among a dozen
# processes: the timeout only stops a hang.
HANG_CAP = 3600


def _record(build: str, pure: str, folder: Path) -> list[dict[str, str]]:
    path = folder / f"{build}.jsonl"
    env = dict(os.environ, KVSPEC_PURE_PYTHON=pure, KVSPEC_HOSTILE_RECORD=str(path),
               KVSPEC_PROFILE="ci",  # derandomized: both builds draw the same calls
               PYTHONOPTIMIZE="1")  # asserts off in every process the suite starts
    done = subprocess.run([sys.executable, "-O", "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/hostile"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=HANG_CAP, check=False)
    assert done.returncode == 0, f"the hostile suite fails on the {build} build under -O:\n" \
                                 f"{done.stdout[-4000:]}"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.mark.skipif(not impl.COMPILED, reason="impl/ is not compiled here (make compile)")
def test_compiled_and_pure_builds_refuse_every_bad_call_alike(tmp_path: Path) -> None:
    compiled = _record("compiled", "0", tmp_path)
    pure = _record("pure", "1", tmp_path)
    assert len(compiled) > 1000, f"only {len(compiled)} bad calls judged"
    differing = [(c, p) for c, p in zip(compiled, pure, strict=False) if c != p]
    assert len(compiled) == len(pure) and not differing, (
        f"{len(compiled)} calls compiled, {len(pure)} pure; first differences:\n"
        + "\n".join(f"  compiled {c}\n  pure     {p}" for c, p in differing[:5]))
