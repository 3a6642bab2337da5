"""What impl takes from its host, in one place: the classes it builds for its callers (KV-cache
events, cache stats) and the process's context-parallel layout.

By default they are impl's own (``kvspec.impl.kv_events``, ``kvspec.impl.stats``).
Inside vLLM (``kvspec.vllm_plugin``) ``bind_vllm`` binds them to vLLM's,
so that vLLM's code, its tests and its event consumers get objects of vLLM's own types:
``isinstance(event, vllm.distributed.kv_events.BlockStored)`` holds, and a ``KVEventBatch``
of them is vLLM's. impl's own event classes encode to the same bytes (``kv_events``), so
either way the wire format is vLLM's.

impl's modules look these names up when they build an object (``host_types.BlockStored(...)``),
never at import, so binding takes effect whenever it happens. They are typed ``Any``: the
compiled modules must not check a vLLM object against impl's class.

``context_parallel_layout()`` gives ``(pcp_world_size, pcp_rank, dcp_world_size, dcp_rank)``
for block tables built without explicit ranks: one rank on its own, vLLM's process groups once
bound (vLLM's worker builds its block tables without passing them).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from kvspec.impl import kv_events, stats

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "KVCacheEvictionEvent",
           "PrefixCacheStats", "bind_vllm", "bound_to", "context_parallel_layout"]

BlockStored: Any = kv_events.BlockStored
BlockRemoved: Any = kv_events.BlockRemoved
AllBlocksCleared: Any = kv_events.AllBlocksCleared
KVCacheEvictionEvent: Any = stats.KVCacheEvictionEvent
PrefixCacheStats: Any = stats.PrefixCacheStats

_bound_to = "kvspec"

ContextParallelLayout = tuple[int, int, int, int]


def _single_rank() -> ContextParallelLayout:
    return (1, 0, 1, 0)


def _vllm_process_groups() -> ContextParallelLayout:
    """vLLM's prefill and decode context-parallel groups, each (1, 0) when not initialised
    (vLLM's block table falls back the same way)."""
    from vllm.distributed import get_dcp_group, get_pcp_group

    layout = []
    for get_group in (get_pcp_group, get_dcp_group):
        try:
            group = get_group()
            layout += [int(group.world_size), int(group.rank_in_group)]
        except AssertionError:
            layout += [1, 0]
    return (layout[0], layout[1], layout[2], layout[3])


context_parallel_layout: Callable[[], ContextParallelLayout] = _single_rank

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
    global _bound_to, context_parallel_layout
    namespace = globals()
    for name, (module, attr) in _VLLM_CLASSES.items():
        namespace[name] = getattr(importlib.import_module(module), attr)
    context_parallel_layout = _vllm_process_groups
    _bound_to = "vllm"


def bound_to() -> str:
    """``"kvspec"`` or ``"vllm"``: whose classes impl builds."""
    return _bound_to
