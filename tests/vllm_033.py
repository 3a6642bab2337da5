"""The tests that need vLLM 0.33: whether this Python has it, and how a test file run from any
other environment runs its vLLM 0.33 tests again in .venv-vllm-0.33.0's Python."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VENV_PYTHON = ROOT / ".venv-vllm-0.33.0" / "bin" / "python"


def running_vllm_033() -> bool:
    """This interpreter imports vLLM 0.33."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        import vllm
    except ImportError:
        return False
    return str(getattr(vllm, "__version__", "")).startswith("0.33")


def rerun_under_vllm_033(test_file: str, *pytest_args: str) -> None:
    """Run ``test_file`` (its tests selected by ``pytest_args``) in .venv-vllm-0.33.0's
    Python, with this environment passed on (so a planted mutant goes with it), on impl's
    Python sources; skipped where that environment has not been built. Fails with what the
    checks said first (the "E" lines), then the end of the run, and when nothing ran."""
    if not VENV_PYTHON.exists():
        pytest.skip("no .venv-vllm-0.33.0 (make vllm-env VLLM=0.33.0 builds it)")
    env = dict(os.environ, KVSPEC_PURE_PYTHON="1", VLLM_TARGET_DEVICE="cpu")
    done = subprocess.run(
        [str(VENV_PYTHON), "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *pytest_args,
         str(Path(test_file).resolve().relative_to(ROOT))],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200, check=False)
    said = [line for line in done.stdout.splitlines() if line.startswith("E ")]
    output = "\n".join(said[:20]) + "\n" + done.stdout[-4000:] + done.stderr[-2000:]
    assert done.returncode == 0, output
    assert "skipped" not in done.stdout.splitlines()[-1], output
    print(output, file=sys.stderr)
