"""kvspec's KV offloading managers: drop-ins for vLLM 0.13's ``vllm.v1.kv_offload``.

``LRUOffloadingManager`` and ``ARCOffloadingManager`` take vLLM's ``Backend`` (its
``CPUBackend``, or any object with the same methods) and answer vLLM 0.13's
``OffloadingManager`` calls, with vLLM 0.33's fixes and typed, atomic refusals
(``abstract.py``). ``CPUOffloadingManager`` (``cpu_manager.py``) answers vLLM 0.33's API
(keys from ``make_offload_key``, a ``ReqContext`` per call, per-request recency; its data
classes are in ``base.py``, named as vLLM 0.33's ``vllm.v1.kv_offload.base``). Pure Python:
nothing here imports vLLM.
"""

from __future__ import annotations

from kvspec.impl.errors import (
    DuplicateOffloadKey,
    NotPinned,
    OffloadingError,
    StoreNotComplete,
    StoreNotPending,
    UnknownOffloadKey,
)
from kvspec.impl.kv_offload.abstract import (
    LoadStoreSpec,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
)
from kvspec.impl.kv_offload.arc_manager import ARCOffloadingManager
from kvspec.impl.kv_offload.base import (
    LookupResult,
    ReqContext,
    get_offload_block_hash,
    get_offload_group_idx,
    make_offload_key,
)
from kvspec.impl.kv_offload.cpu_manager import BadOffloadConfig, CPUOffloadingManager
from kvspec.impl.kv_offload.lru_manager import LRUOffloadingManager

__all__ = [
    "ARCOffloadingManager",
    "BadOffloadConfig",
    "CPUOffloadingManager",
    "DuplicateOffloadKey",
    "LRUOffloadingManager",
    "LoadStoreSpec",
    "LookupResult",
    "NotPinned",
    "OffloadingError",
    "OffloadingEvent",
    "OffloadingManager",
    "PrepareStoreOutput",
    "ReqContext",
    "StoreNotComplete",
    "StoreNotPending",
    "UnknownOffloadKey",
    "get_offload_block_hash",
    "get_offload_group_idx",
    "make_offload_key",
]
