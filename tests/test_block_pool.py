"""BlockPool (impl/block_pool.py), vLLM 0.13's pool: get_cached_prefix, kvspec's bulk lookup,
at its edges (the pool machine checks it against the spec on every single-group admission),
and what a 0.13 pool refuses of vLLM 0.33's API. vLLM 0.33's pool, BlockPool033, and which
class ``BlockPool(...)`` builds: tests/test_block_pool_033.py."""

from __future__ import annotations

from typing import Any

import pytest

from kvspec.conformance.pool_machine import chain_hash
from kvspec.impl.block_pool import (
    BlockPool,
    InvalidBlockHashError,
    InvalidPoolConfigError,
    PolicyNotSupportedError,
)


class _Request:
    def __init__(self, block_hashes: list[bytes]) -> None:
        self.block_hashes = block_hashes
        self.all_token_ids = [0] * (2 * len(block_hashes))
        self.lora_request = None


def _pool_with_cached_chain(length: int) -> tuple[Any, list[bytes], list[Any]]:
    pool: Any = BlockPool(8, True, 2)
    hashes = [chain_hash(0, i) for i in range(length)]
    blocks = pool.get_new_blocks(length)
    pool.cache_full_blocks(_Request(hashes), blocks, 0, length, 2, 0)
    return pool, hashes, blocks


def test_leading_run_up_to_the_first_miss_and_the_limit() -> None:
    pool, hashes, blocks = _pool_with_cached_chain(3)
    assert pool.get_cached_prefix(hashes, 0, 5) == blocks
    assert pool.get_cached_prefix(hashes, 0, 2) == blocks[:2]
    assert pool.get_cached_prefix(hashes, 0, 0) == []
    assert pool.get_cached_prefix([hashes[0], b"miss", hashes[2]], 0, 3) == blocks[:1]
    assert pool.get_cached_prefix(hashes, 1, 3) == []  # another group


@pytest.mark.parametrize("bad", ["text", 7, None, [1, 2]])
def test_a_malformed_hash_before_the_first_miss_is_refused(bad: Any) -> None:
    pool, hashes, _ = _pool_with_cached_chain(3)
    with pytest.raises(InvalidBlockHashError, match="must be bytes"):
        pool.get_cached_prefix([hashes[0], bad, hashes[2]], 0, 3)
    with pytest.raises(InvalidBlockHashError, match="must be bytes"):
        pool.get_cached_prefix([bad], 5, 1)  # a group nothing is cached in
    # after the first miss nothing is looked at, as with get_cached_block in a loop
    assert pool.get_cached_prefix([hashes[0], b"miss", bad], 0, 3) == pool.get_cached_prefix(
        hashes, 0, 1)


# ------------------------------------------------- what a 0.13 pool refuses of 0.33's API


def _ids(blocks: Any) -> list[int]:
    return [b.block_id for b in blocks]


def test_013_pool_keeps_fifo_and_has_none_of_033s_operations() -> None:
    """A 0.13 pool is vLLM 0.13's: FIFO frees, none of 0.33's operations (they are
    BlockPool033's), and no 0.33 API or parameters at construction."""
    pool: Any = BlockPool(8, True, 2, vllm_api="0.13")
    assert type(pool) is BlockPool and pool.vllm_api == "0.13"
    blocks = pool.get_new_blocks(2)
    pool.free_blocks(blocks)
    assert _ids(pool.free_block_queue.get_all_free_blocks())[-2:] == [1, 2]
    for name in ("cache_partial_block", "move_block_hashes", "is_block_writable",
                 "emit_cached_block_events", "cached_block_hashes_by_block", "medium"):
        assert not hasattr(pool, name), name
    with pytest.raises(ValueError):
        BlockPool(8, True, 2, vllm_api="0.20")
    with pytest.raises(InvalidPoolConfigError, match="medium"):
        BlockPool(8, True, 2, medium="CPU", vllm_api="0.13")
    pool.check_representation()


def _snapshot(pool: Any) -> tuple[Any, ...]:
    """What a caller can see of a 0.13 pool: the free order, each block's ref count and key,
    the key map and the pending events."""
    return (_ids(pool.free_block_queue.get_all_free_blocks()),
            [(b.ref_cnt, b.block_hash) for b in pool.blocks],
            sorted((key, _ids(blocks)) for key, blocks in pool.cached_block_hash_to_block.items()),
            list(pool.kv_event_queue))


ARGUMENTS_033: dict[str, tuple[Any, type[Exception], str]] = {
    "unpin_blocks(blocks, on_reuse)": (
        lambda pool, blocks: pool.unpin_blocks(blocks[2:], lambda block: None),
        PolicyNotSupportedError, "on_reuse"),
    "cache_full_blocks(..., block_mask)": (
        lambda pool, blocks: pool.cache_full_blocks(
            _Request([chain_hash(0, i) for i in range(3)]), blocks, 2, 3, 2, 0, [True]),
        InvalidPoolConfigError, "block_mask"),
}


@pytest.mark.parametrize("name", list(ARGUMENTS_033))
def test_013_pool_refuses_033s_arguments_and_changes_nothing(name: str) -> None:
    """0.33's arguments to an operation both releases have are refused by a 0.13 pool with a
    typed error naming the argument; the pool, its keys and its pending events stay as
    they were."""
    call, error, named = ARGUMENTS_033[name]
    pool: Any = BlockPool(8, True, 2, True, vllm_api="0.13")
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(_Request([chain_hash(0, i) for i in range(2)]), blocks, 0, 2, 2, 0)
    pool.free_blocks(blocks[:1])
    before = _snapshot(pool)
    with pytest.raises(error, match=named) as raised:
        call(pool, blocks)
    assert isinstance(raised.value, ValueError)
    assert _snapshot(pool) == before
    pool.check_representation()
