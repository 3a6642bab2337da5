"""The offload hit-rate benchmark: the connector's call order, and sane quick rows (no timing)."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

import pytest

from benchmarks import hit_rate_offload as h


class _Recorder:
    """An offloading manager that holds ``held`` (all ready) and records every call."""

    def __init__(self, held: Iterable[str]) -> None:
        self.held = set(held)
        self.calls: list[tuple[str, list[Any]]] = []

    def lookup(self, block_hashes: Iterable[str]) -> int:
        keys = list(block_hashes)
        self.calls.append(("lookup", keys))
        hits = 0
        for key in keys:
            if key not in self.held:
                break
            hits += 1
        return hits

    def touch(self, block_hashes: Iterable[str]) -> None:
        self.calls.append(("touch", list(block_hashes)))

    def prepare_load(self, block_hashes: Iterable[str]) -> None:
        self.calls.append(("prepare_load", list(block_hashes)))

    def complete_load(self, block_hashes: Iterable[str]) -> None:
        self.calls.append(("complete_load", list(block_hashes)))

    def prepare_store(self, block_hashes: Iterable[str]) -> Any:
        keys = [k for k in block_hashes if k not in self.held]
        self.calls.append(("prepare_store", keys))
        return SimpleNamespace(block_hashes_to_store=keys)

    def complete_store(self, block_hashes: Iterable[str]) -> None:
        self.calls.append(("complete_store", list(block_hashes)))


def _request(num_tokens: int) -> Any:
    return SimpleNamespace(request_id="r", num_tokens=num_tokens,
                           block_hashes=[f"h{i}" for i in range(num_tokens // 16)])


def test_tier_calls_the_manager_in_the_connectors_order() -> None:
    manager = _Recorder(["h1", "h2"])
    tier = h.OffloadTier(manager, 16)
    request = _request(4 * 16 + 5)  # 4 full blocks; h0 on the GPU, h1 and h2 on the CPU
    assert tier.get_num_new_matched_tokens(request, 16) == 32
    tier.scheduled(request)
    every = ["h0", "h1", "h2", "h3"]
    assert manager.calls == [
        ("touch", every), ("lookup", ["h1", "h2", "h3"]),
        ("prepare_load", ["h1", "h2"]), ("complete_load", ["h1", "h2"]),
        ("prepare_store", ["h3"]), ("touch", every), ("complete_store", ["h3"])]
    assert (tier.gpu_tokens, tier.cpu_tokens, tier.stored_blocks) == (16, 32, 1)


def test_tier_without_a_cpu_hit_stores_from_the_first_block() -> None:
    manager = _Recorder(["h0"])
    tier = h.OffloadTier(manager, 16)
    request = _request(3 * 16)
    # The GPU holds h0 and h1 (a hit stops a block short of a whole block-aligned prompt);
    # what is left after the GPU hit (h2) is not on the CPU.
    assert tier.get_num_new_matched_tokens(request, 32) == 0
    tier.scheduled(request)
    assert [c[0] for c in manager.calls] == [
        "touch", "lookup", "prepare_store", "touch", "complete_store"]
    assert manager.calls[2] == ("prepare_store", ["h1", "h2"])
    assert tier.cpu_tokens == 0


@functools.cache
def _quick_rows(implementation: str) -> list[dict[str, Any]] | None:
    """The quick agent trace, CPU tier 2x the GPU pool; None if the managers do not import."""
    managers = h.manager_classes(implementation)
    if managers is None:
        return None
    return h.run(quick=True, traces=("agent",), managers=managers, factors=(2,))


@pytest.mark.parametrize("implementation", sorted(h.MANAGER_MODULES))
def test_quick_agent_rows(implementation: str) -> None:
    rows = _quick_rows(implementation)
    if rows is None:
        pytest.skip(f"{implementation}'s offloading managers do not import")
    assert [(r["tier"], r["cpu_blocks"]) for r in rows] == [
        ("none", None), ("lru", 600), ("arc", 600)]
    gpu = rows[0]["gpu_tokens"]
    assert gpu > 0 and all(r["gpu_tokens"] == gpu for r in rows)
    for row in rows:
        if row["error"]:  # only vLLM 0.13's ARC may fail, and only with its known KeyError
            assert (implementation, row["tier"]) == ("vllm", "arc")
            assert row["error"].startswith(h.VLLM_ARC_CRASH)
            continue
        assert 0.0 <= row["gpu_hit_rate"] <= row["total_hit_rate"] <= 1.0
        if row["tier"] != "none":
            assert row["cpu_tokens"] > 0 and 0.0 < row["recovered"] < 1.0
    assert "| agent | 300 | LRU" in h.table(rows)


def test_kvspec_and_vllm_lru_tiers_agree() -> None:
    kvspec_rows, vllm_rows = _quick_rows("kvspec"), _quick_rows("vllm")
    if kvspec_rows is None or vllm_rows is None:
        pytest.skip("needs both kvspec's and vLLM's offloading managers")
    lru = [[(r["gpu_tokens"], r["cpu_tokens"]) for r in rows if r["tier"] != "arc"]
           for rows in (kvspec_rows, vllm_rows)]
    assert lru[0] == lru[1]
