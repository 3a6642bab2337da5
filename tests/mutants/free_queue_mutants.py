"""Free-queue mutants: bugs in FreeKVCacheBlockQueue's public API that the pool never reaches.

The pool moves its blocks through the queue's ``take_unchecked``/``extend_unchecked``/
``remove_unchecked`` after checking every call itself, so these bugs pass the pool machine;
the free-queue layer (tests/test_free_queue_machine.py) drives the queue on its own and must
kill each one.
"""

from __future__ import annotations

from typing import Any

from kvspec.impl.kv_cache_utils import (
    FreeKVCacheBlockQueue,
    InvalidFreeQueueArgument,
    KVCacheBlock,
    NoFreeBlocksError,
)
from tests.mutants import Mutant, replace

MACHINE = ("tests/test_free_queue_machine.py",)


def popleft_n_lowers_count_before_refusing() -> None:
    """popleft_n takes the count off first and refuses afterwards, without putting it back."""
    def popleft_n(self: FreeKVCacheBlockQueue, n: Any) -> list[KVCacheBlock]:
        self._refuse_for_pool("popleft_n")
        if type(n) is not int or n < 0:
            raise InvalidFreeQueueArgument(f"bad count {n!r}")
        self.num_free_blocks -= n
        if self.num_free_blocks < 0:
            raise NoFreeBlocksError(f"cannot pop {n} blocks")
        self.num_free_blocks += n
        return self.take_unchecked(n)
    replace(FreeKVCacheBlockQueue, "popleft_n", popleft_n)


def popleft_n_accepts_negative() -> None:
    """popleft_n checks only that the count is an int and not above the free count (as vLLM's
    assert does), so a negative count is taken: it raises the count and pops nothing."""
    def popleft_n(self: FreeKVCacheBlockQueue, n: Any) -> list[KVCacheBlock]:
        self._refuse_for_pool("popleft_n")
        if type(n) is not int:
            raise InvalidFreeQueueArgument(f"bad count {n!r}")
        if n > self.num_free_blocks:
            raise NoFreeBlocksError(f"cannot pop {n} blocks")
        if n < 0:
            self.num_free_blocks -= n
            return []
        return self.take_unchecked(n)
    replace(FreeKVCacheBlockQueue, "popleft_n", popleft_n)


def remove_of_unqueued_block_corrupts() -> None:
    """remove() trusts its caller: a block that is not queued is marked stale all the same,
    which lowers the count and later skips one of the block's future entries."""
    def remove(self: FreeKVCacheBlockQueue, block: Any) -> None:
        self._refuse_for_pool("remove")
        self.remove_unchecked([block])
    replace(FreeKVCacheBlockQueue, "remove", remove)


def append_n_loses_last_block() -> None:
    """append_n puts back all but the last of several blocks (an off-by-one slice)."""
    original = FreeKVCacheBlockQueue.append_n

    def append_n(self: FreeKVCacheBlockQueue, blocks: Any) -> None:
        listed = list(blocks)
        distinct = len({id(b) for b in listed}) == len(listed)  # bad lists still refused
        original(self, listed[:-1] if distinct and len(listed) > 1 else listed)
    replace(FreeKVCacheBlockQueue, "append_n", append_n)


def get_all_free_blocks_lists_stale_entries() -> None:
    """get_all_free_blocks lists every entry from the head, stale ones included."""
    def get_all_free_blocks(self: FreeKVCacheBlockQueue) -> list[KVCacheBlock]:
        fresh: list[KVCacheBlock] = []
        if self._fresh_next < self._fresh_end and self._materialize is not None:
            fresh = self._materialize(self._fresh_next, self._fresh_end)
        return fresh + self._entries[self._head:]
    replace(FreeKVCacheBlockQueue, "get_all_free_blocks", get_all_free_blocks)


MUTANTS = [
    Mutant("popleft_n_lowers_count_before_refusing",
           "a refused popleft_n leaves num_free_blocks lowered",
           popleft_n_lowers_count_before_refusing, MACHINE,
           "a refused call changed the target's state"),
    Mutant("popleft_n_accepts_negative", "popleft_n(-1) raises the count and pops nothing",
           popleft_n_accepts_negative, MACHINE, "popleft_n_negative"),
    Mutant("remove_of_unqueued_block_corrupts",
           "remove() of a block that is not queued lowers the count",
           remove_of_unqueued_block_corrupts, MACHINE, "remove_unqueued"),
    Mutant("append_n_loses_last_block", "append_n drops the last of several blocks",
           append_n_loses_last_block, MACHINE, "view_matches_spec"),
    Mutant("get_all_free_blocks_lists_stale_entries",
           "get_all_free_blocks lists removed blocks' stale entries",
           get_all_free_blocks_lists_stale_entries, MACHINE, "count_matches_entries"),
]
