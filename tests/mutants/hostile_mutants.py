"""Hostile-input mutants: each brings back one kind of failure the hostile-input suite exists
to catch (an untyped error, a refusal that changes state, a silent acceptance, an error that
does not name the value), and is killed by the component of tests/hostile/ that meets it.
"""

from __future__ import annotations

from typing import Any

from kvspec.impl import block_pool as bp, kv_cache_utils as kcu
from tests.mutants import Mutant, replace

POOL = "tests/hostile/test_pool.py"


def queue_append_n_not_atomic() -> None:
    """append_n adds entries as it reads them and checks afterwards: an iterator that fails
    halfway (or a bad block in the list) leaves entries behind and the count wrong."""
    def append_n(self: kcu.FreeKVCacheBlockQueue, blocks: Any) -> None:
        self._refuse_for_pool("append_n")
        added = 0
        for block in blocks:
            self._entries.append(block)
            added += 1
        self.num_free_blocks += added
        for block in self._entries[-added:] if added else []:
            if not isinstance(block, kcu.KVCacheBlock):
                raise kcu.InvalidFreeQueueArgument(f"{block!r} is not a KVCacheBlock")
            block._queue = self
    replace(kcu.FreeKVCacheBlockQueue, "append_n", append_n)


def stored_event_built_after_keying() -> None:
    """cache_full_blocks keys the blocks first and builds the BlockStored event afterwards: a
    request whose token ids cannot make the event leaves keys and no event behind."""
    original = bp.BlockPool._stored_event

    def stored_event(self: bp.BlockPool, *args: Any) -> Any:
        return None

    def cache_full_blocks(self: bp.BlockPool, request: Any, blocks: Any, num_cached: Any,
                          num_full: Any, block_size: Any, group_id: Any) -> None:
        events = self.enable_kv_cache_events
        self.enable_kv_cache_events = False
        try:
            plain(self, request, blocks, num_cached, num_full, block_size, group_id)
        finally:
            self.enable_kv_cache_events = events
        if events and type(num_cached) is int and type(num_full) is int and num_full > num_cached:
            hashes = request.block_hashes
            self.kv_event_queue.append(original(
                self, request, hashes, list(hashes[num_cached:num_full]), num_cached, num_full,
                block_size))
    plain = bp.BlockPool.cache_full_blocks
    replace(bp.BlockPool, "_stored_event", stored_event)
    replace(bp.BlockPool, "cache_full_blocks", cache_full_blocks)


def free_blocks_trusts_its_argument() -> None:
    """free_blocks calls list() on its argument: something that is not iterable gets Python's
    bare TypeError instead of a typed refusal."""
    original = bp.BlockPool.free_blocks

    def free_blocks(self: bp.BlockPool, ordered_blocks: Any) -> None:
        original(self, list(ordered_blocks))
    replace(bp.BlockPool, "free_blocks", free_blocks)


def hash_block_size_unchecked() -> None:
    """BlockPool accepts any hash_block_size (0, -1, a float): a pool that cannot key blocks."""
    original = bp.BlockPool.__init__

    def init(self: bp.BlockPool, num_gpu_blocks: Any, enable_caching: Any,
             hash_block_size: Any, *args: Any, **kwargs: Any) -> None:
        original(self, num_gpu_blocks, enable_caching, 16, *args, **kwargs)
        self.hash_block_size = hash_block_size
    replace(bp.BlockPool, "__init__", init)


def evict_checks_as_it_goes() -> None:
    """evict_blocks checks each id just before evicting it: a bad id after good ones leaves
    the good ones evicted."""
    def evict_blocks(self: bp.BlockPool, block_ids: Any) -> None:
        for block_id in block_ids:
            if type(block_id) is not int or not 0 <= block_id < self.num_gpu_blocks:
                raise bp.BlockNotInPoolError(f"block id {block_id!r} is outside the pool")
            block = self._objects[block_id]
            if block is not None and block in self._key_of:
                self._evict_all([block])
    replace(bp.BlockPool, "evict_blocks", evict_blocks)


def refusal_names_nothing() -> None:
    """get_new_blocks refuses a bad count without saying which value it got."""
    original = bp.BlockPool.get_new_blocks

    def get_new_blocks(self: bp.BlockPool, num_blocks: Any) -> Any:
        try:
            return original(self, num_blocks)
        except bp.InvalidBlockCountError:
            raise bp.InvalidBlockCountError("bad block count") from None
    replace(bp.BlockPool, "get_new_blocks", get_new_blocks)


def num_gpu_blocks_unbounded() -> None:
    """BlockPool takes a num_gpu_blocks of any size: 2**64 gets Python's bare OverflowError
    (no list of that many slots can be made) and 2**40 a bare MemoryError, instead of a typed
    refusal. Simulated, not run: a list of 2**32 slots would take 32 GiB."""
    original = bp.BlockPool.__init__

    def init(self: bp.BlockPool, num_gpu_blocks: Any, *args: Any, **kwargs: Any) -> None:
        if type(num_gpu_blocks) is int and num_gpu_blocks > bp.MAX_NUM_GPU_BLOCKS:
            if num_gpu_blocks >= 2**63:
                raise OverflowError("cannot fit 'int' into an index-sized integer")
            raise MemoryError
        original(self, num_gpu_blocks, *args, **kwargs)
    replace(bp.BlockPool, "__init__", init)


def _mutant(name: str, plant: Any) -> Mutant:
    description = " ".join((plant.__doc__ or "").split())
    return Mutant(name, description, plant, (POOL,))


MUTANTS: list[Mutant] = [
    _mutant("hostile_queue_append_n_not_atomic", queue_append_n_not_atomic),
    _mutant("hostile_stored_event_built_after_keying", stored_event_built_after_keying),
    _mutant("hostile_free_blocks_trusts_its_argument", free_blocks_trusts_its_argument),
    _mutant("hostile_hash_block_size_unchecked", hash_block_size_unchecked),
    _mutant("hostile_evict_checks_as_it_goes", evict_checks_as_it_goes),
    _mutant("hostile_refusal_names_nothing", refusal_names_nothing),
    _mutant("hostile_num_gpu_blocks_unbounded", num_gpu_blocks_unbounded),
]
