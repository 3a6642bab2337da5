"""vLLM 0.33 pool mutants: bugs planted into vLLM 0.33's own BlockPool, free queue and map.

impl/ has none of 0.33's new pool operations yet, so the checks of the vllm-0.33 profile
(`pool_machine.PoolMachine033`, 0.33's free-queue and map rules, `pool_invariants.V0_33`)
are scored on vLLM 0.33's real classes with one realistic bug each. The checker,
tests/test_audit_vllm_033.py, runs the machines under .venv-vllm-0.33.0's Python, which
plants the mutant there (the environment carries ``KVSPEC_MUTANT``); in an interpreter
without vLLM 0.33 planting does nothing (the checker then runs the 0.33 environment, or is
skipped where it has not been built, and the mutant survives).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from tests.mutants import Mutant, replace, vllm_033_modules

MACHINE = ("tests/test_audit_vllm_033.py",)


def _planted(plant: Callable[[Any, Any], None]) -> Callable[[], None]:
    def run() -> None:
        modules = vllm_033_modules("v1.core.block_pool", "v1.core.kv_cache_utils")
        if modules is not None:
            plant(*modules)
    run.__name__ = plant.__name__
    return run


@_planted
def eviction_forgets_partial_entries(block_pool: Any, utils: Any) -> None:
    """Removing a block's keys removes only its primary key (0.13's eviction): its partial
    entries stay in the map, beside a block that has no key any more."""
    def remove(self: Any, block: Any) -> list[Any]:
        if block.block_hash is None:
            return []
        key = block.block_hash
        removed = [key] if self.cached_block_hash_to_block.pop(key, block.block_id) else []
        block.reset_hash()
        return removed
    replace(block_pool.BlockPool, "_remove_cached_block_hashes", remove)


@_planted
def reuse_watcher_never_fires(block_pool: Any, utils: Any) -> None:
    """get_new_blocks hands out an unpinned block without telling its reader (the watcher
    stays pending: only a reset would fire it)."""
    original = block_pool.BlockPool.get_new_blocks

    def get_new_blocks(self: Any, num_blocks: int) -> list[Any]:
        watchers, self._reuse_watchers = self._reuse_watchers, {}
        try:
            blocks: list[Any] = original(self, num_blocks)
            return blocks
        finally:
            self._reuse_watchers = watchers
    replace(block_pool.BlockPool, "get_new_blocks", get_new_blocks)


@_planted
def reuse_watcher_fires_at_every_reuse(block_pool: Any, utils: Any) -> None:
    """The watcher is read, not taken, when it fires: it fires again at the block's next
    reuse, for a reader long gone."""
    def notify(self: Any, blocks: Iterable[Any]) -> None:
        for block in blocks:
            watcher = self._reuse_watchers.get(block.block_id)
            if watcher is not None:
                watcher(block)
    replace(block_pool.BlockPool, "_notify_reuse", notify)


@_planted
def removal_event_for_primary_key_only(block_pool: Any, utils: Any) -> None:
    """One BlockRemoved for a block's primary key, none for its partial entries: a router
    keeps those hashes for ever."""
    original = block_pool.BlockPool._emit_block_removed_events

    def emit(self: Any, block_hashes: list[Any]) -> None:
        original(self, block_hashes[:1])
    replace(block_pool.BlockPool, "_emit_block_removed_events", emit)


@_planted
def move_block_hashes_emits_removals(block_pool: Any, utils: Any) -> None:
    """Copy-on-write announces the moved keys as removed (the entries stay live)."""
    def move(self: Any, src: Any, dst: Any) -> None:
        num_tokens = src.block_hash_num_tokens
        removed = self._remove_cached_block_hashes(src)
        self._emit_block_removed_events(removed)
        for key in removed:
            self._insert_block_hash(key, dst, num_tokens=num_tokens)
    replace(block_pool.BlockPool, "move_block_hashes", move)


@_planted
def writable_ignores_sharing(block_pool: Any, utils: Any) -> None:
    """is_block_writable forgets the ref count: a block another request shares is written."""
    def writable(self: Any, block: Any) -> bool:
        return not block.is_null and block.block_hash is None
    replace(block_pool.BlockPool, "is_block_writable", writable)


@_planted
def reused_blocks_reported_with_parent(block_pool: Any, utils: Any) -> None:
    """emit_cached_block_events reports the reused prefix as a chain after its own last
    block (a parent hash where the prefix starts at block 0)."""
    original = block_pool.BlockPool._build_block_stored_event

    def build(self: Any, request: Any, block_hashes: Any, parent_block_hash: Any,
              *args: Any, **kwargs: Any) -> Any:
        if parent_block_hash is None and block_hashes:
            parent_block_hash = block_hashes[-1]
        return original(self, request, block_hashes, parent_block_hash, *args, **kwargs)
    replace(block_pool.BlockPool, "_build_block_stored_event", build)


@_planted
def foreign_blocks_freed_here(block_pool: Any, utils: Any) -> None:
    """free_blocks ignores KVCacheBlock.pool (0.13's loop): another pool's blocks are
    counted down here and never reach their owner."""
    original = block_pool.BlockPool.free_blocks

    def free_blocks(self: Any, ordered_blocks: Iterable[Any]) -> None:
        blocks = list(ordered_blocks)
        for block in blocks:
            if block.pool is not None and block.pool is not self:
                block.ref_cnt -= 1
        original(self, [b for b in blocks if b.pool is None or b.pool is self])
    replace(block_pool.BlockPool, "free_blocks", free_blocks)


@_planted
def prepend_n_reverses(block_pool: Any, utils: Any) -> None:
    """prepend_n links the blocks in reverse: the last given is reused first."""
    original = utils.FreeKVCacheBlockQueue.prepend_n

    def prepend_n(self: Any, blocks: list[Any]) -> None:
        original(self, list(reversed(blocks)))
    replace(utils.FreeKVCacheBlockQueue, "prepend_n", prepend_n)


@_planted
def contain_ignores_block(block_pool: Any, utils: Any) -> None:
    """contain(key, block_id) answers whether the key holds any block."""
    def contain(self: Any, key: Any, block_id: int) -> bool:
        return self.get_one_block(key) is not None
    replace(block_pool.BlockHashToBlockMap, "contain", contain)


MUTANTS = [
    Mutant("v033_eviction_forgets_partial_entries",
           "0.33: removing a block's keys leaves its partial entries",
           eviction_forgets_partial_entries, MACHINE,
           killed_by="partial_key_never_outlives_its_block"),
    Mutant("v033_reuse_watcher_never_fires",
           "0.33: get_new_blocks hands out an unpinned block without its watcher firing",
           reuse_watcher_never_fires, MACHINE,
           killed_by="watched_blocks_fire_when_handed_out"),
    Mutant("v033_reuse_watcher_fires_at_every_reuse",
           "0.33: a reuse watcher fires again at every later reuse",
           reuse_watcher_fires_at_every_reuse, MACHINE,
           killed_by="watchers_fire_at_most_once"),
    Mutant("v033_removal_event_for_primary_key_only",
           "0.33: no BlockRemoved for a block's partial entries",
           removal_event_for_primary_key_only, MACHINE,
           killed_by="invariant event_log_has_one_store_one_remove_per_copy"),
    Mutant("v033_move_block_hashes_emits_removals",
           "0.33: copy-on-write emits BlockRemoved for keys that stay live",
           move_block_hashes_emits_removals, MACHINE,
           killed_by="event_log_has_one_store_one_remove_per_copy"),
    Mutant("v033_writable_ignores_sharing", "0.33: is_block_writable ignores the ref count",
           writable_ignores_sharing, MACHINE, killed_by="IsBlockWritable"),
    Mutant("v033_reused_blocks_reported_with_parent",
           "0.33: emit_cached_block_events gives the reused prefix a parent",
           reused_blocks_reported_with_parent, MACHINE,
           killed_by="event_stored_parent_outside_its_blocks"),
    Mutant("v033_foreign_blocks_freed_here",
           "0.33: free_blocks ignores a block's owning pool",
           foreign_blocks_freed_here, MACHINE, killed_by="frees forwarded"),
    Mutant("v033_prepend_n_reverses", "0.33: prepend_n puts the blocks in reverse",
           prepend_n_reverses, MACHINE, killed_by="view_matches_spec"),
    Mutant("v033_contain_ignores_block", "0.33: contain answers for any block under the key",
           contain_ignores_block, MACHINE, killed_by="Contain"),
]
