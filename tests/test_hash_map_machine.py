"""The prefix-cache map conformance machine, run against impl/."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvspec.conformance.hash_map_machine import KEYS, adapter_for, machine_for
from kvspec.conformance.lockstep import (
    Discrepancy,
    Lockstep,
    Refused,
    counterexample_source,
)
from kvspec.conformance.vllm_targets import TargetError
from kvspec.spec import hash_map as model
from kvspec.spec.pool import Profile

TestImplHashMapConformsToSpec = machine_for(adapter_for("impl")).TestCase

# vLLM 0.33's contain (the vllm-0.33 profile's rule), once impl has it; vLLM 0.33's own class
# is driven by tests/test_audit_vllm_033.py.
if adapter_for("impl")().classes.api == "vllm-0.33":
    TestImplHashMapConformsToSpec033 = machine_for(
        adapter_for("impl"), profile=Profile.V0_33).TestCase


@pytest.mark.parametrize("second_key", [KEYS[0], KEYS[1]], ids=["same key", "second key"])
def test_impl_refuses_a_block_that_is_already_mapped(second_key: bytes) -> None:
    """Found by this layer: impl's public insert took a block already in the map (the pool
    never does this, so the pool machine could not see it); it now refuses, as the spec."""
    lockstep: Lockstep[model.MapState] = Lockstep(model.step, adapter_for("impl")())
    lockstep(model.NewMap(2))
    lockstep(model.Insert(KEYS[0], 1))
    assert isinstance(lockstep(model.Insert(second_key, 1)), Refused)


# --- counterexamples: the audit's written programs run with plain pytest, anywhere --------------

PLANTED = textwrap.dedent('''
    """A map with one planted bug: get_one_block answers with the newest block, not the first."""
    from kvspec.impl.block_pool import BlockHashToBlockMap, KVCacheBlock

    __all__ = ["KVCacheBlock", "NewestFirstMap"]


    class NewestFirstMap:
        """impl's map (compiled: wrapped, not subclassed), but for get_one_block."""

        def __init__(self):
            self._inner = BlockHashToBlockMap()

        def get_one_block(self, key):
            blocks = dict(self._inner.items()).get(key, [])
            return blocks[-1] if blocks else None

        def __len__(self):
            return len(self._inner)

        def items(self):
            return self._inner.items()

        def __getattr__(self, name):
            return getattr(self._inner, name)
''')
KEY, OTHER = KEYS[0], KEYS[1]
BAD_PROGRAM = [model.NewMap(4), model.Insert(KEY, 1), model.Insert(KEY, 3),
               model.GetOneBlock(KEY)]
GOOD_PROGRAM = [model.NewMap(4), model.Insert(KEY, 1), model.Insert(KEY, 3),
                model.Insert(OTHER, 2), model.GetOneBlock(KEY), model.Pop(KEY, 2),
                model.Pop(KEY, 1), model.GetOneBlock(KEY), model.Len(), model.Pop(OTHER, 2),
                model.Len(), model.GetOneBlock(OTHER), model.Insert("a key", 0),
                model.Pop(KEY, "3"), model.GetOneBlock(b"\x00")]


def _run_counterexample(source: str, folder: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    path = folder / "test_counterexample.py"
    path.write_text(source)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(path)], cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.fixture
def planted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "planted_hash_map.py").write_text(PLANTED)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "planted_hash_map:NewestFirstMap"


def test_the_machine_finds_the_planted_bug(planted: str) -> None:
    lockstep: Lockstep[model.MapState] = Lockstep(model.step, adapter_for(planted)())
    with pytest.raises(Discrepancy, match="GetOneBlock"):
        for command in BAD_PROGRAM:
            lockstep(command)


@pytest.mark.parametrize("where", ["in its folder", "from elsewhere"])
def test_counterexample_of_a_planted_bug_fails(planted: str, tmp_path: Path, where: str) -> None:
    source = counterexample_source(model.step, BAD_PROGRAM, adapter_for(planted)(),
                                   model.view_of, "get_one_block answers with the newest block")
    cwd = tmp_path if where == "in its folder" else Path("/")
    result = _run_counterexample(source, tmp_path, cwd)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "assert 3 == 1" in result.stdout


def test_counterexample_of_a_conforming_map_passes(tmp_path: Path) -> None:
    source = counterexample_source(model.step, GOOD_PROGRAM, adapter_for("impl")(),
                                   model.view_of, "impl follows the spec")
    assert "cache.insert('a key', blocks[0])" in source
    result = _run_counterexample(source, tmp_path, Path("/"))
    assert result.returncode == 0, source + result.stdout + result.stderr


@pytest.mark.parametrize("target", ["no_such_module:Map", "kvspec.impl.errors:Nothing",
                                    "kvspec.impl.errors:NoFreeBlocksError"])
def test_unloadable_targets_are_refused(target: str) -> None:
    with pytest.raises(TargetError):
        adapter_for(target)
