"""The KV-cache manager conformance machine, run against impl/.

One run over every layout, and one over the layouts with several attention types only, where
the hybrid lookup's repeated passes matter (three types) and groups of one type must all hit.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from kvspec.conformance.lockstep import counterexample_source
from kvspec.conformance.manager_machine import (
    HAND_LAYOUTS,
    MODEL_LAYOUTS,
    ImplManager,
    kv_cache_config,
    machine_for,
    model_layout,
    spec_config,
    view_of,
)
from kvspec.spec import manager as model
from kvspec.spec.hashing import KeyFormat

HYBRID_LAYOUTS = (
    replace(HAND_LAYOUTS[0], blocks_per_group=(6, 12)),  # full + sliding window + Mamba
    replace(HAND_LAYOUTS[1], blocks_per_group=(4, 10)),  # full (bs 4) + sliding window (bs 2)
    model_layout("Gemma-3-27B", window=3, blocks_per_group=(2, 4)),
)

TestImplManagerConformsToSpec = machine_for(ImplManager).TestCase
TestImplManagerHybridLayouts = machine_for(ImplManager, HYBRID_LAYOUTS).TestCase


# --- Written counterexamples -------------------------------------------------------------------

PROGRAM = (
    model.AddRequest("req-000", tuple(range(100, 109)), lora=1, salt="salt-a"),
    model.GetComputedBlocks("req-000"),
    model.AllocateSlots("req-000", 9, 0, True, 2),
    model.SetComputedTokens("req-000", 9),
    model.AppendTokens("req-000", (7,)),
    model.AllocateSlots("req-000", 1),
    model.SetComputedTokens("req-000", 10),
    model.AllocateSlots("req-000", 0),  # refused
    model.GetNumCommonPrefixBlocks("req-000"),
    model.GetBlockIds("req-000"),
    model.Free("req-000"),
    model.AddRequest("req-001", tuple(range(100, 111)), lora=1, salt="salt-a"),
    model.GetComputedBlocks("req-001"),
    model.AllocateSlots("req-001", 3, 8, True),
    model.CacheBlocks("req-001", 10),
    model.Free("never-seen"),
    model.EvictBlocks((1,)),
    model.TakeEvents(),
    model.ResetPrefixCache(),
    model.Usage(),
)


def _written(tmp_path: Path,
             key_format: KeyFormat | None = None) -> subprocess.CompletedProcess[str]:
    """PROGRAM as a counterexample file against impl/, run with plain pytest from tmp_path.
    With key_format, the spec's expected values assume that extra-key format."""
    layout = MODEL_LAYOUTS[0]
    adapter = ImplManager()
    hashing = adapter.hashing()
    if key_format is not None:
        hashing = replace(hashing, key_format=key_format)
    config = spec_config(layout, kv_cache_config(layout.name, 12), True, True)
    program = [model.NewManager(config, hashing, layout.name), *PROGRAM]
    source = counterexample_source(model.step, program, adapter, view_of, "A test program.")
    path = tmp_path / "test_written.py"
    path.write_text(source)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(path)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, check=False)


def test_a_written_program_runs_with_plain_pytest(tmp_path: Path) -> None:
    """Every command, written as calls on impl's own API (requests are variables named after
    their ids), passes with plain pytest from another directory."""
    result = _written(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    source = (tmp_path / "test_written.py").read_text()
    assert "manager.allocate_slots(req_000, 9, 0, hits_req_000[0], 2, False, 0)" in source
    assert "with pytest.raises(ValueError)" in source


def test_a_written_program_fails_where_the_hashes_differ(tmp_path: Path) -> None:
    """Expected values from a spec that writes extra keys untagged fail on impl (tagged): the
    counterexample shows the hashing discrepancy at the first request."""
    result = _written(tmp_path, KeyFormat.UNTAGGED)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "block_hashes" in result.stdout
