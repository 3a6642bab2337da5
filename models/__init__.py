"""KV-cache layouts of real LLM architectures, as data, and vLLM 0.13's planning arithmetic.

``list_models()`` / ``get_layout(name)`` give the shipped layouts (``models/data/*.json``, every
figure with its source); ``kv_cache_groups`` and ``plan_memory`` (``models.plan``) compute the
KV-cache groups, page sizes and block counts; ``to_kv_cache_config`` (``models.bridge``) builds
impl's ``KVCacheConfig``; ``models.plan_report`` reads ``kvspec plan``'s options and shows the
plan (the command itself is ``kvspec.cli``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvspec.models.layout import (
    Figure,
    InvalidLayout,
    LayerLayout,
    ModelLayout,
    UnknownModelError,
    all_layouts,
    get_layout,
    layout_from_dict,
    list_models,
)
from kvspec.models.plan import (
    GroupPlan,
    GroupSpec,
    InvalidMemorySize,
    InvalidPlanArgument,
    KVCacheGroup,
    MemoryPlan,
    kv_cache_groups,
    parse_memory,
    plan_memory,
)

if TYPE_CHECKING:
    from kvspec.models.bridge import to_kv_cache_config

__all__ = [
    "Figure",
    "GroupPlan",
    "GroupSpec",
    "InvalidLayout",
    "InvalidMemorySize",
    "InvalidPlanArgument",
    "KVCacheGroup",
    "LayerLayout",
    "MemoryPlan",
    "ModelLayout",
    "UnknownModelError",
    "all_layouts",
    "get_layout",
    "kv_cache_groups",
    "layout_from_dict",
    "list_models",
    "parse_memory",
    "plan_memory",
    "to_kv_cache_config",
]


def __getattr__(name: str) -> Any:
    # The bridge imports impl/; load it only when asked for.
    if name == "to_kv_cache_config":
        from kvspec.models.bridge import to_kv_cache_config

        return to_kv_cache_config
    raise AttributeError(f"module 'models' has no attribute {name!r}")
