"""Mutants of issue 19's attention-type layer and of the pool's read-only map.

The first two are bugs the coordinators above the single-type managers mask, so only the
attention layer (conformance/attention_manager_machine.py), which calls the managers'
public methods directly, kills them. The third opens the pool's own prefix-cache map to
edits from outside again; the hostile test of the read-only map kills it. The last one is
planted into vLLM 0.33's own SlidingWindowManager (in a Python with vLLM 0.33; elsewhere it
plants nothing): the attention layer's 0.33 run, which the checker starts under
.venv-vllm-0.33.0's Python with the mutant named in its environment, kills it.
"""

from __future__ import annotations

from typing import Any

from kvspec.impl import block_pool as bp, single_type_kv_cache_manager as stm
from kvspec.impl.kv_cache_interface import as_kv_cache_spec
from kvspec.impl.kv_cache_utils import KVCacheBlock
from tests.mutants import Mutant, replace, vllm_033_modules

ATTENTION = "tests/test_attention_manager_machine.py::TestImplAttentionManagersConformToSpec"
READ_ONLY = "tests/hostile/test_pool_map_read_only.py"
ATTENTION_033 = "tests/test_attention_manager_machine.py::test_attention_layer_on_vllm_033"


def full_hit_cuts_only_the_first_group() -> None:
    """FullAttentionManager.find_longest_cache_hit over several group ids cuts only the first
    group's list to the common length (kv_cache_group_ids=[0, 1]: [[1], [3, 4]], where the
    spec gives [[1], [3]]). The coordinators never look at the other lists' lengths."""
    def find(cls: Any, block_hashes: Any, max_length: int, kv_cache_group_ids: list[int],
             block_pool: Any, kv_cache_spec: Any, use_eagle: bool, alignment_tokens: int,
             dcp_world_size: int = 1, pcp_world_size: int = 1) -> tuple[list[KVCacheBlock], ...]:
        block_size = as_kv_cache_spec(kv_cache_spec).block_size
        max_blocks = max(min(max_length // block_size, len(block_hashes)), 0)
        hits = [block_pool.get_cached_prefix(block_hashes, group_id, max_blocks)
                for group_id in kv_cache_group_ids]
        num_blocks = min(map(len, hits))
        if use_eagle and num_blocks > 0:
            num_blocks -= 1
        while num_blocks * block_size % alignment_tokens:
            num_blocks -= 1
        del hits[0][num_blocks:]
        return tuple(hits)
    replace(stm.FullAttentionManager, "find_longest_cache_hit_unchecked", classmethod(find))


def skip_loop_passes_null_blocks() -> None:
    """The sliding-window skip loop does not stop at the first null block:
    skipped_blocks_to_free("a", 11) returns [3, 2, 1, 0] instead of [3] once blocks 0-2 are
    already null (remove_skipped_blocks then frees the null block, which the pool ignores)."""
    def skipped(self: Any, request_id: str, num_computed_tokens: int) -> list[int]:
        if not self.skips_blocks:
            return []
        num_skipped = self._num_skipped_tokens(num_computed_tokens)
        blocks = self.req_to_blocks.get(request_id)
        if num_skipped <= 0 or not blocks:
            return []
        return list(range(min(num_skipped // self.block_size, len(blocks)) - 1, -1, -1))
    replace(stm.SingleTypeKVCacheManager, "_skipped_blocks_to_free", skipped)


def pool_map_accepts_foreign_edits() -> None:
    """BlockPool.cached_block_hash_to_block accepts insert, pop and clear from outside (the
    pool's own map no longer refuses), so a foreign pop makes the next get_new_blocks raise
    a bare KeyError."""
    replace(bp.BlockHashToBlockMap, "_refuse_for_pool", lambda self, operation: None)


def vllm_033_window_skips_one_token_too_many() -> None:
    """vLLM 0.33's SlidingWindowManager.get_num_skipped_tokens is off by one (n - w + 2):
    remove_skipped_blocks frees the block that holds the window's first token while the
    request still attends to it (sliding_window=4, block_size=2: after 4 computed tokens
    block 0, holding token 1 of the next token's window 1-4, is freed)."""
    modules = vllm_033_modules("v1.core.single_type_kv_cache_manager")
    if modules is None:
        return
    (vllm_stm,) = modules

    def skipped(self: Any, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - int(self.sliding_window) + 2
                   - int(self.extra_retained_tokens))
    replace(vllm_stm.SlidingWindowManager, "get_num_skipped_tokens", skipped)


def vllm_033_hit_length_counts_the_eagle_block() -> None:
    """vLLM 0.33's FullAttentionManager.find_longest_cache_hit reports the hit length from
    before EAGLE's dropped block (or any trim): its blocks and its length disagree."""
    modules = vllm_033_modules("v1.core.single_type_kv_cache_manager")
    if modules is None:
        return
    (vllm_stm,) = modules
    original = vllm_stm.FullAttentionManager.find_longest_cache_hit.__func__

    def find_longest_cache_hit(cls: Any, *args: Any, **kwargs: Any) -> Any:
        blocks, hit_length = original(cls, *args, **kwargs)
        if blocks and blocks[0]:
            hit_length += kwargs.get("alignment_tokens", 0)
        return blocks, hit_length
    replace(vllm_stm.FullAttentionManager, "find_longest_cache_hit",
            classmethod(find_longest_cache_hit))


MUTANTS: list[Mutant] = [
    Mutant("attention_full_hit_cuts_only_the_first_group",
           " ".join((full_hit_cuts_only_the_first_group.__doc__ or "").split()),
           full_hit_cuts_only_the_first_group, (ATTENTION,), "find_longest_cache_hit"),
    Mutant("attention_skip_loop_passes_null_blocks",
           " ".join((skip_loop_passes_null_blocks.__doc__ or "").split()),
           skip_loop_passes_null_blocks, (ATTENTION,), "skipped_blocks_to_free"),
    Mutant("pool_map_accepts_foreign_edits",
           " ".join((pool_map_accepts_foreign_edits.__doc__ or "").split()),
           pool_map_accepts_foreign_edits, (READ_ONLY,), "BlockOwnershipError"),
    Mutant("attention_vllm_033_window_skips_one_token_too_many",
           " ".join((vllm_033_window_skips_one_token_too_many.__doc__ or "").split()),
           vllm_033_window_skips_one_token_too_many, (ATTENTION_033,), "_matches_spec"),
    Mutant("attention_vllm_033_hit_length_counts_the_eagle_block",
           " ".join((vllm_033_hit_length_counts_the_eagle_block.__doc__ or "").split()),
           vllm_033_hit_length_counts_the_eagle_block, (ATTENTION_033,),
           "hit_length_matches_blocks"),
]
