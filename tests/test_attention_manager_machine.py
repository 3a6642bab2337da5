"""The attention layer (conformance/attention_manager_machine.py): each attention type's
single-type manager called directly, against the spec, on impl (this interpreter), on
vLLM 0.13 and on vLLM 0.33 (their environments, when built: skipped otherwise).

The vLLM 0.33 tests run in .venv-vllm-0.33.0's Python; run from any other environment, the
file runs them again there (the environment passed on, so a planted mutant goes with it).
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvspec.conformance import attention_manager_machine as machine
from tests.vllm_033 import rerun_under_vllm_033, running_vllm_033

REPO_ROOT = Path(__file__).resolve().parents[1]
VLLM_013 = REPO_ROOT / ".venv-vllm-0.13.0" / "bin" / "python"


TestImplAttentionManagersConformToSpec = machine.machine_for(machine.adapter_for("impl")).TestCase


def test_the_two_planted_cases_of_issue_19() -> None:
    """The two bugs the coordinators mask, as the spec states them."""
    from kvspec.spec import manager as model, pool as P
    from kvspec.spec.manager import GroupSpec, Kind

    full = GroupSpec(Kind.FULL, 1)
    pool = P.new_pool(8, True, False)
    hashes = [bytes([i]) * 32 for i in range(2)]
    pool, taken = P.get_new_blocks(pool, 4)  # 1, 2 in group 0; 3, 4 in group 1
    pool = P.cache_full_blocks(pool, taken[:1], hashes, 0, 1, 0, token_ids=(0,), block_size=1)
    pool = P.cache_full_blocks(pool, taken[2:], hashes, 0, 2, 1, token_ids=(0, 1),
                               block_size=1)
    assert model.type_cache_hit(pool, full, [0, 1], hashes, 2, 1, False) == ((1,), (3,))
    window = GroupSpec(Kind.SLIDING_WINDOW, 2, sliding_window=4)
    assert model.skipped_blocks_to_free((0, 0, 0, 4, 5, 6), window, 11) == (3,)


def test_attention_layer_on_vllm_013() -> None:
    """vLLM 0.13's managers conform but for the known findings B1 and M2 (docs/findings.md),
    which the run steps around; `kvspec audit --layer attention` reports them."""
    if not VLLM_013.exists():
        pytest.skip("no .venv-vllm-0.13.0 (make vllm-env VLLM=0.13.0 builds it)")
    script = (
        "from hypothesis import settings\n"
        "from hypothesis.stateful import run_state_machine_as_test\n"
        "from kvspec.conformance import attention_manager_machine as m\n"
        "machine = m.machine_for(m.adapter_for('vllm'), frozenset({'B1', 'M2'}))\n"
        "run_state_machine_as_test(machine, settings=settings("
        "max_examples=300, stateful_step_count=25, deadline=None, derandomize=True))\n")
    run = subprocess.run([str(VLLM_013), "-c", script], capture_output=True, text=True,
                         cwd=REPO_ROOT, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


if running_vllm_033():
    from hypothesis import settings

    from kvspec.spec import manager as model, pool as P
    from kvspec.spec.manager import GroupSpec, Kind
    from kvspec.spec.pool import NULL_BLOCK, Profile

    TestVllm033AttentionManagersConformToSpec = machine.machine_for(
        machine.adapter_for("vllm")).TestCase
    TestVllm033AttentionManagersConformToSpec.settings = settings(
        max_examples=300, stateful_step_count=25, deadline=None, derandomize=True)

    def _vllm_033(kind: Kind, block_size: int, num_groups: int, num_blocks: int,
                  sliding_window: int = 0) -> Any:
        adapter = machine.adapter_for("vllm")()
        assert isinstance(adapter, machine.Vllm033Attention)
        adapter.build(GroupSpec(kind, block_size, sliding_window=sliding_window), num_groups,
                      num_blocks)
        return adapter

    def test_vllm_033_adapter_is_picked() -> None:
        assert machine.adapter_for("vllm") is machine.Vllm033Attention
        assert machine.Vllm033Attention.profile is Profile.V0_33

    def test_vllm_033_the_two_planted_cases_of_issue_19() -> None:
        """Issue 19's two planted cases, on vLLM 0.33's own managers: a full-attention
        lookup over two groups cuts every list to the common length, and the sliding-window
        walk down stops at the first null block."""
        full = _vllm_033(Kind.FULL, 1, 2, 8)
        hashes = (bytes([1]) * 32, bytes([2]) * 32)
        full.attach_hits("a", ((), ()))
        held = (full.allocate_new_blocks(0, "a", 2), full.allocate_new_blocks(1, "a", 2))
        request = full.request("a", hashes, 1)
        full.cache_blocks(0, request, 1)  # group 0 keys its first block only
        full.cache_blocks(1, request, 2)
        hit = full.find_longest_cache_hit(list(hashes), 2, [0, 1], False, 1)
        assert hit == ((held[0][0],), (held[1][0],))
        spec_pool = P.new_pool(8, True, False, Profile.V0_33)
        spec_pool, taken = P.get_new_blocks(spec_pool, 4)
        assert taken == held[0] + held[1]
        spec_pool = P.cache_full_blocks(spec_pool, taken[:2], hashes, 0, 1, 0, token_ids=(0,),
                                        block_size=1)
        spec_pool = P.cache_full_blocks(spec_pool, taken[2:], hashes, 0, 2, 1,
                                        token_ids=(0, 1), block_size=1)
        assert model.type_cache_hit(spec_pool, GroupSpec(Kind.FULL, 1), [0, 1], hashes, 2, 1,
                                    False) == hit

        window = _vllm_033(Kind.SLIDING_WINDOW, 2, 1, 8, sliding_window=4)
        window.attach_hits("w", ((),))
        blocks = window.allocate_new_blocks(0, "w", 12)
        for computed in (7, 9):  # nulls blocks 0-1, then block 2
            window.remove_skipped_blocks(0, "w", computed)
        assert window.tables()[0]["w"] == (NULL_BLOCK,) * 3 + blocks[3:]
        free_before = window.pool.get_num_free_blocks()
        window.remove_skipped_blocks(0, "w", 11)
        assert window.tables()[0]["w"] == (NULL_BLOCK,) * 4 + blocks[4:]
        assert window.pool.get_num_free_blocks() == free_before + 1
        assert model.skipped_blocks_to_free((0, 0, 0) + blocks[3:], GroupSpec(
            Kind.SLIDING_WINDOW, 2, sliding_window=4), 11) == (3,)

    def _chunked_local_peak(chunk: int, block_size: int, in_flight: int, steps: list[int],
                            max_model_len: int = 64) -> tuple[int, int, list[tuple[int, ...]]]:
        """vLLM 0.33's ChunkedLocalAttentionManager driven as allocate_slots drives it, one
        request: before each step ``remove_skipped_blocks(r, processed)`` (frees follow the
        processed tokens), then ``allocate_new_blocks(r, processed + step)``. Returns the
        admission cap (``max_admission_blocks_per_request(in_flight, max_model_len)``), the
        peak of real (non-null) blocks the request held, and its tables."""
        import torch
        from vllm.v1.core.block_pool import BlockPool
        from vllm.v1.core.single_type_kv_cache_manager import ChunkedLocalAttentionManager
        from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec

        spec = ChunkedLocalAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8,
                                         dtype=torch.float16, attention_chunk_size=chunk)
        cap = spec.max_admission_blocks_per_request(max_in_flight_tokens=in_flight,
                                                    max_model_len=max_model_len)
        pool = BlockPool(32, enable_caching=True, hash_block_size=block_size)
        manager = ChunkedLocalAttentionManager(
            spec, block_pool=pool, enable_caching=True, kv_cache_group_id=0,
            scheduler_block_size=block_size, max_admission_blocks_per_request=cap)
        manager.add_local_computed_blocks("r", [], 0, 0)
        processed, peak, tables = 0, 0, []
        for step in steps:
            assert step <= in_flight
            manager.remove_skipped_blocks("r", processed)
            manager.allocate_new_blocks("r", processed + step, processed + step)
            table = tuple(b.block_id for b in manager.req_to_blocks["r"])
            peak = max(peak, sum(1 for b in table if b != NULL_BLOCK))
            tables.append(table)
            processed += step
        return int(cap), peak, tables

    def test_vllm_033_s1_chunked_local_admission_cap_below_peak_when_chunk_not_block_aligned(
    ) -> None:
        """Documents vLLM 0.33's behaviour (candidate finding S1, not reachable in a working
        engine). ``ChunkedLocalAttentionSpec.max_admission_blocks_per_request`` is
        ``cdiv(min(chunk + in_flight, max_model_len), block_size)`` (kv_cache_interface.py:
        864-881), with no "+1" for a chunk that starts inside a block (SlidingWindowSpec adds
        one, :941-944); the admission gate assumes a request never holds more real blocks
        than the cap (single_type_kv_cache_manager.py:216-224). With chunk 6, block size 4,
        2 tokens in flight and max_model_len 64 the cap is 2, yet after 11 processed tokens
        ``remove_skipped_blocks(r, 11)`` frees only block 0 (tokens 0-3; 4-5 are dead but
        6-7 are in the live chunk) and ``allocate_new_blocks(r, 13)`` leaves
        [null, b1, b2, b3]: 3 real blocks. vLLM's own configuration rules the case out:
        the chunked-local metadata builder asserts ``attn_chunk_size % block_size == 0``
        with the KV-cache spec's block size (v1/attention/backends/utils.py:621-623, called
        from model_executor/layers/attention/chunked_local_attention.py:56-60), so an
        engine with such a chunk fails at its first forward pass."""
        cap, peak, tables = _chunked_local_peak(6, 4, 2, [1, 2, 2, 2, 2, 2, 2])
        assert cap == 2
        assert peak == 3
        assert sum(1 for b in tables[-1] if b != NULL_BLOCK) == 3  # processed 11 -> 13 slots
        assert tables[-1][0] == NULL_BLOCK and len(tables[-1]) == 4
        # A block-aligned chunk (the only kind an engine runs) stays within its cap.
        for chunk, block_size, in_flight in ((8, 4, 2), (8, 4, 3), (4, 2, 1), (12, 4, 5)):
            for first in range(1, in_flight + 1):
                steps = [first] + [in_flight] * (3 * chunk // in_flight + 2)
                cap, peak, _ = _chunked_local_peak(chunk, block_size, in_flight, steps)
                assert peak <= cap, (chunk, block_size, in_flight, first, peak, cap)

else:

    def test_attention_layer_on_vllm_033() -> None:
        """The vLLM 0.33 tests of this file, run by .venv-vllm-0.33.0's Python."""
        rerun_under_vllm_033(__file__, "-k", "vllm_033 or Vllm033")
