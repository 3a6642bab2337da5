"""KV-cache manager mutants: bugs the manager layer really has, each planted into impl/.

Each is killed by the manager conformance machine and by at least one directed test of
tests/test_kv_cache_manager.py (its examples pin the cases the machine finds by search).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvspec.impl import (
    hashing,
    kv_cache_coordinator as coord,
    kv_cache_manager as kvm,
    single_type_kv_cache_manager as stm,
)
from kvspec.impl.kv_cache_utils import KVCacheBlock
from tests.mutants import Mutant, replace

MACHINE = "tests/test_manager_machine.py"
EXAMPLES = "tests/test_kv_cache_manager.py"



def hit_without_cap() -> None:
    """get_computed_blocks lets a hit cover the whole prompt (no num_tokens - 1 cap)."""
    def get_computed_blocks(self: kvm.KVCacheManager, request: Any) -> Any:
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return self.empty_kv_cache_blocks, 0
        blocks, num_tokens = self.coordinator.find_longest_cache_hit(
            request.block_hashes, request.num_tokens)
        return self.create_kv_cache_blocks(blocks), num_tokens
    replace(kvm.KVCacheManager, "get_computed_blocks", get_computed_blocks)


def touch_before_capacity_check() -> None:
    """allocate_slots touches the cache hits before checking capacity and does not undo the
    touch when it then returns None."""
    original = kvm.KVCacheManager.allocate_slots

    def allocate_slots(self: kvm.KVCacheManager, request: Any, num_new_tokens: int,
                       num_new_computed_tokens: int = 0, new_computed_blocks: Any = None,
                       num_lookahead_tokens: int = 0, delay_cache_blocks: bool = False,
                       num_encoder_tokens: int = 0) -> Any:
        hits = [] if new_computed_blocks is None else [
            b for group in new_computed_blocks.blocks for b in group]
        if hits and self.enable_caching:
            self.block_pool.touch(hits)
        result = original(self, request, num_new_tokens, num_new_computed_tokens,
                          new_computed_blocks, num_lookahead_tokens, delay_cache_blocks,
                          num_encoder_tokens)
        if result is not None and hits and self.enable_caching:
            self.block_pool.free_blocks(hits)  # the second touch, on success only
        return result
    replace(kvm.KVCacheManager, "allocate_slots", allocate_slots)


def sliding_window_skip_off_by_one() -> None:
    """The sliding window frees one token too many: the oldest token still in the window."""
    def num_skipped_tokens(self: stm.SlidingWindowManager, num_computed_tokens: int) -> int:
        return num_computed_tokens - self.sliding_window + 2
    replace(stm.SlidingWindowManager, "_num_skipped_tokens", num_skipped_tokens)


def hybrid_single_pass() -> None:
    """The hybrid lookup stops after one pass over the attention types and truncates every
    type's hit to the shortest length instead of looking again."""
    def find_longest_cache_hit(self: coord.HybridKVCacheCoordinator, block_hashes: Any,
                               max_cache_hit_length: int) -> Any:
        hit_length = max_cache_hit_length
        found_by_type = []
        for spec, group_ids, manager_class in self._lookups:
            found = manager_class.find_longest_cache_hit_unchecked(
                self._hashes_for(block_hashes, spec.block_size), hit_length, group_ids,
                self.block_pool, spec, self.use_eagle, self.lcm_block_size)
            found_by_type.append(found)
            hit_length = min(hit_length, len(found[0]) * spec.block_size)
        per_group: list[list[KVCacheBlock]] = [[] for _ in self.single_type_managers]
        for (spec, group_ids, _), found in zip(self._lookups, found_by_type, strict=True):
            for group_id, blocks in zip(group_ids, found, strict=True):
                per_group[group_id] = list(blocks[: hit_length // spec.block_size])
        return tuple(per_group), hit_length
    replace(coord.HybridKVCacheCoordinator, "find_longest_cache_hit_unchecked",
            find_longest_cache_hit)


def lookahead_tokens_cached() -> None:
    """allocate_slots counts the lookahead slots as computed tokens when caching, keying
    blocks whose KV has not been computed yet."""
    original = kvm.KVCacheManager.allocate_slots

    def allocate_slots(self: kvm.KVCacheManager, request: Any, num_new_tokens: int,
                       num_new_computed_tokens: int = 0, new_computed_blocks: Any = None,
                       num_lookahead_tokens: int = 0, delay_cache_blocks: bool = False,
                       num_encoder_tokens: int = 0) -> Any:
        result = original(self, request, num_new_tokens, num_new_computed_tokens,
                          new_computed_blocks, num_lookahead_tokens, delay_cache_blocks,
                          num_encoder_tokens)
        if result is not None and self.enable_caching and not delay_cache_blocks:
            num_computed = request.num_computed_tokens + num_new_computed_tokens
            self.coordinator.cache_blocks(request, min(
                num_computed + num_new_tokens + num_lookahead_tokens, request.num_tokens))
        return result
    replace(kvm.KVCacheManager, "allocate_slots", allocate_slots)


def free_forward_order() -> None:
    """free releases a request's blocks first block first, so the chain head is evicted
    before its tail."""
    def free(self: stm.SingleTypeKVCacheManager, request_id: str) -> None:
        blocks = self.req_to_blocks.pop(request_id, None)
        if blocks:
            self.block_pool.free_blocks(blocks)
        self.num_cached_block.pop(request_id, None)
    replace(stm.SingleTypeKVCacheManager, "free", free)


def evictable_hits_cost_nothing() -> None:
    """The capacity check forgets that a hit on a free block takes that block off the free
    queue (it counts every hit as already paid for)."""
    def get_num_blocks_to_allocate(self: stm.SingleTypeKVCacheManager, request_id: str,
                                   num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock]) -> int:
        held = self.req_to_blocks.get(request_id) or []
        return -(-num_tokens // self.block_size) - len(new_computed_blocks) - len(held)
    replace(stm.SingleTypeKVCacheManager, "get_num_blocks_to_allocate_unchecked",
           get_num_blocks_to_allocate)


def chunked_local_without_null_padding() -> None:
    """The chunked-local lookup scans from block 0 instead of padding the blocks of earlier
    chunks with null blocks."""
    def chunked_local_hit(hits: Sequence[bool], max_length: int, block_size: int,
                          attention_chunk_size: int) -> tuple[int, int]:
        end = 0
        while end < max_length // block_size and hits[end]:
            end += 1
        return 0, end
    replace(stm, "chunked_local_hit", chunked_local_hit)


def mamba_first_hit() -> None:
    """The Mamba lookup takes the first cached state from the left instead of the last."""
    def mamba_hit_blocks(hits: Sequence[bool], max_length: int, block_size: int,
                         alignment_tokens: int) -> int:
        for i in range(max_length // block_size):
            if hits[i] and (i + 1) * block_size % alignment_tokens == 0:
                return i + 1
        return 0
    replace(stm, "mamba_hit_blocks", mamba_hit_blocks)


def sliding_window_run_not_reset() -> None:
    """The sliding-window lookup keeps counting its run across a miss, so non-contiguous
    hits pass for a full window."""
    def sliding_window_hit(hits: Sequence[bool], max_length: int, block_size: int,
                           sliding_window: int, alignment_tokens: int,
                           use_eagle: bool) -> tuple[int, int]:
        need = stm.sliding_window_blocks_for_hit(sliding_window, block_size, use_eagle)
        run, last = 0, -1
        for i in range(max_length // block_size - 1, -1, -1):
            if hits[i]:
                if last < 0:
                    last = i
                run += 1
                if run >= need:
                    return i, last + 1
        return 0, run if last == run - 1 else 0
    replace(stm, "sliding_window_hit", sliding_window_hit)


def common_prefix_counts_shared_blocks() -> None:
    """get_num_common_prefix_blocks counts leading blocks held by more than one request
    instead of blocks held by every running request."""
    def get_num_common_prefix_blocks(self: stm.FullAttentionManager,
                                     running_request_id: str) -> int:
        count = 0
        for block in self.req_to_blocks.get(running_request_id) or []:
            if block.ref_cnt < 2 and len(self.req_to_blocks) > 1:
                break
            count += 1
        return count
    replace(stm.FullAttentionManager, "get_num_common_prefix_blocks", get_num_common_prefix_blocks)


def max_model_len_ignored() -> None:
    """allocate_slots gives lookahead slots beyond max_model_len."""
    original = kvm.KVCacheManager.allocate_slots

    def allocate_slots(self: kvm.KVCacheManager, *args: Any, **kwargs: Any) -> Any:
        saved = self.max_model_len
        self.max_model_len = 10**9
        try:
            return original(self, *args, **kwargs)
        finally:
            self.max_model_len = saved
    replace(kvm.KVCacheManager, "allocate_slots", allocate_slots)


class _SkippedKeptOnRefusal:
    """A coordinator seen through ``allocate_slots``: stage 1 (``remove_skipped_blocks``) is
    put off until stage 3 or 4 runs, so a call that returns None never frees anything."""

    def __init__(self, coordinator: Any) -> None:
        self.coordinator = coordinator
        self.pending: tuple[str, int] | None = None

    def remove_skipped_blocks_unchecked(self, request_id: str, num_computed_tokens: int
                                        ) -> None:
        self.pending = (request_id, num_computed_tokens)

    def __getattr__(self, name: str) -> Any:
        stage_3_or_4 = ("save_new_computed_blocks_unchecked", "allocate_new_blocks_unchecked")
        if name in stage_3_or_4 and self.pending is not None:
            self.coordinator.remove_skipped_blocks_unchecked(*self.pending)
            self.pending = None
        return getattr(self.coordinator, name)


def skipped_blocks_kept_on_refusal() -> None:
    """allocate_slots, short of free blocks, returns None without freeing the request's
    blocks that left the window (kvspec's order before D7 was decided; vLLM 0.13 and 0.33
    free them first): the free queue's order, and later block ids, part from vLLM's."""
    original = kvm.KVCacheManager.allocate_slots

    def allocate_slots(self: kvm.KVCacheManager, *args: Any, **kwargs: Any) -> Any:
        coordinator = self.coordinator
        self.coordinator = _SkippedKeptOnRefusal(coordinator)  # type: ignore[assignment]
        try:
            return original(self, *args, **kwargs)
        finally:
            self.coordinator = coordinator
    replace(kvm.KVCacheManager, "allocate_slots", allocate_slots)


def eagle_block_kept() -> None:
    """With EAGLE, the full-attention lookup keeps the last hit block (whose hidden state the
    drafter needs recomputed)."""
    original = stm._trim_full_hit

    def trim(num_blocks: int, block_size: int, alignment_tokens: int, use_eagle: bool) -> int:
        return original(num_blocks, block_size, alignment_tokens, False)
    replace(stm, "_trim_full_hit", trim)


def request_hash_ignores_salt() -> None:
    """The request block hasher leaves the cache salt out of block 0's extra keys: requests
    of different tenants share their first blocks (and every block after them)."""
    original = hashing._key_sources

    def key_sources(request: Any, tagged: bool) -> Any:
        sources = original(request, tagged)
        if sources is None:
            return None
        lora_key, features, _, embeds = sources
        if lora_key is None and not features and embeds is None:
            return None
        return lora_key, features, None, embeds
    replace(hashing, "_key_sources", key_sources)


def _mutant(name: str, plant: Any, *extra: str, killed_by: str = "",
            machine_first: bool = False) -> Mutant:
    description = " ".join((plant.__doc__ or "").split())
    checker = (MACHINE, EXAMPLES) if machine_first else (EXAMPLES, MACHINE)
    return Mutant(name, description, plant, (*checker, *extra), killed_by)


MUTANTS: list[Mutant] = [
    _mutant("manager_hit_without_cap", hit_without_cap),
    _mutant("manager_touch_before_capacity_check", touch_before_capacity_check),
    _mutant("manager_sliding_window_skip_off_by_one", sliding_window_skip_off_by_one),
    _mutant("manager_hybrid_single_pass", hybrid_single_pass),
    _mutant("manager_lookahead_tokens_cached", lookahead_tokens_cached),
    _mutant("manager_free_forward_order", free_forward_order),
    _mutant("manager_evictable_hits_cost_nothing", evictable_hits_cost_nothing),
    _mutant("manager_chunked_local_without_null_padding", chunked_local_without_null_padding),
    _mutant("manager_mamba_first_hit", mamba_first_hit),
    _mutant("manager_sliding_window_run_not_reset", sliding_window_run_not_reset),
    _mutant("manager_common_prefix_counts_shared_blocks", common_prefix_counts_shared_blocks),
    _mutant("manager_max_model_len_ignored", max_model_len_ignored),
    _mutant("manager_skipped_blocks_kept_on_refusal", skipped_blocks_kept_on_refusal,
            killed_by="refusal_frees_only_skipped_blocks"),
    _mutant("manager_eagle_block_kept", eagle_block_kept),
    # The machine first: the examples' file's isolation tests catch it too, by their names.
    _mutant("manager_request_hash_ignores_salt", request_hash_ignores_salt,
            killed_by="block_hashes_match_spec", machine_first=True),
]
