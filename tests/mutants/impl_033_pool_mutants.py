"""impl's vLLM 0.33 pool mutants: bugs planted into ``BlockPool033`` (impl/block_pool_033.py,
what ``BlockPool(vllm_api="0.33")`` builds).

Each is killed by the 0.33 examples in tests/test_block_pool_033.py (the test named in
``killed_by``), which also check the 0.33 part of the pool's representation invariant.
"""

from __future__ import annotations

from typing import Any

from kvspec.impl.block_pool_033 import BlockPool033
from tests.mutants import Mutant, replace

CHECKER = ("tests/test_block_pool_033.py",)


def free_033_all_to_tail() -> None:
    """A 0.33 pool queues every freed block at the tail (0.13's FIFO, #48017's flip)."""
    def release(self: BlockPool033, zeroed: list[Any]) -> None:
        self.free_block_queue.extend_unchecked(zeroed)
    replace(BlockPool033, "_release", release)


def partial_keys_outlive_block() -> None:
    """Dropping a block's keys forgets its partial entries: they stay in the map."""
    original = BlockPool033._remove_keys

    def remove_keys(self: BlockPool033, block: Any) -> list[tuple[int, bytes]]:
        saved = dict(self.cached_block_hashes_by_block)
        self.cached_block_hashes_by_block.clear()
        removed = original(self, block)
        self.cached_block_hashes_by_block.update(saved)  # the partial keys are kept
        return removed
    replace(BlockPool033, "_remove_keys", remove_keys)


def reuse_watcher_never_fires() -> None:
    """A block released by unpin_blocks(blocks, on_reuse) is handed out silently."""
    def notify_reuse(self: BlockPool033, blocks: Any) -> None:
        return None
    replace(BlockPool033, "_notify_reuse", notify_reuse)


def foreign_free_not_forwarded() -> None:
    """free_blocks() treats another pool's blocks as its own strangers (no forwarding)."""
    def foreign_blocks(self: BlockPool033, blocks: list[Any]) -> dict[Any, list[Any]]:
        return {}
    replace(BlockPool033, "_foreign_blocks", foreign_blocks)


MUTANTS = [
    Mutant("free_033_all_to_tail", "a 0.33 pool frees unkeyed blocks to the tail",
           free_033_all_to_tail, CHECKER, "test_033_free_order_unkeyed_first_keyed_last"),
    Mutant("partial_keys_outlive_block", "partial entries outlive their block's keys",
           partial_keys_outlive_block, CHECKER, "test_033_partial_entries_leave_with_their_block"),
    Mutant("reuse_watcher_never_fires", "unpinned blocks reused without their watcher",
           reuse_watcher_never_fires, CHECKER, "test_033_unpin_watcher_fires_on_reuse_and_reset"),
    Mutant("foreign_free_not_forwarded", "another pool's blocks are not forwarded on free",
           foreign_free_not_forwarded, CHECKER, "test_033_free_forwards_to_the_owning_pool"),
]

# Killed by the 0.33 machine on impl (tests/test_pool_machine.py::TestImplConformsToSpec033),
# or by the examples that pin what the machine reaches rarely.
MACHINE_033 = ("tests/test_pool_machine.py::TestImplConformsToSpec033",)


def null_range_reports_nothing() -> None:
    """cache_full_blocks over only null blocks emits no BlockStored (vLLM 0.33 emits an empty
    one: docs/findings.md, D2)."""
    original = BlockPool033._cache_blocks

    def cache(self: BlockPool033, request: Any, request_hashes: list[Any], block_list: list[Any],
              new_blocks: list[Any], *rest: Any) -> None:
        if all(b is self.null_block for b in new_blocks):
            return
        original(self, request, request_hashes, block_list, new_blocks, *rest)
    replace(BlockPool033, "_cache_blocks", cache)


def snapshot_taken_midway() -> None:
    """The event bound collapses the queue as soon as keys are removed, before the operation
    has put its new keys in place (the snapshot misses them)."""
    original = BlockPool033._removed_events

    def removed_events(self: BlockPool033, removed: list[tuple[int, bytes]]) -> None:
        original(self, removed)
        if removed and self.max_pending_kv_events is not None:
            self._bound_kv_events()
    replace(BlockPool033, "_removed_events", removed_events)


def snapshot_forgets_partial_entries() -> None:
    """A collapsed queue's snapshot lists the blocks' primary keys only, not their partial
    entries (a router replaying it loses them)."""
    original = BlockPool033._bound_kv_events

    def bound(self: BlockPool033) -> None:
        saved = dict(self.cached_block_hashes_by_block)
        self.cached_block_hashes_by_block.clear()
        try:
            original(self)
        finally:
            self.cached_block_hashes_by_block.update(saved)
    replace(BlockPool033, "_bound_kv_events", bound)


MUTANTS += [
    Mutant("null_range_reports_nothing",
           "0.33: cache_full_blocks over only null blocks emits no BlockStored",
           null_range_reports_nothing, CHECKER,
           "test_033_range_of_null_blocks_reports_an_empty_store"),
    Mutant("snapshot_taken_midway",
           "0.33: the event bound collapses midway, before an operation's keys are in place",
           snapshot_taken_midway, MACHINE_033, "pending events: target"),
    Mutant("snapshot_forgets_partial_entries",
           "0.33: a collapsed queue's snapshot leaves out the partial entries",
           snapshot_forgets_partial_entries, CHECKER,
           "test_033_bounded_snapshot_lists_partial_entries_after_primary_keys"),
]
