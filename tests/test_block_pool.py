"""BlockPool.get_cached_prefix, kvspec's bulk lookup, at its edges (the pool machine checks
it against the spec on every single-group admission)."""

from __future__ import annotations

from typing import Any

import pytest

from kvspec.conformance.pool_machine import chain_hash
from kvspec.impl.block_pool import BlockPool, InvalidBlockHashError


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
