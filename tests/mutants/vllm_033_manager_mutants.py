"""vLLM 0.33 manager mutants: bugs planted into vLLM 0.33's own KVCacheManager, coordinators
and single-type managers.

The checks of the vLLM 0.33 manager layer (the manager machine under ``Profile.V0_33``: the
lookup's shared prefix boundary, a hybrid's caching rounded to the scheduler block, full
attention's partial entry at the prompt boundary, Mamba in align mode) are scored on vLLM
0.33's real classes with one realistic bug each. The checker,
tests/test_manager033_machine.py, runs under .venv-vllm-0.33.0's Python, which plants the
mutant there (the environment carries ``KVSPEC_MUTANT``); in an interpreter without vLLM 0.33
planting does nothing (the checker then reruns itself under the 0.33 environment, or is
skipped where it has not been built, and the mutant survives).

The machine finds each of them; two have a pinned example in the checker as well, which
kills them on its own (``-k`` it): the partial tail entry
(``test_full_attention_keys_the_prompt_tail_once_the_scheduler_block_is_cached``) and the
same-step rule (``test_a_mamba_hit_cached_this_step_waits_for_the_next_step``). The machine
judges rule no_same_step_mamba_hit on the target's output before comparing it with the
spec's (``ManagerMachine.judge``), so a target that breaks it is reported by the rule's name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tests.mutants import Mutant, replace, vllm_033_modules

MACHINE = ("tests/test_manager033_machine.py",)


def _planted(plant: Callable[[Any, Any, Any], None]) -> Callable[[], None]:
    def run() -> None:
        modules = vllm_033_modules("v1.core.kv_cache_manager", "v1.core.kv_cache_coordinator",
                                   "v1.core.single_type_kv_cache_manager")
        if modules is not None:
            plant(*modules)
    run.__name__ = plant.__name__
    run.__doc__ = plant.__doc__
    return run


@_planted
def shared_prefix_boundary_dropped(kvm: Any, coord: Any, stm: Any) -> None:
    """get_computed_blocks reports no shared prefix boundary (0.13's pair padded with 0):
    the junction of a prefix a lagging group has not cached is never pinned."""
    original = kvm.KVCacheManager.get_computed_blocks

    def get_computed_blocks(self: Any, request: Any, max_cache_hit_length: int | None = None
                            ) -> Any:
        blocks, num_tokens, _ = original(self, request, max_cache_hit_length)
        return blocks, num_tokens, 0
    replace(kvm.KVCacheManager, "get_computed_blocks", get_computed_blocks)


@_planted
def shared_prefix_boundary_one_block_short(kvm: Any, coord: Any, stm: Any) -> None:
    """get_computed_blocks reports the shared prefix boundary one scheduler block short
    (the end of the longest hit's last block taken as exclusive)."""
    original = kvm.KVCacheManager.get_computed_blocks

    def get_computed_blocks(self: Any, request: Any, max_cache_hit_length: int | None = None
                            ) -> Any:
        blocks, num_tokens, boundary = original(self, request, max_cache_hit_length)
        if boundary:
            boundary -= self.coordinator.scheduler_block_size
        return blocks, num_tokens, boundary
    replace(kvm.KVCacheManager, "get_computed_blocks", get_computed_blocks)


@_planted
def hybrid_caching_not_rounded(kvm: Any, coord: Any, stm: Any) -> None:
    """The hybrid coordinator caches every group up to the computed tokens, not rounded
    down to the scheduler block: a group with smaller blocks keys blocks no hit can reach."""
    def get_num_cacheable_tokens(self: Any, num_computed_tokens: int,
                                 kv_cache_group_id: int) -> int:
        return num_computed_tokens
    replace(coord.HybridKVCacheCoordinator, "get_num_cacheable_tokens",
            get_num_cacheable_tokens)


@_planted
def full_partial_tail_skipped(kvm: Any, coord: Any, stm: Any) -> None:
    """Full attention never keys its block at the prompt's last hash boundary (the partial
    entry): a resend of the prompt recomputes the tail of its last whole hash block."""
    def cache_partial_tail_block(self: Any, request: Any, num_tokens: int) -> None:
        return None
    replace(stm.FullAttentionManager, "_cache_partial_tail_block", cache_partial_tail_block)


@_planted
def mamba_same_step_rule_gone(kvm: Any, coord: Any, stm: Any) -> None:
    """Mamba's get_num_blocks_to_allocate forgets the keys cached this step: a request takes
    a Mamba hit whose state the running step has not written yet."""
    original = stm.MambaManager.get_num_blocks_to_allocate

    def get_num_blocks_to_allocate(self: Any, *args: Any, **kwargs: Any) -> int:
        cached, self.cached_blocks_this_step = self.cached_blocks_this_step, set()
        try:
            return int(original(self, *args, **kwargs))
        finally:
            self.cached_blocks_this_step = cached
    replace(stm.MambaManager, "get_num_blocks_to_allocate", get_num_blocks_to_allocate)


@_planted
def mamba_new_step_keeps_same_step_keys(kvm: Any, coord: Any, stm: Any) -> None:
    """MambaManager.new_step_starts does not clear the keys cached this step: a hit on them
    is refused in every later step too."""
    def new_step_starts(self: Any) -> None:
        return None
    replace(stm.MambaManager, "new_step_starts", new_step_starts)


def _skip_walk_stops_at_null(stm: Any) -> None:
    """Mamba align's skip walk (from the newest skipped block down) stops at the first null
    block instead of passing it."""
    original = stm.MambaManager._remove_blocks_in_range

    def remove_blocks_in_range(self: Any, request_id: str, first_block: int,
                               last_block: int) -> None:
        if self.mamba_cache_mode != "align":
            original(self, request_id, first_block, last_block)
            return
        blocks = self.req_to_blocks.get(request_id, [])
        start = max(first_block, self._num_retired_blocks.get(request_id, 0))
        end = min(last_block, len(blocks))
        if start >= end:
            return
        stop = next((i + 1 for i in range(end - 1, start - 1, -1) if blocks[i].is_null), start)
        original(self, request_id, stop, last_block)
        self._num_retired_blocks[request_id] = end
    replace(stm.MambaManager, "_remove_blocks_in_range", remove_blocks_in_range)


def _last_state_never_recorded(stm: Any) -> None:
    """Mamba align's allocate_new_blocks never records the last state block."""
    original = stm.MambaManager.allocate_new_blocks

    def allocate_new_blocks(self: Any, request_id: str, num_tokens: int,
                            num_tokens_main_model: int) -> Any:
        had = request_id in self.last_state_block_idx
        before = self.last_state_block_idx.get(request_id)
        try:
            return original(self, request_id, num_tokens, num_tokens_main_model)
        finally:
            if had:
                self.last_state_block_idx[request_id] = before
            else:
                self.last_state_block_idx.pop(request_id, None)
    replace(stm.MambaManager, "allocate_new_blocks", allocate_new_blocks)


@_planted
def mamba_states_below_a_null_gap_kept(kvm: Any, coord: Any, stm: Any) -> None:
    """Mamba align never frees the state below a prefill's null gap: the skip walk stops at
    the first null block, and allocate_new_blocks records no last state block. A request
    holds three states and more."""
    # Each half alone is an equivalent mutant at the manager layer: the walk over
    # [retired, (computed - 1) // block_size) and the last-state free (last_state <
    # cdiv(computed, block_size) - 1) cover the same block, the one below the null gap.
    _skip_walk_stops_at_null(stm)
    _last_state_never_recorded(stm)


@_planted
def mamba_padding_takes_extra_block(kvm: Any, coord: Any, stm: Any) -> None:
    """Mamba align's allocate_new_blocks takes one block too many when it pads with null
    blocks (the state block counted once in the padding's end and once after it)."""
    original = stm.MambaManager.allocate_new_blocks

    def allocate_new_blocks(self: Any, request_id: str, num_tokens: int,
                            num_tokens_main_model: int) -> Any:
        blocks = list(original(self, request_id, num_tokens, num_tokens_main_model))
        if self.mamba_cache_mode == "align" and any(b.is_null for b in blocks):
            extra = self.block_pool.get_new_blocks(1)
            self.req_to_blocks[request_id].extend(extra)
            blocks.extend(extra)
        return blocks
    replace(stm.MambaManager, "allocate_new_blocks", allocate_new_blocks)


@_planted
def deferred_free_keeps_group_order(kvm: Any, coord: Any, stm: Any) -> None:
    """pop_blocks_for_free hands the groups back last group first, so the scheduler's
    reversed drain releases them in `free`'s order (B14 "fixed" on one path only): the
    free order, and so the next eviction, differs from 0.33's."""
    def pop_blocks_for_free(self: Any, request_id: str) -> list[Any]:
        per_group = [manager.pop_blocks_for_free(request_id)
                     for manager in self.single_type_managers]
        return [block for blocks in reversed(per_group) for block in blocks]
    replace(coord.KVCacheCoordinator, "pop_blocks_for_free", pop_blocks_for_free)


@_planted
def mamba_table_drops_its_padding(kvm: Any, coord: Any, stm: Any) -> None:
    """Align-mode Mamba keeps only its real blocks in the request's list (the null padding
    dropped to save memory): the recorded state index points past the list, and the
    worker's block table loses the positions of the states. (vLLM then fails with an
    IndexError in a later allocate_slots, which the lockstep comparison reports.)"""
    original = stm.MambaManager.allocate_new_blocks

    def allocate_new_blocks(self: Any, request_id: str, num_tokens: int,
                            num_tokens_main_model: int) -> Any:
        blocks = original(self, request_id, num_tokens, num_tokens_main_model)
        if self.mamba_cache_mode == "align":
            table = self.req_to_blocks[request_id]
            table[:] = [b for b in table if not b.is_null]
        return blocks
    replace(stm.MambaManager, "allocate_new_blocks", allocate_new_blocks)


@_planted
def cascade_prefix_counted_again(kvm: Any, coord: Any, stm: Any) -> None:
    """get_num_common_prefix_blocks counts a request's blocks again (an out-of-tree
    scheduler then turns cascade attention on, which 0.33 no longer has)."""
    def get_num_common_prefix_blocks(self: Any, running_request_id: str) -> list[int]:
        return [len(ids) for ids in self.get_block_ids(running_request_id)]
    replace(kvm.KVCacheManager, "get_num_common_prefix_blocks", get_num_common_prefix_blocks)


def coarse_hashes_concatenated() -> None:
    """A block of several hash blocks is keyed with the concatenation of their hashes
    (0.13's BlockHashListWithBlockSize) instead of the hash at its end: its key is not the
    one a partial entry or a finer group computes for the same prefix."""
    modules = vllm_033_modules("v1.core.kv_cache_utils")
    if modules is None:
        return
    (kv_cache_utils,) = modules

    def get_value_at(self: Any, idx: int) -> bytes:
        scale = self.scale_factor
        return b"".join(self.block_hashes[idx * scale:(idx + 1) * scale])
    replace(kv_cache_utils.BlockHashListWithBlockSize, "_get_value_at", get_value_at)


def _mutant(name: str, plant: Callable[[], None], killed_by: str) -> Mutant:
    description = "0.33: " + " ".join((plant.__doc__ or "").split())
    return Mutant(name, description, plant, MACHINE, killed_by=killed_by)


MUTANTS: list[Mutant] = [
    _mutant("v033_shared_prefix_boundary_dropped", shared_prefix_boundary_dropped,
            "GetComputedBlocks"),
    _mutant("v033_shared_prefix_boundary_one_block_short",
            shared_prefix_boundary_one_block_short, "GetComputedBlocks"),
    _mutant("v033_hybrid_caching_not_rounded", hybrid_caching_not_rounded,
            "num_cached: target"),
    _mutant("v033_full_partial_tail_skipped", full_partial_tail_skipped,
            "event_stream_holds_every_copy"),
    _mutant("v033_mamba_same_step_rule_gone", mamba_same_step_rule_gone,
            "no_same_step_mamba_hit"),
    _mutant("v033_mamba_new_step_keeps_same_step_keys", mamba_new_step_keeps_same_step_keys,
            "AllocateSlots"),
    _mutant("v033_mamba_states_below_a_null_gap_kept", mamba_states_below_a_null_gap_kept,
            "mamba_holds_at_most_two_states"),
    _mutant("v033_mamba_padding_takes_extra_block", mamba_padding_takes_extra_block,
            "AllocateSlots"),
    _mutant("v033_mamba_table_drops_its_padding", mamba_table_drops_its_padding,
            "AllocateSlots"),
    _mutant("v033_cascade_prefix_counted_again", cascade_prefix_counted_again,
            "GetNumCommonPrefixBlocks"),
    _mutant("v033_coarse_hashes_concatenated", coarse_hashes_concatenated,
            "request_blocks_match_hashes"),
    _mutant("v033_deferred_free_keeps_group_order", deferred_free_keeps_group_order,
            "PopBlocksForFree"),
]
