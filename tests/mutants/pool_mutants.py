"""Block-pool mutants: bugs block pools really have, each planted into impl/.

Every named invariant of spec.pool_invariants and every rule of the pool machine is the
expected killer of at least one mutant here (``killed_by``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvspec.impl import block_pool as bp, kv_cache_utils as kcu
from kvspec.impl.block_pool import BlockPool
from kvspec.impl.hashing import BlockHash, BlockHashWithGroupId, maybe_convert_block_hash
from kvspec.impl.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock
from kvspec.impl.kv_events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved
from tests.mutants import Mutant, replace

MACHINE = ("tests/test_pool_machine.py",)



def touch_keeps_free_block_queued() -> None:
    """touch() counts a hit on a free block but leaves it in the free queue."""
    def touch(self: BlockPool, blocks: Any) -> None:
        flat = list(blocks) if not blocks or isinstance(blocks[0], KVCacheBlock) else [
            b for group in blocks for b in group]
        flat = [b for b in flat if b is not self.null_block]
        for block in flat:
            if block in self._in_use:
                self._shared.add(block)
                block.extra_refs += 1
            else:
                self._in_use.add(block)
    replace(BlockPool, "touch", touch)


def free_forward_order() -> None:
    """free_blocks() queues a request's blocks in reverse of the order given."""
    original = BlockPool.free_blocks

    def free_blocks(self: BlockPool, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        original(self, list(ordered_blocks)[::-1])
    replace(BlockPool, "free_blocks", free_blocks)


def eviction_leaves_key_in_map() -> None:
    """Evicting a block resets its key but leaves it listed under the key in the map."""
    def evict_all(self: BlockPool, keyed: list[KVCacheBlock]) -> None:
        hashes = [self._key_of.pop(block) for block in keyed]
        if self.enable_kv_cache_events:  # the events are right: only the map is wrong
            self.kv_event_queue.extend(
                BlockRemoved(block_hashes=[maybe_convert_block_hash(BlockHash(h))],
                             medium=MEDIUM_GPU) for h in hashes)
    replace(BlockPool, "_evict_all", evict_all)


def cache_keys_keyed_block() -> None:
    """cache_full_blocks() re-keys a block that already has a key instead of refusing."""
    original = BlockPool.cache_full_blocks

    def cache_full_blocks(self: BlockPool, request: Any, blocks: list[KVCacheBlock],
                          num_cached: int, num_full: int, block_size: int, gid: int) -> None:
        for block in blocks[num_cached:num_full]:
            self._key_of.pop(block, None)
        original(self, request, blocks, num_cached, num_full, block_size, gid)
    replace(BlockPool, "cache_full_blocks", cache_full_blocks)


def null_block_enters_free_queue() -> None:
    """free_blocks() forgets to skip the null block, which lands in the free queue."""
    original = BlockPool.free_blocks

    def free_blocks(self: BlockPool, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        blocks = list(ordered_blocks)
        original(self, blocks)
        if any(b is self.null_block for b in blocks):
            self.free_block_queue.extend_unchecked([self.null_block])
    replace(BlockPool, "free_blocks", free_blocks)


def null_block_gets_keyed() -> None:
    """cache_full_blocks() keys the null block like any other."""
    original = BlockPool.cache_full_blocks

    def cache_full_blocks(self: BlockPool, request: Any, blocks: list[KVCacheBlock],
                          num_cached: int, num_full: int, block_size: int, gid: int) -> None:
        null = self.null_block
        original(self, request, blocks, num_cached, num_full, block_size, gid)
        window = blocks[num_cached:num_full]
        if self.enable_caching and null in window and null not in self._key_of:
            index = num_cached + window.index(null)
            block_hash = request.block_hashes[index]
            self._key_of[null] = block_hash
            if gid:
                self._group_of[null] = gid
            self.cached_block_hash_to_block.insert_unchecked(gid, block_hash, null)
    replace(BlockPool, "cache_full_blocks", cache_full_blocks)


def usage_counts_null_block() -> None:
    """get_usage() divides by every block, the null block included."""
    def get_usage(self: BlockPool) -> float:
        return 1.0 - self.get_num_free_blocks() / self.num_gpu_blocks
    replace(BlockPool, "get_usage", get_usage)


def popleft_n_loses_count_on_error() -> None:
    """get_new_blocks() leaves the size check to the free queue, which counts before it checks."""
    def take(self: FreeKVCacheBlockQueue, n: int) -> list[KVCacheBlock]:
        self.num_free_blocks -= n
        if self.num_free_blocks < 0 or n < 0:
            raise kcu.NoFreeBlocksError(f"cannot pop {n} blocks")
        self.num_free_blocks += n
        return original_take(self, n)

    def get_new_blocks(self: BlockPool, num_blocks: int) -> list[KVCacheBlock]:
        blocks = self.free_block_queue.take_unchecked(num_blocks)
        self._evict_all([b for b in blocks if b in self._key_of])
        self._in_use.update(blocks)
        return blocks
    original_take = FreeKVCacheBlockQueue.take_unchecked
    replace(FreeKVCacheBlockQueue, "take_unchecked", take)
    replace(BlockPool, "get_new_blocks", get_new_blocks)


def reset_succeeds_with_blocks_in_use() -> None:
    """reset_prefix_cache() clears the cache even while requests hold blocks."""
    def reset_prefix_cache(self: BlockPool) -> bool:
        self.cached_block_hash_to_block.clear_unchecked()
        self._key_of.clear()
        self._group_of.clear()  # all as impl does, but for the check of blocks in use
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
            self._bound_kv_events()
        return True
    replace(BlockPool, "reset_prefix_cache", reset_prefix_cache)


def no_event_on_eviction() -> None:
    """Evicting a cached block emits no BlockRemoved event."""
    def evict_all(self: BlockPool, keyed: list[KVCacheBlock]) -> None:
        for block in keyed:
            block_hash, group_id = self._key_of.pop(block), self._group_of.pop(block, 0)
            self.cached_block_hash_to_block.remove_unchecked(group_id, block_hash, block)
    replace(BlockPool, "_evict_all", evict_all)


def lookup_returns_last_inserted() -> None:
    """get_cached_block() returns the block cached last under a key, not the first."""
    def get_cached_block(self: BlockPool, block_hash: bytes,
                         group_ids: list[int]) -> list[KVCacheBlock] | None:
        if type(block_hash) is not bytes:
            raise bp.InvalidBlockHashError(f"bad hash {block_hash!r}")
        found = []
        for gid in group_ids:
            blocks = self.cached_block_hash_to_block.blocks_under(gid, block_hash)
            if not blocks:
                return None
            found.append(blocks[-1])
        return found
    replace(BlockPool, "get_cached_block", get_cached_block)


def lookup_not_all_or_nothing() -> None:
    """get_cached_block() returns the groups that hit even when another group misses."""
    def get_cached_block(self: BlockPool, block_hash: bytes,
                         group_ids: list[int]) -> list[KVCacheBlock] | None:
        if type(block_hash) is not bytes:
            raise bp.InvalidBlockHashError(f"bad hash {block_hash!r}")
        found = [self.cached_block_hash_to_block.get_one_block(
            BlockHashWithGroupId(block_hash + gid.to_bytes(4, "big"))) for gid in group_ids]
        hits = [b for b in found if b is not None]
        return hits or None
    replace(BlockPool, "get_cached_block", get_cached_block)


def free_is_not_atomic() -> None:
    """free_blocks() releases the valid blocks before it notices an unreferenced one."""
    def free_blocks(self: BlockPool, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        blocks = [b for b in ordered_blocks if b is not self.null_block]
        self._check_owned(blocks)
        for block in blocks:
            BlockPool._free_one_by_one(self, [block])
    replace(BlockPool, "free_blocks", free_blocks)


def alloc_keeps_stale_key() -> None:
    """get_new_blocks() hands out a cached free block without evicting its key."""
    def get_new_blocks(self: BlockPool, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks < 0 or num_blocks > self.get_num_free_blocks():
            raise bp.NotEnoughFreeBlocksError(f"Cannot get {num_blocks} free blocks")
        blocks = self.free_block_queue.take_unchecked(num_blocks)
        self._in_use.update(blocks)
        return blocks
    replace(BlockPool, "get_new_blocks", get_new_blocks)


def caching_off_still_keys() -> None:
    """cache_full_blocks() keys blocks even when prefix caching is disabled."""
    original = BlockPool.cache_full_blocks

    def cache_full_blocks(self: BlockPool, *args: Any) -> None:
        enabled, self.enable_caching = self.enable_caching, True
        try:
            original(self, *args)
        finally:
            self.enable_caching = enabled
    replace(BlockPool, "cache_full_blocks", cache_full_blocks)


def empty_key_entry_left_behind() -> None:
    """Removing a key's last block empties its slot but leaves the key in the map."""
    original = bp.BlockHashToBlockMap.remove_unchecked

    def remove(self: bp.BlockHashToBlockMap, group_id: int, block_hash: bytes,
               block: KVCacheBlock) -> None:
        group = self.groups[group_id]
        if group.get(block_hash) is block and not self.later.get((group_id, block_hash)):
            group[block_hash] = None  # type: ignore[assignment]
        else:
            original(self, group_id, block_hash, block)

    def evict_all(self: BlockPool, keyed: list[KVCacheBlock]) -> None:
        for block in keyed:  # every eviction through _remove (no inlined fast path)
            block_hash, group_id = self._key_of.pop(block), self._group_of.pop(block, 0)
            self.cached_block_hash_to_block.remove_unchecked(group_id, block_hash, block)
            if self.enable_kv_cache_events:
                self.kv_event_queue.append(BlockRemoved(
                    block_hashes=[maybe_convert_block_hash(BlockHash(block_hash))],
                    medium=MEDIUM_GPU))
    replace(bp.BlockHashToBlockMap, "remove_unchecked", remove)
    replace(BlockPool, "_evict_all", evict_all)


def evict_requeues_free_block() -> None:
    """evict_blocks() moves an evicted free block to the queue's tail without unlinking it."""
    original = BlockPool.evict_blocks

    def evict_blocks(self: BlockPool, block_ids: set[int]) -> None:
        original(self, block_ids)
        for block_id in sorted(block_ids):
            block = self.blocks[block_id]
            if block_id and block.ref_cnt == 0:
                self.free_block_queue.extend_unchecked([block])
    replace(BlockPool, "evict_blocks", evict_blocks)


def free_block_reports_negative_ref() -> None:
    """A shared block reports a negative ref_cnt (its extra references subtracted)."""
    def ref_count(self: BlockPool, block: KVCacheBlock) -> int:
        if block not in self._in_use:
            return 0
        return -(block.extra_refs + 1) if block.extra_refs else 1
    replace(BlockPool, "_ref_count", ref_count)


def take_events_keeps_queue() -> None:
    """take_events() returns the pending events but does not clear them."""
    def take_events(self: BlockPool) -> list[Any]:
        return list(self.kv_event_queue) if self.enable_kv_cache_events else []
    replace(BlockPool, "take_events", take_events)


def alloc_hands_out_tail_first() -> None:
    """get_new_blocks() hands a request its blocks in reverse queue order."""
    original = BlockPool.get_new_blocks

    def get_new_blocks(self: BlockPool, num_blocks: int) -> list[KVCacheBlock]:
        return original(self, num_blocks)[::-1]
    replace(BlockPool, "get_new_blocks", get_new_blocks)


def take_events_newest_first() -> None:
    """take_events() hands out the pending events newest first."""
    original = BlockPool.take_events

    def take_events(self: BlockPool) -> list[Any]:
        return original(self)[::-1]
    replace(BlockPool, "take_events", take_events)


def stored_event_wrong_parent() -> None:
    """BlockStored names the first newly cached block's own hash as its parent."""
    original = BlockPool.cache_full_blocks

    def cache_full_blocks(self: BlockPool, request: Any, blocks: list[KVCacheBlock],
                          num_cached: int, num_full: int, block_size: int, gid: int) -> None:
        before = len(self.kv_event_queue)
        original(self, request, blocks, num_cached, num_full, block_size, gid)
        if len(self.kv_event_queue) > before:
            stored = self.kv_event_queue[-1]
            wrong = maybe_convert_block_hash(request.block_hashes[num_cached])
            self.kv_event_queue[-1] = type(stored)(
                stored.block_hashes, wrong, stored.token_ids,  # type: ignore[attr-defined]
                stored.block_size, stored.lora_id, stored.medium)  # type: ignore[attr-defined]
    replace(BlockPool, "cache_full_blocks", cache_full_blocks)


def evict_out_of_range_not_atomic() -> None:
    """evict_blocks() evicts the ids in range before complaining about one out of range."""
    def evict_blocks(self: BlockPool, block_ids: set[int]) -> None:
        for block_id in block_ids:
            if not 0 <= block_id < self.num_gpu_blocks:
                raise bp.BlockNotInPoolError(f"block id {block_id} out of range")
            block = self._objects[block_id]
            if block is not None and block in self._key_of:
                self._evict_all([block])
    replace(BlockPool, "evict_blocks", evict_blocks)


def stale_entry_handed_out() -> None:
    """The free queue forgets that a hit block's old queue entry is stale and hands it out."""
    original = FreeKVCacheBlockQueue.take_unchecked

    def take(self: FreeKVCacheBlockQueue, n: int) -> list[KVCacheBlock]:
        self._stale.clear()
        self._num_stale = 0
        return original(self, n)
    replace(FreeKVCacheBlockQueue, "take_unchecked", take)


def shared_touch_counts_once() -> None:
    """touch() of blocks already in use does not add a reference (a shared block is freed early)."""
    def share(self: BlockPool, blocks: list[KVCacheBlock]) -> None:
        pass
    replace(BlockPool, "_share", share)


def prefix_lookup_skips_a_miss() -> None:
    """get_cached_prefix() returns every cached block of the prefix, not only the leading run."""
    def get_cached_prefix(self: BlockPool, block_hashes: list[bytes], group_id: int,
                          max_blocks: int) -> list[KVCacheBlock]:
        group = self._groups.get(group_id, {})
        found = [group.get(h) for h in block_hashes[:max_blocks]]
        return [b for b in found if b is not None]
    replace(BlockPool, "get_cached_prefix", get_cached_prefix)


MUTANTS = [
    Mutant("touch_keeps_free_block_queued", "touch leaves a hit free block in the free queue",
           touch_keeps_free_block_queued, MACHINE, "but the target accepted it"),
    Mutant("free_forward_order", "blocks queued in reverse of the order freed",
           free_forward_order, MACHINE, "free order: target"),
    Mutant("eviction_leaves_key_in_map", "eviction resets the key, the map keeps the block",
           eviction_leaves_key_in_map, MACHINE, "key_map_agrees_with_block_keys"),
    Mutant("cache_keys_keyed_block", "a keyed block gets keyed again",
           cache_keys_keyed_block, MACHINE, "spec refuses (AlreadyCached"),
    Mutant("null_block_enters_free_queue", "the null block enters the free queue",
           null_block_enters_free_queue, MACHINE, "free_order_within_pool"),
    Mutant("null_block_gets_keyed", "cache_full_blocks keys the null block",
           null_block_gets_keyed, MACHINE, "null_block_never_free_never_keyed"),
    Mutant("usage_counts_null_block", "usage counts the null block",
           usage_counts_null_block, MACHINE, "get_usage: target"),
    Mutant("popleft_n_loses_count_on_error", "popleft_n loses the count on error",
           popleft_n_loses_count_on_error, MACHINE, "get_num_free_blocks: target"),
    Mutant("reset_succeeds_with_blocks_in_use", "reset succeeds with blocks in use",
           reset_succeeds_with_blocks_in_use, MACHINE, "ResetPrefixCache(): target True"),
    Mutant("no_event_on_eviction", "no BlockRemoved event on eviction",
           no_event_on_eviction, MACHINE, "events_replay_to_cached_keys"),
    Mutant("lookup_returns_last_inserted", "a lookup returns the last block cached under a key",
           lookup_returns_last_inserted, MACHINE, "GetCachedBlock("),
    Mutant("prefix_lookup_skips_a_miss", "the bulk prefix lookup goes on past a miss",
           prefix_lookup_skips_a_miss, MACHINE, "GetCachedPrefix("),
    Mutant("lookup_not_all_or_nothing", "a lookup hits when only some groups hit",
           lookup_not_all_or_nothing, MACHINE, "GetCachedBlock("),
    Mutant("free_is_not_atomic", "a refused free has already released some blocks",
           free_is_not_atomic, MACHINE, "refused call changed"),
    Mutant("alloc_keeps_stale_key", "an allocated block keeps its old key",
           alloc_keeps_stale_key, MACHINE, "allocated_blocks_are_fresh"),
    Mutant("caching_off_still_keys", "blocks get keys with prefix caching off",
           caching_off_still_keys, MACHINE, "keys_only_when_caching"),
    Mutant("empty_key_entry_left_behind", "popping a key's last block leaves an empty entry",
           empty_key_entry_left_behind, MACHINE, "no_empty_key_entries"),
    Mutant("evict_requeues_free_block", "evict_blocks queues a free block a second time",
           evict_requeues_free_block, MACHINE, "free_order_has_no_duplicates"),
    Mutant("free_block_reports_negative_ref", "a shared block reports a negative ref_cnt",
           free_block_reports_negative_ref, MACHINE, "ref_counts_nonnegative"),
    Mutant("take_events_keeps_queue", "take_events does not clear the queue",
           take_events_keeps_queue, MACHINE, "events_replay_to_cached_keys"),
    Mutant("alloc_hands_out_tail_first", "get_new_blocks returns its blocks in reverse order",
           alloc_hands_out_tail_first, MACHINE, "GetNewBlocks(n="),
    Mutant("take_events_newest_first", "take_events hands out events newest first",
           take_events_newest_first, MACHINE, "TakeEvents(): target"),
    Mutant("stored_event_wrong_parent", "BlockStored carries the wrong parent hash",
           stored_event_wrong_parent, MACHINE, "event_stored_parent_outside_its_blocks"),
    Mutant("evict_out_of_range_not_atomic", "a refused evict has already evicted some keys",
           evict_out_of_range_not_atomic, MACHINE, "refused call changed"),
    Mutant("stale_entry_handed_out", "a hit block's stale queue entry is allocated again",
           stale_entry_handed_out, MACHINE, "free_iff_unreferenced"),
    Mutant("shared_touch_counts_once", "a hit on a block in use adds no reference",
           shared_touch_counts_once, MACHINE, "ref counts: target"),
]
