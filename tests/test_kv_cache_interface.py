"""impl/kv_cache_interface.py: the KV-cache specs and configs the manager stack is built from.

A spec's fields are checked when it is made (``InvalidKVCacheSpec`` naming the value);
tests/hostile/test_manager.py throws every kind of bad value at every spec and config class
and at the converters of vLLM's own objects.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvspec.impl.kv_cache_interface import FullAttentionSpec, InvalidKVCacheSpec


@pytest.mark.parametrize("field, value", [("block_size", 0), ("num_kv_heads", -1),
                                          ("head_size", 2.5), ("dtype", "float13")])
def test_spec_fields_are_checked(field: str, value: Any) -> None:
    kwargs: dict[str, Any] = {"block_size": 4, "num_kv_heads": 1, "head_size": 8,
                              "dtype": "float16", field: value}
    with pytest.raises(InvalidKVCacheSpec, match=str(value)):
        FullAttentionSpec(**kwargs)
