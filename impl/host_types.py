"""The classes impl builds for its callers, in one place: KV-cache events and cache stats.

By default they are impl's own (``kvspec.impl.kv_events``, ``kvspec.impl.stats``).
Inside vLLM (``kvspec.vllm_plugin``) ``bind_vllm`` binds them to vLLM's,
so that vLLM's code, its tests and its event consumers get objects of vLLM's own types:
``isinstance(event, vllm.distributed.kv_events.BlockStored)`` holds, and a ``KVEventBatch``
of them is vLLM's. impl's own event classes encode to the same bytes (``kv_events``), so
either way the wire format is vLLM's.

impl's modules look these names up when they build an object (``host_types.BlockStored(...)``),
never at import, so binding takes effect whenever it happens. They are typed ``Any``: the
compiled modules must not check a vLLM object against impl's class.
"""

from __future__ import annotations

import importlib
from typing import Any

from kvspec.impl import kv_events, stats

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "KVCacheEvictionEvent",
           "PrefixCacheStats", "bind_vllm", "bound_to"]

BlockStored: Any = kv_events.BlockStored
BlockRemoved: Any = kv_events.BlockRemoved
AllBlocksCleared: Any = kv_events.AllBlocksCleared
KVCacheEvictionEvent: Any = stats.KVCacheEvictionEvent
PrefixCacheStats: Any = stats.PrefixCacheStats

_bound_to = "kvspec"

# name -> (vLLM module, class name)
_VLLM_CLASSES = {
    "BlockStored": ("vllm.distributed.kv_events", "BlockStored"),
    "BlockRemoved": ("vllm.distributed.kv_events", "BlockRemoved"),
    "AllBlocksCleared": ("vllm.distributed.kv_events", "AllBlocksCleared"),
    "KVCacheEvictionEvent": ("vllm.v1.metrics.stats", "KVCacheEvictionEvent"),
    "PrefixCacheStats": ("vllm.v1.metrics.stats", "PrefixCacheStats"),
}


def bind_vllm() -> None:
    """Build vLLM's classes from now on (imports the vLLM modules that define them)."""
    global _bound_to
    namespace = globals()
    for name, (module, attr) in _VLLM_CLASSES.items():
        namespace[name] = getattr(importlib.import_module(module), attr)
    _bound_to = "vllm"


def bound_to() -> str:
    """``"kvspec"`` or ``"vllm"``: whose classes impl builds."""
    return _bound_to
