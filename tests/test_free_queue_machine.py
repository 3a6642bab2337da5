"""The free-queue conformance machine, run against impl/, and the counterexamples it writes."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvspec.conformance.free_queue_machine import adapter_for, machine_for
from kvspec.conformance.lockstep import Discrepancy, Lockstep, counterexample_source
from kvspec.conformance.vllm_targets import TargetError
from kvspec.spec import free_queue as model
from kvspec.spec.pool import Profile

TestImplFreeQueueConformsToSpec = machine_for(adapter_for("impl")).TestCase

# vLLM 0.33's prepend_n (the vllm-0.33 profile's rule), once impl has it; vLLM 0.33's own class
# is driven by tests/test_audit_vllm_033.py.
if adapter_for("impl")().classes.api == "vllm-0.33":
    TestImplFreeQueueConformsToSpec033 = machine_for(
        adapter_for("impl"), profile=Profile.V0_33).TestCase


# --- counterexamples: the audit's written programs run with plain pytest, anywhere --------------

PLANTED = textwrap.dedent('''
    """A free queue with one planted bug: popleft_n(n < 0) raises the count, pops nothing."""
    from kvspec.impl.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock

    __all__ = ["KVCacheBlock", "NegativeCountQueue"]


    class NegativeCountQueue:
        """impl's queue (compiled: wrapped, not subclassed), but for popleft_n."""

        def __init__(self, blocks):
            self._inner = FreeKVCacheBlockQueue(blocks)
            self._extra = 0

        @property
        def num_free_blocks(self):
            return self._inner.num_free_blocks + self._extra

        def popleft_n(self, n):
            if type(n) is int and n < 0:
                self._extra -= n
                return []
            return self._inner.popleft_n(n)

        def __getattr__(self, name):
            return getattr(self._inner, name)
''')
BAD_PROGRAM = [model.NewQueue(4, (0, 1, 2, 3)), model.PopLeftN(2), model.PopLeftN(-1),
               model.NumFreeBlocks()]
GOOD_PROGRAM = [model.NewQueue(5, (3, 1, 4)), model.PopLeftN(2), model.Remove(4),
                model.Append(3), model.AppendN((0, 4, 1)), model.PopLeft(), model.PopLeftN(9),
                model.Remove(3), model.Append(0), model.PopLeftN(-1), model.PopLeftN(1.5),
                model.AppendN((2, 2)), model.GetAllFreeBlocks(), model.NumFreeBlocks()]


def _run_counterexample(source: str, folder: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    path = folder / "test_counterexample.py"
    path.write_text(source)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(path)], cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.fixture
def planted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "planted_free_queue.py").write_text(PLANTED)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "planted_free_queue:NegativeCountQueue"


def test_the_machine_finds_the_planted_bug(planted: str) -> None:
    lockstep: Lockstep[model.QueueState] = Lockstep(model.step, adapter_for(planted)())
    with pytest.raises(Discrepancy, match="target accepted it"):
        for command in BAD_PROGRAM:
            lockstep(command)


@pytest.mark.parametrize("where", ["in its folder", "from elsewhere"])
def test_counterexample_of_a_planted_bug_fails(planted: str, tmp_path: Path, where: str) -> None:
    source = counterexample_source(model.step, BAD_PROGRAM, adapter_for(planted)(),
                                   model.view_of, "popleft_n(-1) is accepted")
    cwd = tmp_path if where == "in its folder" else Path("/")
    result = _run_counterexample(source, tmp_path, cwd)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "DID NOT RAISE" in result.stdout


def test_counterexample_of_a_conforming_queue_passes(tmp_path: Path) -> None:
    source = counterexample_source(model.step, GOOD_PROGRAM, adapter_for("impl")(),
                                   model.view_of, "impl follows the spec")
    assert "queue.popleft_n(-1)" in source and "queue.append_n([blocks[2], blocks[2]])" in source
    result = _run_counterexample(source, tmp_path, Path("/"))
    assert result.returncode == 0, source + result.stdout + result.stderr


@pytest.mark.parametrize("target", ["no_such_module:Queue", "kvspec.impl.errors:Nothing",
                                    "not a target", "kvspec.impl.errors:NoFreeBlocksError"])
def test_unloadable_targets_are_refused(target: str) -> None:
    with pytest.raises(TargetError):
        adapter_for(target)
