"""An eviction policy written by a third party, against impl's public policy API only.

It uses nothing of impl but `EvictionPolicy` (the hooks), `PolicyPool` (what a policy may
read of its pool) and `PolicyQueue` (how it may move free blocks), all documented in
impl/eviction.py; no underscore name of impl. It is vLLM 0.33's rule, written afresh: a block
freed without a key holds nothing worth keeping, so it goes to the head of the free queue, to
be reused first; a cached block goes to the tail (LRU). It also counts what it did.

    kvspec audit --target tests.example_policy:ReuseUnkeyedFirst --policy lru-lifo-unhashed

checks it against the spec (tests/test_audit_policy.py runs that command).
"""

from __future__ import annotations

from kvspec.impl.eviction import EvictionPolicy, PolicyPool
from kvspec.impl.kv_cache_utils import KVCacheBlock


class ReuseUnkeyedFirst(EvictionPolicy):
    """Unkeyed blocks are reused first (most recently freed first), cached blocks in LRU
    order."""

    name = "reuse-unkeyed-first"

    def __init__(self) -> None:
        super().__init__()
        self.to_head = 0  # blocks freed without a key
        self.to_tail = 0  # blocks freed with one

    def _served(self) -> PolicyPool:
        pool = self.pool
        if pool is None:
            raise RuntimeError("ReuseUnkeyedFirst serves no pool yet")
        return pool

    def freed(self, blocks: list[KVCacheBlock]) -> None:
        pool = self._served()
        queue = pool.free_block_queue
        cached = pool.cached_blocks if pool.enable_caching else ()
        unkeyed = [block for block in blocks if block not in cached]
        keyed = [block for block in blocks if block in cached]
        if unkeyed:
            queue.prepend_unchecked(unkeyed)
        if keyed:
            queue.extend_unchecked(keyed)
        self.to_head += len(unkeyed)
        self.to_tail += len(keyed)

    def check(self) -> None:
        pool = self._served()
        free = pool.free_block_queue.get_all_free_blocks()
        if len(free) != pool.free_block_queue.num_free_blocks:
            raise AssertionError("reuse-unkeyed-first: the free queue miscounts its blocks")
        if not pool.blocks_in_use.isdisjoint(free) or pool.null_block in free:
            raise AssertionError("reuse-unkeyed-first: a block in use or the null block is free")
