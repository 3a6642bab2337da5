"""KV-cache specs and configs (impl/kv_cache_interface.py): a spec's fields are checked when it
is made, ``UniformTypeKVCacheSpecs``' rule, and foreign specs and configs (vLLM's, or classes of
vLLM's names and fields: tests/vllm_standins.py) converted to impl's by kind and fields. What
the specs give planning (page sizes, memory per request): tests/test_kv_cache_planning.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvspec.impl.kv_cache_interface import (
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    InvalidKVCacheSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
    UnsupportedKVCacheSpecType,
    as_kv_cache_config,
    as_kv_cache_spec,
)
from tests.vllm_standins import BLOCK_SIZE, config_of, full_attention


def full(block_size: int = 16, head_size: int = 64, **kwargs: Any) -> FullAttentionSpec:
    return FullAttentionSpec(block_size, 2, head_size, "float32", **kwargs)


def sliding(block_size: int = 16, head_size: int = 64, window: int = 1) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size, 2, head_size, "float32", sliding_window=window)


@pytest.mark.parametrize("field, value", [("block_size", 0), ("num_kv_heads", -1),
                                          ("head_size", 2.5), ("dtype", "float13")])
def test_spec_fields_are_checked(field: str, value: Any) -> None:
    kwargs: dict[str, Any] = {"block_size": 4, "num_kv_heads": 1, "head_size": 8,
                              "dtype": "float16", field: value}
    with pytest.raises(InvalidKVCacheSpec, match=str(value)):
        FullAttentionSpec(**kwargs)


def test_uniform_type_rule() -> None:
    assert UniformTypeKVCacheSpecs.from_specs({"a": full(), "b": full(head_size=128)}) == (
        UniformTypeKVCacheSpecs(16, {"a": full(), "b": full(head_size=128)})
    )
    assert UniformTypeKVCacheSpecs.from_specs({"a": full(), "b": sliding()}) is None
    assert UniformTypeKVCacheSpecs.from_specs({"a": sliding(), "b": full()}) is None
    assert UniformTypeKVCacheSpecs.from_specs({"a": full(16), "b": full(32)}) is None
    assert UniformTypeKVCacheSpecs.is_uniform_type({"a": sliding(window=4),
                                                    "b": sliding(head_size=32, window=4)})
    with pytest.raises(UnsupportedKVCacheSpecType) as info:
        UniformTypeKVCacheSpecs.is_uniform_type({"a": EncoderOnlyAttentionSpec(16, 1, 8, "fp16")})
    assert isinstance(info.value, NotImplementedError)
    with pytest.raises(InvalidKVCacheSpec, match="other block sizes"):
        UniformTypeKVCacheSpecs(16, {"a": full(32)})


# --- foreign specs and configs --------------------------------------------------------------


def test_foreign_spec_converts_by_kind_and_fields() -> None:
    converted = as_kv_cache_spec(full_attention())
    assert converted == FullAttentionSpec(BLOCK_SIZE, 2, 8, "float16")
    assert as_kv_cache_spec(full_attention()) is converted  # remembered


def test_foreign_config_converts() -> None:
    config = as_kv_cache_config(config_of(full_attention()))
    assert config.num_blocks == 12
    assert config.kv_cache_groups[0].kv_cache_spec == as_kv_cache_spec(full_attention())
