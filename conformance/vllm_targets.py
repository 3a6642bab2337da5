"""Targets for `kvspec audit`: find the class to audit and the adapter that speaks its API.

A target name is ``impl`` (kvspec's own implementation), ``vllm`` (whatever vLLM this Python
imports) or ``package.module:Class`` (a fork, or any class with vLLM's API). Which adapter
drives it depends on the API the class has, not on its version string: vLLM 0.13's
BlockPool takes ``touch(tuple_of_groups)`` and keys blocks with ``block.block_hash = key``;
0.33's takes a flat ``touch(blocks)``, keys with ``set_block_hash`` and reads more fields
of the request in ``cache_full_blocks`` (LoRA name and path, session id, multimodal
features, prompt embeddings) to build its events.

Whatever cannot be set up raises `TargetError` with a message that says what to do.
"""

from __future__ import annotations

import importlib
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvspec.conformance.targets import VllmApiPool

VLLM_POOL = "vllm.v1.core.block_pool:BlockPool"
IMPL_POOL = "kvspec.impl.block_pool:BlockPool"


class TargetError(LookupError):
    """A target that cannot be loaded or driven: the message says why and what to do."""


class LayerUnavailable(Exception):
    """A layer that cannot be audited for this target (no machine, no adapter): skipped."""


def vllm_version() -> str | None:
    """The version of the vLLM this interpreter imports, or None when it has none."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        import vllm
    except ImportError:
        return None
    return str(getattr(vllm, "__version__", "unknown"))


def no_vllm_message() -> str:
    import sys

    return (
        f"vLLM is not importable in this interpreter ({sys.executable}). Build an "
        "environment with real vLLM first, then run kvspec from it:\n"
        "    make vllm-env VLLM=0.13.0      # or 0.33.0; VLLM_WHEEL=fork.whl for a fork\n"
        "    .venv-vllm-0.13.0/bin/kvspec audit --target vllm --profile vllm-0.13")


def load_class(path: str) -> Any:
    """The class named by ``package.module:Class``; `TargetError` when there is none (no such
    module, a module that fails to import, no such name, or a name that is not a class)."""
    module_name, _, class_name = path.partition(":")
    if not module_name or not class_name:
        raise TargetError(f"target {path!r} is not of the form package.module:Class")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        if module_name.split(".")[0] == "vllm":
            raise TargetError(no_vllm_message()) from error
        raise TargetError(f"cannot import module {module_name!r} of target {path!r}: "
                          f"{error}") from error
    except Exception as error:  # the module itself raised while importing
        raise TargetError(f"cannot import module {module_name!r} of target {path!r}: "
                          f"{type(error).__name__}: {error}") from error
    try:
        found = getattr(module, class_name)
    except AttributeError as error:
        raise TargetError(f"module {module_name!r} has no class {class_name!r}") from error
    if not isinstance(found, type):
        raise TargetError(
            f"target {path!r} names {type(found).__name__} {class_name!r}, not a class: use "
            f"package.module:Class naming a class with vLLM's API, or impl or vllm")
    return found


def has_flat_touch_api(pool_class: Any, block_class: Any) -> bool:
    """True for vLLM 0.33's BlockPool API (flat touch, set_block_hash), False for 0.13's.
    impl's ``BlockPool`` and its subclasses count as 0.33's: the class builds vLLM 0.33's pool
    where asked (``block_pool.pool_class_for``) and its touch takes a flat list either way."""
    from kvspec.impl.block_pool import BlockPool

    return (hasattr(block_class, "set_block_hash") or hasattr(pool_class, "cache_partial_block")
            or (isinstance(pool_class, type) and issubclass(pool_class, BlockPool)))


# --- vLLM 0.33's BlockPool -------------------------------------------------------------------


@dataclass
class _LoRA033:
    """What 0.33's cache_full_blocks reads from a LoRA request (hash keys and events)."""

    adapter_id: int
    lora_name: str = "lora"
    lora_path: str = "/conformance/lora"

    @property
    def name(self) -> str:
        return self.lora_name


@dataclass
class _Request033:
    """Just what vLLM 0.33's BlockPool.cache_full_blocks reads from a request."""

    block_hashes: list[bytes]
    all_token_ids: list[int]
    lora_request: _LoRA033 | None = None
    request_id: str = "conformance"
    session_id: str | None = None
    cache_salt: str | None = None
    prompt_embeds: Any = None
    mm_features: list[Any] = field(default_factory=list)
    _prompt_embeds_per_block_hashes: dict[tuple[int, int], bytes] = field(default_factory=dict)
    kv_retention: list[Any] = field(default_factory=list)  # kvspec's retention hints, if any

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class Vllm033Pool(VllmApiPool):
    """Performs pool commands on a class with vLLM 0.33's BlockPool API.

    The differences from 0.13's, which `VllmApiPool` drives: ``touch`` takes a flat list;
    ``cache_full_blocks`` reads more request fields; a block can carry secondary keys
    (``cached_block_hashes_by_block``), which the view lists so that the spec sees them.
    The null block's ref count is never changed by 0.33, and ignored by the view anyway.
    """

    flat_touch = True

    def request(self, command: Any) -> Any:
        return request_for_033(command.block_hashes, self.tokens(command), command.lora_id,
                               command.retention)

    def request_of(self, block_hashes: Sequence[bytes], token_ids: Sequence[int],
                   lora_id: int | None) -> Any:
        return request_for_033(block_hashes, token_ids, lora_id)

    def request_source(self, command: Any) -> str:
        hints = f", {list(command.retention)!r}" if command.retention else ""
        return (f"request_for_033({list(command.block_hashes)!r}, {self.tokens(command)!r}, "
                f"{command.lora_id!r}{hints})")

    def imports(self) -> list[str]:
        return [*super().imports(),
                "from kvspec.conformance.vllm_targets import request_for_033"]


def request_for_033(block_hashes: Sequence[bytes], token_ids: Sequence[int],
                    lora_id: int | None = None, retention: Sequence[Any] = ()) -> _Request033:
    """The stand-in request vLLM 0.33's BlockPool.cache_full_blocks reads (and the
    retention hints a pool with kvspec's ``priority`` policy reads)."""
    return _Request033(list(block_hashes), list(token_ids),
                       None if lora_id is None else _LoRA033(lora_id),
                       kv_retention=list(retention))


# --- Picking the target ----------------------------------------------------------------------


@dataclass(frozen=True)
class PoolTargetInfo:
    """How to make a pool target, and what it is (for the report)."""

    name: str
    pool_path: str
    block_module: str
    flat_touch_api: bool
    vllm_version: str | None

    def make(self) -> VllmApiPool:
        adapter = Vllm033Pool if self.flat_touch_api else VllmApiPool
        return adapter(self.pool_path, self.block_module, name=self.name)

    @property
    def api(self) -> str:
        return "vLLM 0.33 BlockPool API" if self.flat_touch_api else "vLLM 0.13 BlockPool API"


def _block_module_for(pool_path: str) -> str:
    """Where the KVCacheBlock of a pool class lives: beside it, else impl's."""
    module_name = pool_path.partition(":")[0]
    candidates = [module_name.rsplit(".", 1)[0] + ".kv_cache_utils", module_name]
    for candidate in candidates:
        try:
            module = importlib.import_module(candidate)
        except ImportError:
            continue
        if hasattr(module, "KVCacheBlock"):
            return candidate
    return "kvspec.impl.kv_cache_utils"


def pool_target(name: str) -> PoolTargetInfo:
    """The pool target called ``name``: ``impl``, ``vllm`` or ``package.module:Class``."""
    version = None
    if name == "impl":
        path = IMPL_POOL
    elif name == "vllm":
        version = vllm_version()
        if version is None:
            raise TargetError(no_vllm_message())
        path = VLLM_POOL
    elif ":" in name:
        path = name
        if name.startswith("vllm."):
            version = vllm_version()
    else:
        raise TargetError(f"unknown target {name!r}: use impl, vllm or package.module:Class")
    pool_class = load_class(path)
    block_module = _block_module_for(path)
    block_class = importlib.import_module(block_module).KVCacheBlock
    return PoolTargetInfo(name, path, block_module, has_flat_touch_api(pool_class, block_class),
                          version)


# --- vLLM 0.13's KVCacheManager --------------------------------------------------------------

VLLM_MANAGER = "vllm.v1.core.kv_cache_manager:KVCacheManager"
# impl's spec classes that vLLM 0.13 has, by name (0.13 has no SinkFullAttentionSpec).
VLLM_013_SPECS = ("FullAttentionSpec", "MLAAttentionSpec", "SlidingWindowSpec",
                  "ChunkedLocalAttentionSpec", "MambaSpec", "CrossAttentionSpec")


def has_013_manager_api(manager_class: Any) -> bool:
    """vLLM 0.13's KVCacheManager: no scheduler_block_size, 2-tuple get_computed_blocks."""
    import inspect

    try:
        parameters = inspect.signature(manager_class.__init__).parameters
    except (TypeError, ValueError):
        return False
    return "scheduler_block_size" not in parameters and "hash_block_size" in parameters


def vllm_kv_cache_config(impl_config: Any) -> Any:
    """impl's KVCacheConfig rebuilt from vLLM's own classes (fields copied by name)."""
    from vllm.v1 import kv_cache_interface as vllm_kv

    groups = [vllm_kv.KVCacheGroupSpec(list(group.layer_names), vllm_spec(group.kv_cache_spec))
              for group in impl_config.kv_cache_groups]
    return vllm_kv.KVCacheConfig(impl_config.num_blocks, [], groups)


def vllm_spec(spec: Any, known: Sequence[str] = VLLM_013_SPECS, release: str = "0.13",
              **overrides: Any) -> Any:
    """One of impl's KVCacheSpec objects rebuilt from vLLM's class of the same name (fields
    copied by name; ``overrides`` set fields impl's class lacks, where vLLM's has them)."""
    import dataclasses

    import torch
    from vllm.v1 import kv_cache_interface as vllm_kv

    def dtype(value: Any) -> Any:
        return getattr(torch, value) if isinstance(value, str) else value

    name = type(spec).__name__
    if name not in known:
        raise TargetError(f"vLLM {release} has no {name}")
    vllm_class = getattr(vllm_kv, name)
    fields = {f.name for f in dataclasses.fields(vllm_class) if f.init}
    values = {k: getattr(spec, k) for k in fields if hasattr(spec, k)}
    values.update({k: v for k, v in overrides.items() if k in fields})
    if "dtype" in values:
        values["dtype"] = dtype(values["dtype"])
    if "dtypes" in values:
        values["dtypes"] = tuple(dtype(d) for d in values["dtypes"])
    return vllm_class(**values)


def vllm_013_layouts(layouts: Sequence[Any]) -> tuple[list[Any], list[str]]:
    """The manager-machine layouts vLLM 0.13's KVCacheManager accepts, and why others are out.

    0.13 has no sink attention, and its hybrid coordinator takes exactly one full-attention
    spec and one other spec; a layout it rejects is left out (and named in the report).
    """
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    kept, left_out = [], []
    for layout in layouts:
        config = layout.build(2 + 8 * 4)
        names = {type(g.kv_cache_spec).__name__ for g in config.kv_cache_groups}
        unknown = sorted(names - set(VLLM_013_SPECS))
        if unknown:
            left_out.append(f"{layout.name} (vLLM 0.13 has no {', '.join(unknown)})")
            continue
        try:
            KVCacheManager(vllm_kv_cache_config(config), max_model_len=layout.max_model_len,
                           hash_block_size=layout.hash_block_size,
                           enable_caching=layout.caching)
        except (AssertionError, ValueError, KeyError, NotImplementedError) as error:
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            left_out.append(f"{layout.name} (vLLM 0.13 rejects it: {reason})")
            continue
        kept.append(layout)
    return kept, left_out


# --- vLLM 0.33's KVCacheManager --------------------------------------------------------------

# The attention types the 0.33 manager layer covers (vLLM 0.33's classes of these names).
VLLM_033_SPECS = ("FullAttentionSpec", "MLAAttentionSpec", "SlidingWindowSpec",
                  "ChunkedLocalAttentionSpec", "MambaSpec", "CrossAttentionSpec")


def has_033_manager_api(manager_class: Any) -> bool:
    """vLLM 0.33's KVCacheManager: takes the scheduler's block size."""
    import inspect

    try:
        parameters = inspect.signature(manager_class.__init__).parameters
    except (TypeError, ValueError):
        return False
    return "scheduler_block_size" in parameters


def vllm_033_kv_cache_config(impl_config: Any, enable_caching: bool) -> Any:
    """impl's KVCacheConfig rebuilt from vLLM 0.33's classes. A prefix-cached Mamba group
    runs in ``mamba_cache_mode="align"``: 0.33 refuses Mamba prefix caching in any other mode
    (single_type_kv_cache_manager.py, MambaManager.__init__)."""
    from vllm.v1 import kv_cache_interface as vllm_kv

    mode = {"mamba_cache_mode": "align"} if enable_caching else {}
    groups = [vllm_kv.KVCacheGroupSpec(list(group.layer_names), vllm_spec(
        group.kv_cache_spec, VLLM_033_SPECS, "0.33", **mode))
        for group in impl_config.kv_cache_groups]
    return vllm_kv.KVCacheConfig(impl_config.num_blocks, [], groups)


_REGISTERED: list[bool] = []


def register_033_managers() -> None:
    """Fill vLLM 0.33's manager registry once (``register_all_kvcache_specs``): only
    EngineCore does it in a real engine, and a KVCacheManager built without it finds no
    manager for any spec (single_type_kv_cache_manager.py, get_manager_for_kv_cache_spec)."""
    if _REGISTERED:
        return
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs

    register_all_kvcache_specs(None)
    _REGISTERED.append(True)


def vllm_033_layouts(layouts: Sequence[Any]) -> tuple[list[Any], list[str]]:
    """The manager-machine layouts the 0.33 manager layer runs, and why others are out."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    register_033_managers()
    kept, left_out = [], []
    for layout in layouts:
        config = layout.build(2 + 8 * 4)
        names = {type(g.kv_cache_spec).__name__ for g in config.kv_cache_groups}
        unknown = sorted(names - set(VLLM_033_SPECS))
        if unknown:
            left_out.append(f"{layout.name} ({', '.join(unknown)}: not in the 0.33 layer yet)")
            continue
        if any(getattr(g.kv_cache_spec, "num_speculative_blocks", 0)
               for g in config.kv_cache_groups):
            left_out.append(f"{layout.name} (Mamba speculative blocks: not in the 0.33 "
                            "layer yet)")
            continue
        try:
            KVCacheManager(vllm_033_kv_cache_config(config, layout.caching),
                           max_model_len=layout.max_model_len,
                           scheduler_block_size=math.lcm(*(
                               g.kv_cache_spec.block_size for g in config.kv_cache_groups)),
                           hash_block_size=layout.hash_block_size,
                           enable_caching=layout.caching)
        except (AssertionError, ValueError, KeyError, NotImplementedError) as error:
            reason = str(error).splitlines()[0] if str(error) else type(error).__name__
            left_out.append(f"{layout.name} (vLLM 0.33 rejects it: {reason})")
            continue
        kept.append(layout)
    return kept, left_out
