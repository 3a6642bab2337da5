"""What vLLM's callers rely on, checked without vLLM: impl's managers take foreign objects of
vLLM's kinds (specs, configs, requests), keep the caller's lists intact, and show the pool's
free queue in vLLM's linked-list terms. A spec or config converted on its own:
tests/test_kv_cache_interface.py; a queue on its own: tests/test_kv_cache_blocks.py.

The foreign spec and config classes (tests/vllm_standins.py) and request (below) stand in for
vLLM's: same class names and fields, so impl must recognise them by what they are, in the
compiled build as in the pure one.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvspec.impl.block_pool import BlockPool
from kvspec.impl.hashing import BlockHash, get_request_block_hasher, sha256
from kvspec.impl.kv_cache_interface import InvalidKVCacheSpec, as_kv_cache_spec
from kvspec.impl.kv_cache_manager import KVCacheManager
from kvspec.impl.single_type_kv_cache_manager import (
    SlidingWindowManager,
    UnsupportedKVCacheSpec,
    get_manager_for_kv_cache_spec,
)
from tests.vllm_standins import (
    BLOCK_SIZE,
    EncoderOnlyAttentionSpec,
    SlidingWindowSpec,
    config_of,
    full_attention,
)


class ForeignRequest:
    """A request of another class with the fields vLLM's Request has."""

    def __init__(self, request_id: str, token_ids: list[int]) -> None:
        self.request_id = request_id
        self.all_token_ids = list(token_ids)
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.skip_reading_prefix_cache = False
        self.lora_request = None
        self.mm_features: list[Any] = []
        self.cache_salt = None
        self.prompt_embeds = None
        self.block_hashes: list[BlockHash] = []
        self.block_hashes = get_request_block_hasher(BLOCK_SIZE, sha256)(self)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


# -- foreign specs and configs ---------------------------------------------------------


def test_unknown_foreign_kind_is_refused_by_name() -> None:
    with pytest.raises(InvalidKVCacheSpec, match="EncoderOnlyAttentionSpec"):
        as_kv_cache_spec(EncoderOnlyAttentionSpec(BLOCK_SIZE, 2, 8, "float16"))
    pool = BlockPool(4, True, BLOCK_SIZE)
    with pytest.raises(UnsupportedKVCacheSpec, match="EncoderOnlyAttentionSpec"):
        get_manager_for_kv_cache_spec(EncoderOnlyAttentionSpec(BLOCK_SIZE, 2, 8, "float16"),
                                      block_pool=pool, kv_cache_group_id=0)


def test_manager_serves_foreign_config_and_requests_keeping_callers_objects() -> None:
    spec = full_attention()
    config = config_of(spec, SlidingWindowSpec(BLOCK_SIZE, 2, 8, "float16", 8))
    manager = KVCacheManager(config, max_model_len=64, hash_block_size=BLOCK_SIZE)
    assert manager.kv_cache_config is config
    assert manager.coordinator.single_type_managers[0].kv_cache_spec is spec
    first = ForeignRequest("a", list(range(10)))
    assert manager.get_computed_blocks(first)[1] == 0
    assert manager.allocate_slots(first, 10) is not None
    manager.free(first)
    again = ForeignRequest("b", list(range(10)))
    blocks, num_hit_tokens = manager.get_computed_blocks(again)
    assert num_hit_tokens == 8  # two full blocks cached by the first request, in both groups
    assert [len(group) for group in blocks.blocks] == [2, 2]


def test_manager_built_directly_with_a_foreign_spec() -> None:
    pool = BlockPool(8, True, BLOCK_SIZE)
    spec = SlidingWindowSpec(BLOCK_SIZE, 2, 8, "float16", 8)
    manager = SlidingWindowManager(spec, block_pool=pool, kv_cache_group_id=0)
    assert manager.kv_cache_spec is spec and manager.sliding_window == 8
    hit = SlidingWindowManager.find_longest_cache_hit(
        [BlockHash(b"x" * 32)], 4, [0], pool, spec, False, BLOCK_SIZE)
    assert hit == ([],)


# -- the caller's lists --------------------------------------------------------------------


def test_free_leaves_the_callers_block_list_as_it_was() -> None:
    manager = KVCacheManager(config_of(full_attention()), max_model_len=64,
                             hash_block_size=BLOCK_SIZE)
    request = ForeignRequest("a", list(range(10)))
    manager.allocate_slots(request, 10)
    held = manager.coordinator.single_type_managers[0].req_to_blocks["a"]
    ids = [block.block_id for block in held]
    manager.free(request)
    assert [block.block_id for block in held] == ids  # vLLM 0.13 leaves it unreversed too


# -- the free queue in linked-list terms ---------------------------------------------------


def test_pool_queue_links_follow_ref_counts() -> None:
    pool = BlockPool(5, True, BLOCK_SIZE)
    queue = pool.free_block_queue
    taken = pool.get_new_blocks(2)
    assert taken[0].next_free_block is None  # in use: not in the queue
    assert queue.fake_free_list_head.next_free_block is pool.blocks[3]
    pool.free_blocks(reversed(taken))
    assert queue.fake_free_list_tail.prev_free_block is taken[0]
    assert taken[1].next_free_block is taken[0]
    assert pool.null_block.next_free_block is None


# -- the context-parallel layout of the process ----------------------------------------------


def test_block_tables_take_the_processs_context_parallel_layout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's worker builds its block tables without ranks; they come from its process groups
    (host_types.context_parallel_layout, bound by the plugin)."""
    from kvspec.impl import host_types
    from kvspec.impl.block_table import MultiGroupBlockTable

    monkeypatch.setattr(host_types, "context_parallel_layout", lambda: (1, 0, 2, 1))
    tables = MultiGroupBlockTable(2, 64, 16, False, "cpu", [4], [4])
    table = tables[0]
    assert (table.dcp_world_size, table.dcp_rank, table.pcp_world_size) == (2, 1, 1)
    assert table.max_num_blocks_per_req == 8  # cdiv(64, 4 * 2): each rank holds half
