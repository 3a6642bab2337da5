"""Eviction-policy mutants: bugs a policy patch really has, each planted into impl/eviction.py
or the pool's policy operations. Every new invariant (spec.pool_invariants: pinned blocks stay
cached, no expired priority, priorities only on cached blocks; the allocation judge
evicted_lowest_priority_first) and every policy rule of the pool machine kills one.
"""

from __future__ import annotations

import heapq
from typing import Any

from kvspec.impl import eviction as ev
from kvspec.impl.block_pool import BlockPool
from kvspec.impl.eviction import LruLifoUnhashed, PinnedPolicy, PriorityPolicy
from kvspec.impl.kv_cache_utils import KVCacheBlock
from tests.mutants import Mutant, replace

POOL = ("tests/test_policy_machines.py",)
PRIORITY = ("tests/test_policy_machines.py::TestPriorityConforms",)
PINNED = ("tests/test_policy_machines.py::TestPinnedConforms",)
LIFO = ("tests/test_policy_machines.py::TestLruLifoUnhashedConforms",)
MANAGER_PRIORITY = ("tests/test_policy_machines.py::TestManagerPriorityConforms",)


def pin_leaves_free_block_queued() -> None:
    """pin_blocks pins a free block without taking a reference: it stays evictable."""
    def pin_blocks(self: BlockPool, block_ids: Any) -> None:
        policy = self._require(self._policy is not None and self._policy.has_pins, "pins")
        blocks = self._policy_blocks(block_ids, once=True)
        for block in blocks:
            if block in policy.pinned:
                raise ev.PinRefusedError(f"block {block.block_id} is already pinned")
            if block not in self._key_of:
                raise ev.BlockNotCachedError(f"block {block.block_id} has no key")
        if len(policy.pinned) + len(blocks) > policy.cap:
            raise ev.PinRefusedError("over the cap")
        self.touch([b for b in blocks if b in self._in_use])  # forgets the free ones
        policy.pinned.update(blocks)
    replace(BlockPool, "pin_blocks", pin_blocks)


def priority_ignored_by_allocation() -> None:
    """The priority policy hands out the free queue's head (plain LRU)."""
    def take(self: PriorityPolicy, n: int) -> list[KVCacheBlock]:
        chosen = self._pool().free_block_queue.take_unchecked(n)
        for block in chosen:
            self._entry.pop(block, None)
        return chosen
    replace(PriorityPolicy, "take", take)


def expired_priority_never_reverts() -> None:
    """advance_clock moves the clock but never reverts an expired priority."""
    replace(PriorityPolicy, "advance_clock", lambda self, now: None)


def evicted_block_keeps_priority() -> None:
    """A block that loses its key keeps its retention priority."""
    def uncached(self: PriorityPolicy, blocks: list[KVCacheBlock]) -> None:
        for block in blocks:
            self._rekey(block)
    replace(PriorityPolicy, "uncached", uncached)


def reset_keeps_priorities() -> None:
    """reset_prefix_cache forgets every key but keeps the blocks' priorities."""
    def reset(self: PriorityPolicy) -> None:
        entry = self._entry
        for block, (_, stamp) in entry.items():
            entry[block] = (ev.UNCACHED_PRIORITY, stamp)
        self._heap = [(ev.UNCACHED_PRIORITY, s, b.block_id) for b, (_, s) in entry.items()]
        heapq.heapify(self._heap)
    replace(PriorityPolicy, "reset", reset)


def reprioritised_free_block_not_requeued() -> None:
    """set_retention on a free block changes its priority but not its place in the heap."""
    def set_priority(self: PriorityPolicy, block: KVCacheBlock, priority: int,
                     duration: int | None) -> None:
        if priority == ev.DEFAULT_PRIORITY and duration is None:
            self._priority.pop(block, None)
            return
        expires = None if duration is None else self._pool().clock + duration
        self._priority[block] = (priority, expires)
        if expires is not None:
            heapq.heappush(self._expiries, (expires, block.block_id, priority))
    replace(PriorityPolicy, "set", set_priority)


def hints_read_lowest_priority() -> None:
    """Of the hints covering a block, the lowest priority wins (not the highest)."""
    def cached(self: PriorityPolicy, hints: list[Any], blocks: Any, first: int,
               block_size: int) -> None:
        null = self._pool().null_block
        for offset, block in enumerate(blocks):
            start = (first + offset) * block_size
            covering = [h for h in hints if h.start < start + block_size
                        and (h.end is None or h.end > start)]
            if block is not null and covering:
                best = min(covering, key=lambda h: h.priority)
                self.set(block, best.priority, best.duration)
    replace(PriorityPolicy, "cached", cached)


def lifo_puts_unkeyed_at_tail() -> None:
    """lru-lifo-unhashed queues unkeyed blocks at the tail, like lru."""
    replace(LruLifoUnhashed, "freed", ev.EvictionPolicy.freed)


def pin_reference_freed_by_request() -> None:
    """free_blocks lets a caller release the reference a pin holds."""
    replace(PinnedPolicy, "check_free", lambda self, blocks: None)


def evicting_pinned_block_allowed() -> None:
    """evict_blocks drops a pinned block's key."""
    replace(PinnedPolicy, "check_evict", lambda self, blocks: None)


def unpin_of_unpinned_block_ignored() -> None:
    """unpin_blocks of a block that is not pinned frees it anyway."""
    def unpin_blocks(self: BlockPool, block_ids: Any) -> None:
        policy = self._require(self._policy is not None and self._policy.has_pins, "pins")
        blocks = self._policy_blocks(block_ids, once=True)
        policy.pinned.difference_update(blocks)
        self.free_blocks(blocks)
    replace(BlockPool, "unpin_blocks", unpin_blocks)


def clock_may_go_back() -> None:
    """advance_clock accepts a time before the pool's."""
    def advance_clock(self: BlockPool, now: Any) -> None:
        self._now = now
        if self._policy is not None:
            self._policy.advance_clock(now)
    replace(BlockPool, "advance_clock", advance_clock)


def priority_out_of_range_accepted() -> None:
    """set_retention accepts a priority outside [0, 100]."""
    original = ev.check_retention

    def check_retention(start: Any, end: Any, priority: Any, duration: Any) -> Any:
        checked = original(start, end,
                           max(0, min(100, priority)) if type(priority) is int else priority,
                           duration)
        return (*checked[:2], priority if type(priority) is int else checked[2], checked[3])
    from kvspec.impl import block_pool
    replace(block_pool, "check_retention", check_retention)


def manager_drops_request_hints() -> None:
    """The priority policy never reads a request's hints (kv_retention)."""
    replace(PriorityPolicy, "check_hints", lambda self, request: None)


MUTANTS = [
    Mutant("pin_leaves_free_block_queued", "a pinned free block stays in the free queue",
           pin_leaves_free_block_queued, PINNED, "pinned_blocks_stay_cached"),
    Mutant("priority_ignored_by_allocation", "the priority policy allocates in LRU order",
           priority_ignored_by_allocation, PRIORITY, "evicted_lowest_priority_first"),
    Mutant("expired_priority_never_reverts", "an expired priority is still used",
           expired_priority_never_reverts, PRIORITY, "no_expired_priority"),
    Mutant("evicted_block_keeps_priority", "an evicted block keeps its priority",
           evicted_block_keeps_priority, PRIORITY, "priorities_only_on_cached_blocks"),
    Mutant("reset_keeps_priorities", "reset_prefix_cache keeps the blocks' priorities",
           reset_keeps_priorities, PRIORITY, "priorities_only_on_cached_blocks"),
    Mutant("reprioritised_free_block_not_requeued",
           "a free block's new priority does not move it in the eviction order",
           reprioritised_free_block_not_requeued, PRIORITY, "queued at worth"),
    Mutant("hints_read_lowest_priority", "overlapping hints: the lowest priority wins",
           hints_read_lowest_priority, PRIORITY, "policy state (clock, retention, pinned)"),
    Mutant("lifo_puts_unkeyed_at_tail", "lru-lifo-unhashed reuses unkeyed blocks last",
           lifo_puts_unkeyed_at_tail, LIFO, "free order: target"),
    Mutant("pin_reference_freed_by_request", "a caller frees the reference a pin holds",
           pin_reference_freed_by_request, PINNED, "but the target accepted it"),
    Mutant("evicting_pinned_block_allowed", "evict_blocks drops a pinned block's key",
           evicting_pinned_block_allowed, PINNED, "EvictBlocks("),
    Mutant("unpin_of_unpinned_block_ignored", "unpinning a block that is not pinned frees it",
           unpin_of_unpinned_block_ignored, PINNED, "UnpinBlocks("),
    Mutant("clock_may_go_back", "advance_clock accepts a time in the past",
           clock_may_go_back, PRIORITY, "AdvanceClock("),
    Mutant("priority_out_of_range_accepted", "a priority outside [0, 100] is accepted",
           priority_out_of_range_accepted, PRIORITY, "SetRetention("),
    Mutant("manager_drops_request_hints", "a request's retention hints are never read",
           manager_drops_request_hints, MANAGER_PRIORITY, "retention: target"),
]
