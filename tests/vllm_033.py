"""The tests that need vLLM 0.33: whether this Python has it, and how a test file run from any
other environment runs its vLLM 0.33 tests again in .venv-vllm-0.33.0's Python."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VENV_PYTHON = ROOT / ".venv-vllm-0.33.0" / "bin" / "python"
# A mutant worker serving the reruns in .venv-vllm-0.33.0's Python, with vLLM imported once
# (python -m tests.mutants starts it and names its socket here; tests/mutants/worker.py).
WORKER_VARIABLE = "KVSPEC_VLLM_033_WORKER"
# What the reruns import from vLLM 0.33: that worker imports them before it forks a rerun.
VLLM_MODULES = (
    "vllm.v1.core.block_pool", "vllm.v1.core.kv_cache_coordinator",
    "vllm.v1.core.kv_cache_manager", "vllm.v1.core.kv_cache_metrics",
    "vllm.v1.core.kv_cache_utils", "vllm.v1.core.single_type_kv_cache_manager",
    "vllm.distributed.kv_events", "vllm.v1.kv_offload.cpu.manager",
    "vllm.v1.kv_offload.cpu.policies.lru", "vllm.v1.kv_offload.cpu.policies.arc",
)
RERUN_TIMEOUT = 1200


def running_vllm_033() -> bool:
    """This interpreter imports vLLM 0.33."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        import vllm
    except ImportError:
        return False
    return str(getattr(vllm, "__version__", "")).startswith("0.33")


def rerun_env(base: Mapping[str, str]) -> dict[str, str]:
    """The environment of a rerun: ``base`` passed on, on impl's Python sources and CPU."""
    return dict(base, KVSPEC_PURE_PYTHON="1", VLLM_TARGET_DEVICE="cpu")


def rerun_under_vllm_033(test_file: str, *pytest_args: str) -> None:
    """Run ``test_file`` (its tests selected by ``pytest_args``) in .venv-vllm-0.33.0's
    Python, with this environment passed on (so a planted mutant goes with it), on impl's
    Python sources; skipped where that environment has not been built. Fails with what the
    checks said first (the "E" lines), then the end of the run, and when nothing ran."""
    if not VENV_PYTHON.exists():
        pytest.skip("no .venv-vllm-0.33.0 (make vllm-env VLLM=0.33.0 builds it)")
    env = rerun_env(os.environ)
    done = _pytest_under_vllm_033(
        ["-x", "-q", "-p", "no:cacheprovider", *pytest_args,
         str(Path(test_file).resolve().relative_to(ROOT))], env)
    said = [line for line in done.stdout.splitlines() if line.startswith("E ")]
    output = "\n".join(said[:20]) + "\n" + done.stdout[-4000:] + done.stderr[-2000:]
    assert done.returncode == 0, output
    assert "skipped" not in done.stdout.splitlines()[-1], output
    print(output, file=sys.stderr)


def _pytest_under_vllm_033(args: list[str], env: dict[str, str]
                           ) -> subprocess.CompletedProcess[str]:
    """pytest ``args`` in .venv-vllm-0.33.0's Python: forked by the mutant worker named in
    ``env`` where one serves, else in a process of its own."""
    command = [str(VENV_PYTHON), "-m", "pytest", *args]
    worker = env.get(WORKER_VARIABLE)
    if worker:
        from tests.mutants.worker import ask

        reply = ask(worker, args, env, str(ROOT), RERUN_TIMEOUT)
        if reply is not None:
            if reply["timed_out"]:
                raise subprocess.TimeoutExpired(command, RERUN_TIMEOUT, reply["stdout"],
                                                reply["stderr"])
            return subprocess.CompletedProcess(command, reply["returncode"], reply["stdout"],
                                               reply["stderr"])
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=RERUN_TIMEOUT, check=False)
