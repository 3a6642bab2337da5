"""vLLM's ``vllm.v1.core.kv_cache_utils`` names: blocks, the free-block queue, prefix hashing
and KV-cache planning, each re-exported from the module that defines it.

The classes live in impl/kv_cache_blocks.py (compiled), hashing in impl/hashing.py and planning in
impl/kv_cache_planning.py. This module defines no class and is not compiled, on purpose: vLLM's
own tests ``importlib.reload`` it (``test_none_hash``). A reload re-executes this source in the
same module object, in both builds alike, and re-imports the very same class and function
objects, so blocks, queues and pools made before a reload keep working with the names read
after it. The one value of its own, ``NONE_HASH``, is re-read from impl/hashing.py.
"""

from __future__ import annotations

from kvspec.impl import hashing as _hashing
from kvspec.impl.errors import (
    BlockNotFreeError as BlockNotFreeError,
    BlockOwnershipError as BlockOwnershipError,
    InvalidBlockFieldError as InvalidBlockFieldError,
    InvalidFreeQueueArgument as InvalidFreeQueueArgument,
    NoFreeBlocksError as NoFreeBlocksError,
)
from kvspec.impl.hashing import (
    BlockHash,
    BlockHashListWithBlockSize,
    BlockHashWithGroupId,
    ExternalBlockHash,
    generate_block_hash_extra_keys,
    get_block_hash,
    get_group_id,
    get_hash_fn_by_name,
    get_request_block_hasher,
    hash_block_tokens,
    init_none_hash,
    make_block_hash_with_group_id,
    maybe_convert_block_hash,
    need_extra_keys,
    tensor_data,
)
from kvspec.impl.kv_cache_blocks import (
    BlockOwner as BlockOwner,
    FreeKVCacheBlockQueue as FreeKVCacheBlockQueue,
    KVCacheBlock as KVCacheBlock,
)

# vLLM 0.13's planning functions (and the private ones its tests call), kept in a module that
# is not compiled: they run once at start-up on the caller's objects.
from kvspec.impl.kv_cache_planning import (
    check_enough_kv_cache_memory,
    create_kv_cache_group_specs,
    estimate_max_model_len,
    generate_scheduler_kv_cache_config,
    get_kv_cache_config_from_groups,
    get_kv_cache_configs,
    get_kv_cache_groups,
    get_kv_cache_groups_uniform_page_size as _get_kv_cache_groups_uniform_page_size,  # noqa: F401
    get_kv_cache_groups_uniform_spec as _get_kv_cache_groups_uniform_spec,  # noqa: F401
    get_kv_cache_groups_uniform_type as _get_kv_cache_groups_uniform_type,  # noqa: F401
    get_max_concurrency_for_kv_cache_config,
    get_num_blocks,
    get_uniform_page_size,
    is_kv_cache_page_size_uniform,
    is_kv_cache_spec_uniform,
    is_kv_cache_type_attention_free,
    max_memory_usage_bytes,
    may_override_num_blocks,
    report_kv_cache_config as _report_kv_cache_config,  # noqa: F401
    unify_hybrid_kv_cache_specs,
    unify_kv_cache_spec_page_size,
)

BlockHashList = list[BlockHash] | BlockHashListWithBlockSize

__all__ = [
    "NONE_HASH",
    "BlockHash",
    "BlockHashList",
    "BlockHashListWithBlockSize",
    "BlockHashWithGroupId",
    "BlockNotFreeError",
    "BlockOwner",
    "ExternalBlockHash",
    "FreeKVCacheBlockQueue",
    "InvalidFreeQueueArgument",
    "KVCacheBlock",
    "NoFreeBlocksError",
    "check_enough_kv_cache_memory",
    "create_kv_cache_group_specs",
    "estimate_max_model_len",
    "generate_block_hash_extra_keys",
    "generate_scheduler_kv_cache_config",
    "get_block_hash",
    "get_group_id",
    "get_hash_fn_by_name",
    "get_kv_cache_config_from_groups",
    "get_kv_cache_configs",
    "get_kv_cache_groups",
    "get_max_concurrency_for_kv_cache_config",
    "get_num_blocks",
    "get_request_block_hasher",
    "get_uniform_page_size",
    "hash_block_tokens",
    "init_none_hash",
    "is_kv_cache_page_size_uniform",
    "is_kv_cache_spec_uniform",
    "is_kv_cache_type_attention_free",
    "make_block_hash_with_group_id",
    "max_memory_usage_bytes",
    "may_override_num_blocks",
    "maybe_convert_block_hash",
    "need_extra_keys",
    "tensor_data",
    "unify_hybrid_kv_cache_specs",
    "unify_kv_cache_spec_page_size",
]


# Rebound by init_none_hash (impl/hashing.py), which keeps this copy current.
NONE_HASH: BlockHash = _hashing.NONE_HASH


