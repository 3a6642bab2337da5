"""Representation mutants: bugs that corrupt impl's internal bookkeeping without (yet) changing
anything a caller sees, so that only the ``_check()`` representation invariants catch them
(the free-queue and hash-map machines call ``_check()`` after every step;
tests/test_representation_checks.py drives a BlockPool and calls its ``_check()``).
Each ``killed_by`` is the message of the ``_check()`` that must fail.
"""

from __future__ import annotations

from typing import Any

from kvspec.impl.block_pool import BlockHashToBlockMap, BlockPool
from kvspec.impl.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock
from tests.mutants import Mutant, replace

QUEUE_MACHINE = ("tests/test_free_queue_machine.py",)
MAP_MACHINE = ("tests/test_hash_map_machine.py",)
POOL_CHECKS = ("tests/test_pool_machine.py",)  # the machine's target_representation invariant


def remove_forgets_stale_total() -> None:
    """The queue's lazy remove marks the block stale but does not add it to the stale total
    (which only decides when stale entries are compacted away)."""
    original = FreeKVCacheBlockQueue.remove_unchecked

    def remove_unchecked(self: FreeKVCacheBlockQueue, blocks: list[KVCacheBlock]) -> None:
        original(self, blocks)
        self._num_stale -= len(blocks)
    replace(FreeKVCacheBlockQueue, "remove_unchecked", remove_unchecked)


def map_remove_leaves_empty_later_list() -> None:
    """Removing the last of a key's later blocks leaves an empty list in ``_later``."""
    original = BlockHashToBlockMap.remove_unchecked

    def _remove(self: BlockHashToBlockMap, group_id: int, block_hash: bytes,
                block: KVCacheBlock) -> None:
        later = self.later.get((group_id, block_hash))
        original(self, group_id, block_hash, block)
        if later is not None and not later:
            self.later[(group_id, block_hash)] = later
    replace(BlockHashToBlockMap, "remove_unchecked", _remove)


def eviction_keeps_group_of() -> None:
    """Evicting a block drops its key but not its ``_group_of`` entry."""
    original = BlockPool._evict_all

    def _evict_all(self: BlockPool, keyed: list[KVCacheBlock]) -> None:
        groups = {block: self._group_of[block] for block in keyed if block in self._group_of}
        original(self, keyed)
        self._group_of.update(groups)
    replace(BlockPool, "_evict_all", _evict_all)


def free_keeps_unshared_block_shared() -> None:
    """free_blocks lowers a shared block's extra refs to 0 but leaves it in ``_shared``."""
    original = BlockPool.free_blocks

    def free_blocks(self: BlockPool, ordered_blocks: Any) -> None:
        listed = list(ordered_blocks)
        was_shared = [b for b in listed if b in self._shared]
        original(self, listed)
        self._shared.update(b for b in was_shared if b in self._in_use)
    replace(BlockPool, "free_blocks", free_blocks)


MUTANTS = [
    Mutant("queue_remove_forgets_stale_total", "the stale total misses lazily removed blocks",
           remove_forgets_stale_total, QUEUE_MACHINE, "stale count total"),
    Mutant("map_remove_leaves_empty_later_list", "an empty later list stays in the map",
           map_remove_leaves_empty_later_list, MAP_MACHINE, "empty later list"),
    Mutant("pool_eviction_keeps_group_of", "an evicted block keeps its _group_of entry",
           eviction_keeps_group_of, POOL_CHECKS, "_group_of lists a block without a key"),
    Mutant("pool_free_keeps_unshared_block_shared",
           "a block whose extra refs fall to 0 stays in _shared",
           free_keeps_unshared_block_shared, POOL_CHECKS, "has extra refs"),
]
