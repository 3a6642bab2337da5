"""Stand-ins for vLLM 0.13's ``vllm.v1.kv_cache_interface`` classes: the same class names and
fields, defined here and not vLLM's, so that impl must recognise them by what they are (their
class's name and fields), in the compiled build as in the pure one. Used by
tests/test_kv_cache_interface.py (a spec or config converted) and tests/test_vllm_compat.py (the
managers built from them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

BLOCK_SIZE = 4


@dataclass(frozen=True)
class FullAttentionSpec:
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: Any
    sliding_window: int | None = None
    attention_chunk_size: int | None = None


@dataclass(frozen=True)
class SlidingWindowSpec:
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: Any
    sliding_window: int


@dataclass(frozen=True)
class EncoderOnlyAttentionSpec:
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: Any


@dataclass
class KVCacheGroupSpec:
    layer_names: list[str]
    kv_cache_spec: Any


@dataclass
class KVCacheConfig:
    num_blocks: int
    kv_cache_tensors: list[Any]
    kv_cache_groups: list[KVCacheGroupSpec] = field(default_factory=list)


def full_attention(block_size: int = BLOCK_SIZE) -> FullAttentionSpec:
    return FullAttentionSpec(block_size, 2, 8, "float16")


def config_of(*specs: Any, num_blocks: int = 12) -> KVCacheConfig:
    """A config of one group per spec, each of one layer."""
    return KVCacheConfig(num_blocks, [], [KVCacheGroupSpec([f"layer{i}"], spec)
                                          for i, spec in enumerate(specs)])
