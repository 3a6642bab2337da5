"""kvspec's KV offloading managers: drop-ins for vLLM 0.13's ``vllm.v1.kv_offload``.

``LRUOffloadingManager`` and ``ARCOffloadingManager`` take vLLM's ``Backend`` (its
``CPUBackend``, or any object with the same methods) and answer vLLM 0.13's
``OffloadingManager`` calls, with vLLM 0.33's fixes and typed, atomic refusals
(``abstract.py``). Pure Python: nothing here imports vLLM.
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
from kvspec.impl.kv_offload.lru_manager import LRUOffloadingManager

__all__ = [
    "ARCOffloadingManager",
    "DuplicateOffloadKey",
    "LRUOffloadingManager",
    "LoadStoreSpec",
    "NotPinned",
    "OffloadingError",
    "OffloadingEvent",
    "OffloadingManager",
    "PrepareStoreOutput",
    "StoreNotComplete",
    "StoreNotPending",
    "UnknownOffloadKey",
]
