"""What impl takes from its host, in one place: the classes it builds for its callers (KV-cache
events, cache stats) and the process's context-parallel layout.

They are bound at their first use, to the host's (``host_profile``): next to a vLLM release
kvspec has a profile for (0.13.x, 0.33.x) they are vLLM's, so that vLLM's code, its tests and
its event consumers get objects of vLLM's own types (``isinstance(event,
vllm.distributed.kv_events.BlockStored)`` holds, and a ``KVEventBatch`` of them is vLLM's),
whether or not the plugin ran; otherwise impl's own (``kvspec.impl.kv_events``,
``kvspec.impl.stats``). impl's own event classes encode to the same bytes (``kv_events``), so
either way the wire format is vLLM's. ``bind_vllm`` and ``bind_kvspec`` force a choice (the
plugin binds vLLM's).

impl's modules look these names up when they build an object (``host_types.BlockStored(...)``),
never at import, so binding takes effect whenever it happens; until the first lookup the names
are unbound and the module's ``__getattr__`` binds them (after that a lookup is a plain module
attribute read). They are typed ``Any``: the compiled modules must not check a vLLM object
against impl's class.

``context_parallel_layout()`` gives ``(pcp_world_size, pcp_rank, dcp_world_size, dcp_rank)``
for block tables built without explicit ranks: one rank on its own, vLLM's process groups once
bound (vLLM's worker builds its block tables without passing them).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from kvspec.impl import host_profile, kv_events, stats

__all__ = ["AllBlocksCleared", "BlockRemoved", "BlockStored", "KVCacheEvictionEvent",
           "PrefixCacheStats", "bind_kvspec", "bind_vllm", "bound_to", "context_parallel_layout"]

# Unbound until first use (module docstring): __getattr__ binds them to the host's.
BlockStored: Any
BlockRemoved: Any
AllBlocksCleared: Any
KVCacheEvictionEvent: Any
PrefixCacheStats: Any

_bound_to: str | None = None  # "kvspec" or "vllm" once bound

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


context_parallel_layout: Callable[[], ContextParallelLayout]

# name -> (vLLM module, class name)
_VLLM_CLASSES = {
    "BlockStored": ("vllm.distributed.kv_events", "BlockStored"),
    "BlockRemoved": ("vllm.distributed.kv_events", "BlockRemoved"),
    "AllBlocksCleared": ("vllm.distributed.kv_events", "AllBlocksCleared"),
    "KVCacheEvictionEvent": ("vllm.v1.metrics.stats", "KVCacheEvictionEvent"),
    "PrefixCacheStats": ("vllm.v1.metrics.stats", "PrefixCacheStats"),
}


_HOST_NAMES = frozenset({*_VLLM_CLASSES, "context_parallel_layout"})


def bind_vllm() -> None:
    """Build vLLM's classes from now on (imports the vLLM modules that define them)."""
    global _bound_to, context_parallel_layout
    classes = {name: getattr(importlib.import_module(module), attr)
               for name, (module, attr) in _VLLM_CLASSES.items()}
    globals().update(classes)
    context_parallel_layout = _vllm_process_groups
    _bound_to = "vllm"


def bind_kvspec() -> None:
    """Build impl's own classes from now on, for one rank on its own."""
    global _bound_to, context_parallel_layout, BlockStored, BlockRemoved, AllBlocksCleared
    global KVCacheEvictionEvent, PrefixCacheStats
    BlockStored = kv_events.BlockStored
    BlockRemoved = kv_events.BlockRemoved
    AllBlocksCleared = kv_events.AllBlocksCleared
    KVCacheEvictionEvent = stats.KVCacheEvictionEvent
    PrefixCacheStats = stats.PrefixCacheStats
    context_parallel_layout = _single_rank
    _bound_to = "kvspec"


def _bind_for_host() -> None:
    if host_profile.current().vllm_classes:
        try:
            bind_vllm()
            return
        except (ImportError, AttributeError):  # a vLLM whose modules cannot be imported here
            pass
    bind_kvspec()


def __getattr__(name: str) -> Any:
    """PEP 562, called only for a name not bound yet: binds the host's names at first use."""
    if name in _HOST_NAMES and _bound_to is None:
        _bind_for_host()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def bound_to() -> str:
    """``"kvspec"`` or ``"vllm"``: whose classes impl builds (binding them now if not yet)."""
    if _bound_to is None:
        _bind_for_host()
    return _bound_to or "kvspec"
