"""Hostile edits to a pool's own prefix-cache map (``BlockPool.cached_block_hash_to_block``).

The map is public because vLLM's code and tests read it (``len``, truth, ``get_one_block``),
but only the pool may change it: a foreign ``pop`` used to leave the pool's record of the
block's key behind, and the next ``get_new_blocks`` that evicted the block raised a bare
``KeyError`` half-way through. Every edit from outside is now refused with
``BlockOwnershipError`` (a ``ValueError``), and the pool is exactly as it was: it keeps
allocating, evicting and hitting as if nothing had been tried. A map of one's own
(``BlockHashToBlockMap()``) stays editable, as vLLM's is.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, strategies as st

from kvspec.impl.block_pool import BlockHashToBlockMap, BlockOwnershipError, BlockPool
from kvspec.impl.hashing import BlockHashWithGroupId


def _key(block_hash: bytes, group_id: int = 0) -> BlockHashWithGroupId:
    return BlockHashWithGroupId(block_hash + group_id.to_bytes(4, "big"))


class _Request:
    """What cache_full_blocks reads of a request."""

    def __init__(self, block_hashes: list[bytes]) -> None:
        self.request_id = "r"
        self.block_hashes = block_hashes
        self.all_token_ids = list(range(2 * len(block_hashes)))
        self.lora_request = None
        self.mm_features: list[Any] = []
        self.cache_salt = None
        self.prompt_embeds = None


def _pool_with_free_cached_blocks(num_blocks: int) -> tuple[BlockPool, list[bytes]]:
    """A pool whose blocks 1.. are all free and keyed (the next allocation evicts them)."""
    pool = BlockPool(num_blocks, enable_caching=True, hash_block_size=2)
    hashes = [bytes([i]) * 32 for i in range(num_blocks - 1)]
    blocks = pool.get_new_blocks(num_blocks - 1)
    pool.cache_full_blocks(_Request(hashes), blocks, 0, len(blocks), 2, 0)
    pool.free_blocks(blocks)
    return pool, hashes


def _snapshot(pool: BlockPool) -> tuple[Any, ...]:
    cache_map = pool.cached_block_hash_to_block
    return (sorted((k, [b.block_id for b in v]) for k, v in cache_map.items()),
            [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
            pool.get_num_free_blocks(), len(cache_map))


EDITS = {
    "pop": lambda m, hashes, block_id: m.pop(_key(hashes[0]), block_id),
    "insert": lambda m, hashes, block_id: m.insert(_key(b"\xee" * 32), object()),
    "insert a pool block": lambda m, hashes, block_id: m.insert(
        _key(b"\xee" * 32), m.get_one_block(_key(hashes[0]))),
    "clear": lambda m, hashes, block_id: m.clear(),
}


@given(num_blocks=st.integers(2, 16), edit=st.sampled_from(sorted(EDITS)))
def test_edits_from_outside_are_refused_and_change_nothing(num_blocks: int, edit: str) -> None:
    pool, hashes = _pool_with_free_cached_blocks(num_blocks)
    before = _snapshot(pool)
    with pytest.raises(BlockOwnershipError, match="own prefix-cache map"):
        EDITS[edit](pool.cached_block_hash_to_block, hashes, 1)
    assert _snapshot(pool) == before
    pool.check_representation()
    # The pool still evicts every block it keyed: no KeyError half-way.
    taken = pool.get_new_blocks(num_blocks - 1)
    assert len(taken) == num_blocks - 1
    assert len(pool.cached_block_hash_to_block) == 0
    pool.check_representation()


def test_reads_still_work_as_vllm_uses_them() -> None:
    pool, hashes = _pool_with_free_cached_blocks(4)
    cache_map = pool.cached_block_hash_to_block
    assert len(cache_map) == 3 and cache_map
    found = cache_map.get_one_block(_key(hashes[1]))
    assert found is not None and found.block_id == 2
    assert [k for k, _ in cache_map.items()] == [_key(h) for h in hashes]
    assert pool.reset_prefix_cache() and not cache_map  # the pool itself may clear it


def test_a_map_of_ones_own_stays_editable() -> None:
    pool = BlockPool(3, enable_caching=True, hash_block_size=2)
    block = pool.get_new_blocks(1)[0]
    own = BlockHashToBlockMap()
    own.insert(_key(b"\x01" * 32), block)
    assert own.pop(_key(b"\x01" * 32), block.block_id) is block
    own.clear()
    assert len(own) == 0
