"""From a layout to impl's ``KVCacheConfig`` (vLLM 0.13's ``kv_cache_interface`` objects).

``to_kv_cache_config`` builds the config from ``models.plan``'s groups; ``to_kv_cache_specs``
gives each layer's spec instead, the input of vLLM's own planning functions
(``kvspec.impl.kv_cache_planning.get_kv_cache_configs``), which arrive at the same config.
"""

from __future__ import annotations

from kvspec.impl.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from kvspec.models.layout import ModelLayout
from kvspec.models.plan import (
    GroupPlan,
    GroupSpec,
    InvalidPlanArgument,
    kv_cache_groups,
    layer_specs,
    num_blocks_for_memory,
)

__all__ = ["to_kv_cache_config", "to_kv_cache_spec", "to_kv_cache_specs"]


def to_kv_cache_spec(spec: GroupSpec) -> KVCacheSpec:
    """impl's spec object for a group spec (same page size)."""
    bs, heads, head, dtype = spec.block_size, spec.num_kv_heads, spec.head_size, spec.dtype
    result: KVCacheSpec
    if spec.kind == "full":
        result = FullAttentionSpec(bs, heads, head, dtype)
    elif spec.kind == "mla":
        result = MLAAttentionSpec(bs, heads, head, dtype)
    elif spec.kind == "sliding_window" and spec.sliding_window is not None:
        result = SlidingWindowSpec(bs, heads, head, dtype, sliding_window=spec.sliding_window)
    elif spec.kind == "chunked_local" and spec.attention_chunk_size is not None:
        result = ChunkedLocalAttentionSpec(
            bs, heads, head, dtype, attention_chunk_size=spec.attention_chunk_size
        )
    elif spec.kind == "cross_attention":
        result = CrossAttentionSpec(bs, heads, head, dtype)
    elif spec.kind == "mamba":
        result = MambaSpec(
            bs,
            shapes=spec.mamba_shapes,
            dtypes=spec.mamba_dtypes,
            page_size_padded=spec.page_size_padded,
            mamba_type=spec.mamba_type or "mamba2",
        )
    else:
        raise InvalidPlanArgument(f"no impl spec for a {spec.kind!r} group: {spec!r}")
    if result.page_size_bytes != spec.page_size_bytes:
        # The two page-size formulas disagree: a bug on one side, not bad input.
        raise RuntimeError(
            f"page size mismatch for {spec!r}: models says {spec.page_size_bytes}, "
            f"impl says {result.page_size_bytes}"
        )
    return result


def to_kv_cache_specs(
    layout: ModelLayout, block_size: int = 16, *, mamba_block_size: int | None = None
) -> dict[str, KVCacheSpec]:
    """Each layer's impl spec, by layer name in layer order, as vLLM 0.13's model runner
    reports them (``get_kv_cache_spec``) once attention and Mamba pages are aligned."""
    specs, _ = layer_specs(layout, block_size, mamba_block_size=mamba_block_size)
    return {name: to_kv_cache_spec(spec) for name, spec in specs}


def _config_from_groups(groups: GroupPlan, num_blocks: int) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=tuple(
            KVCacheTensor(size=size, shared_by=shared_by)
            for size, shared_by in groups.kv_cache_tensors(num_blocks)
        ),
        kv_cache_groups=tuple(
            KVCacheGroupSpec(group.layer_names, to_kv_cache_spec(group.spec))
            for group in groups.groups
        ),
    )


def to_kv_cache_config(
    layout: ModelLayout,
    memory_bytes: int | None = None,
    num_blocks: int | None = None,
    block_size: int = 16,
    *,
    mamba_block_size: int | None = None,
) -> KVCacheConfig:
    """The ``KVCacheConfig`` vLLM 0.13 would build for ``layout``, sized by ``memory_bytes``
    (``num_blocks = memory // bytes per block``) or by ``num_blocks`` directly (give exactly one).

    ``num_blocks`` counts the null block, so it must be at least 1. Hybrid attention/Mamba
    layouts may get a larger attention block size than ``block_size`` (see ``models.plan``).
    """
    if (memory_bytes is None) == (num_blocks is None):
        raise InvalidPlanArgument(
            f"give exactly one of memory_bytes ({memory_bytes!r}) and num_blocks ({num_blocks!r})"
        )
    groups = kv_cache_groups(layout, block_size, mamba_block_size=mamba_block_size)
    if memory_bytes is not None:
        blocks = num_blocks_for_memory(groups, memory_bytes)
        if blocks < 1:
            raise InvalidPlanArgument(
                f"memory_bytes={memory_bytes} holds no block of {layout.name} "
                f"({groups.bytes_per_block} bytes per block)"
            )
    else:
        if type(num_blocks) is not int or num_blocks < 1:
            raise InvalidPlanArgument(f"num_blocks must be an int >= 1, got {num_blocks!r}")
        blocks = num_blocks
    return _config_from_groups(groups, blocks)
