"""Block pools with one planted bug each, for `kvspec audit --target package.module:Class`.

tests/test_audit.py audits them to check that the audit reports a non-conforming target
(exit status 1, a shrunk program, a runnable counterexample).
"""

from __future__ import annotations

from typing import SupportsIndex

from kvspec.impl.block_pool import BlockPool
from kvspec.impl.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock


class ReversedAllocationPool(BlockPool):
    """Hands out newly allocated blocks in reverse of the free order (LRU order broken)."""

    def get_new_blocks(self, num_blocks: SupportsIndex) -> list[KVCacheBlock]:
        return list(reversed(super().get_new_blocks(num_blocks)))


def take_until_none_missing(queue: FreeKVCacheBlockQueue, n: int) -> list[KVCacheBlock]:
    """The stale-entry loop of `FreeKVCacheBlockQueue.take_unchecked` on its own: read entries
    from the head, skip the stale ones, stop when no block is missing. Handed a negative count, the
    number missing never reaches 0 and it spins for ever (the checker hang of issue 10)."""
    entries, stale = queue._entries, queue._stale
    live: list[KVCacheBlock] = []
    stop = queue._head
    while len(live) != n:
        missing = n - len(live)
        batch = entries[stop : stop + missing]
        stop += missing
        live.extend(block for block in batch if not stale.get(block))
    return live


class NegativeCountSpinsPool(BlockPool):
    """Checks only that the count fits in the pool (vLLM 0.13's check), so a negative count
    reaches the free queue's stale-entry loop, which spins: the target never returns."""

    def get_new_blocks(self, num_blocks: SupportsIndex) -> list[KVCacheBlock]:
        if type(num_blocks) is int and num_blocks < 0:
            return take_until_none_missing(self.free_block_queue, num_blocks)
        return super().get_new_blocks(num_blocks)


class NegativeCountAcceptedPool(BlockPool):
    """Answers a negative count with no blocks instead of refusing it: a bad-call discrepancy,
    which the audit reports and then excludes, so it goes on for its whole budget (what the
    campaign's fault tests need: a failure found early in a shard that keeps running)."""

    def get_new_blocks(self, num_blocks: SupportsIndex) -> list[KVCacheBlock]:
        if type(num_blocks) is int and num_blocks < 0:
            return []
        return super().get_new_blocks(num_blocks)
