"""Event mutants: bugs in the events a router consumes, each planted into impl/ and caught by
a named property of `spec.event_consumer` (a router's view of the events) in the pool machine.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from msgspec.structs import replace as with_fields

from kvspec.impl.block_pool import BlockPool
from kvspec.impl.hashing import BlockHash, maybe_convert_block_hash
from kvspec.impl.kv_events import MEDIUM_GPU, BlockRemoved
from tests.mutants import Mutant, replace

MACHINE = ("tests/test_pool_machine.py",)


def stored_event_drops_a_token() -> None:
    """A BlockStored carries its tokens less the last one (an off-by-one slice)."""
    original = BlockPool._stored_event

    def stored_event(self: BlockPool, *args: Any) -> Any:
        stored = original(self, *args)
        return with_fields(stored, token_ids=list(stored.token_ids)[:-1])
    replace(BlockPool, "_stored_event", stored_event)


def eviction_removes_an_unkeyed_block() -> None:
    """evict_blocks emits a BlockRemoved for a block that has no key (its stale hash)."""
    original = BlockPool.evict_blocks

    def evict_blocks(self: BlockPool, block_ids: Iterable[int]) -> None:
        ids = list(block_ids)
        unkeyed = [i for i in ids if 0 < i < self.num_gpu_blocks
                   and self.blocks[i].block_hash is None]
        original(self, set(ids))
        if self.enable_kv_cache_events:
            self.kv_event_queue.extend(
                BlockRemoved(block_hashes=[maybe_convert_block_hash(
                    BlockHash(f"stale-{i}".encode()))], medium=MEDIUM_GPU) for i in unkeyed)
    replace(BlockPool, "evict_blocks", evict_blocks)


MUTANTS = [
    Mutant("stored_event_drops_a_token", "a BlockStored loses its last token",
           stored_event_drops_a_token, MACHINE, "event_stored_covers_whole_blocks"),
    Mutant("eviction_removes_an_unkeyed_block", "BlockRemoved for a block without a key",
           eviction_removes_an_unkeyed_block, MACHINE, "event_removed_was_stored"),
]
