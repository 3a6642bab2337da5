"""Target adapters: how the conformance machine drives a block pool and reads its state back.

A target speaks block ids; its adapter turns them into the target's block objects and turns
the target's state back into a `PoolView` (the abstraction function). `VllmApiPool` drives any
class with vLLM 0.13's BlockPool API: kvspec's impl/, vLLM itself, or a fork.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvspec.spec.pool import NULL_BLOCK, Cleared, Event, Key, PoolState, Removed, Stored


@dataclass(frozen=True)
class PoolView:
    """What a pool's state looks like from outside: the spec state without its history."""

    ref: tuple[int, ...]
    free: tuple[int, ...]
    key_of: tuple[Key | None, ...]
    cached: tuple[tuple[Key, tuple[int, ...]], ...]
    pending_events: tuple[Event, ...]


def view_of(state: PoolState) -> PoolView:
    """The spec state as a target would show it."""
    return PoolView(state.ref, state.free, state.key_of, state.cached,
                    state.events[state.num_taken:])


class PoolTarget(Protocol):
    """The operations the conformance machine performs on a block pool, in block ids."""

    name: str

    def build(self, num_blocks: int, enable_caching: bool, enable_events: bool,
              max_pending_events: int | None = None) -> None: ...
    def supports_event_bound(self) -> bool: ...
    def event_collapses(self) -> int | None: ...
    def get_new_blocks(self, n: int) -> list[int]: ...
    def free_blocks(self, block_ids: Sequence[int]) -> None: ...
    def touch(self, block_ids: Sequence[int]) -> None: ...
    def cache_full_blocks(
        self, block_ids: Sequence[int], block_hashes: Sequence[bytes], num_cached: int,
        num_full: int, group_id: int, token_ids: Sequence[int], block_size: int,
        lora_id: int | None,
    ) -> None: ...
    def get_cached_block(self, block_hash: bytes, group_ids: Sequence[int]) -> list[int] | None: ...
    def get_cached_prefix(
        self, block_hashes: Sequence[bytes], group_id: int, max_blocks: int
    ) -> list[int] | None: ...
    def evict_blocks(self, block_ids: set[int]) -> None: ...
    def reset_prefix_cache(self) -> bool: ...
    def get_num_free_blocks(self) -> int: ...
    def get_usage(self) -> float: ...
    def take_events(self) -> list[Event]: ...
    def view(self) -> PoolView: ...


@dataclass
class _LoRA:
    adapter_id: int
    lora_name: str = "lora"


@dataclass
class _Request:
    """Just what BlockPool.cache_full_blocks reads from a request."""

    block_hashes: list[bytes]
    all_token_ids: list[int]
    lora_request: _LoRA | None = None
    request_id: str = "conformance"
    extra: dict[str, Any] = field(default_factory=dict)


def external_hash_of(value: object) -> int:
    """An event hash as the spec carries it: bytes become their low 64 bits."""
    if isinstance(value, bytes):
        return int.from_bytes(value, "big") & (2**64 - 1)
    if isinstance(value, int):
        return value
    raise TypeError(f"unexpected event hash {value!r}")


def spec_event(event: object) -> Event:
    """A target's KV event in the spec's terms, by class name and fields."""
    kind = type(event).__name__
    if kind == "BlockStored":
        parent = getattr(event, "parent_block_hash", None)
        lora_id = getattr(event, "lora_id", None)
        return Stored(
            hashes=tuple(external_hash_of(h) for h in event.block_hashes),  # type: ignore[attr-defined]
            parent=None if parent is None else external_hash_of(parent),
            token_ids=tuple(event.token_ids),  # type: ignore[attr-defined]
            block_size=int(event.block_size),  # type: ignore[attr-defined]
            lora_id=lora_id,
        )
    if kind == "BlockRemoved":
        return Removed(tuple(external_hash_of(h) for h in event.block_hashes))  # type: ignore[attr-defined]
    if kind == "AllBlocksCleared":
        return Cleared()
    raise TypeError(f"unexpected KV event {event!r}")


class VllmApiPool:
    """Drives a class with vLLM 0.13's BlockPool API, found as ``module:Class``.

    ``block_module`` names where KVCacheBlock lives (for blocks foreign to the pool).
    """

    def __init__(self, pool_path: str = "kvspec.impl.block_pool:BlockPool",
                 block_module: str = "kvspec.impl.kv_cache_utils", name: str = "impl",
                 hash_block_size: int = 2) -> None:
        module_name, _, class_name = pool_path.partition(":")
        self.pool_class: Any = getattr(importlib.import_module(module_name), class_name)
        self.block_class: Any = importlib.import_module(block_module).KVCacheBlock
        self.name = name
        self.hash_block_size = hash_block_size
        self.pool: Any = None
        self.num_blocks = 0
        self._event_bound: bool | None = None  # supports_event_bound(), once known

    def build(self, num_blocks: int, enable_caching: bool, enable_events: bool,
              max_pending_events: int | None = None) -> None:
        self.num_blocks = num_blocks
        bound = {} if max_pending_events is None else {
            "max_pending_kv_events": max_pending_events}
        self.pool = self.pool_class(num_blocks, enable_caching, self.hash_block_size,
                                    enable_kv_cache_events=enable_events, **bound)

    def supports_event_bound(self) -> bool:
        """Whether the pool class takes kvspec's bound on pending events (vLLM's does not):
        tried once on a tiny pool, which works for compiled classes too."""
        if self._event_bound is None:
            try:
                self.pool_class(2, True, self.hash_block_size, enable_kv_cache_events=True,
                                max_pending_kv_events=1)
            except TypeError:
                self._event_bound = False
            else:
                self._event_bound = True
        return self._event_bound

    def event_collapses(self) -> int | None:
        """How often the pool collapsed its pending events (None: it keeps no count)."""
        count = getattr(self.pool, "num_kv_event_collapses", None)
        return None if count is None else int(count)

    def _block(self, block_id: int) -> Any:
        if 0 <= block_id < self.num_blocks:
            return self.pool.blocks[block_id]
        return self.block_class(block_id)  # a block this pool never made

    def get_new_blocks(self, n: int) -> list[int]:
        return [b.block_id for b in self.pool.get_new_blocks(n)]

    def free_blocks(self, block_ids: Sequence[int]) -> None:
        self.pool.free_blocks(self._block(i) for i in block_ids)

    def touch(self, block_ids: Sequence[int]) -> None:
        self.pool.touch(([self._block(i) for i in block_ids],))

    def cache_full_blocks(
        self, block_ids: Sequence[int], block_hashes: Sequence[bytes], num_cached: int,
        num_full: int, group_id: int, token_ids: Sequence[int], block_size: int,
        lora_id: int | None,
    ) -> None:
        tokens = [0] * (num_cached * block_size) + list(token_ids)
        request = self._request(list(block_hashes), tokens, lora_id)
        self.pool.cache_full_blocks(request, [self._block(i) for i in block_ids], num_cached,
                                    num_full, block_size, group_id)

    def _request(self, block_hashes: list[bytes], tokens: list[int], lora_id: int | None) -> Any:
        """The stand-in request cache_full_blocks reads (a release may read more fields)."""
        return _Request(block_hashes, tokens, None if lora_id is None else _LoRA(lora_id))

    def get_cached_block(self, block_hash: bytes, group_ids: Sequence[int]) -> list[int] | None:
        found = self.pool.get_cached_block(block_hash, list(group_ids))
        return None if found is None else [b.block_id for b in found]

    def get_cached_prefix(
        self, block_hashes: Sequence[bytes], group_id: int, max_blocks: int
    ) -> list[int] | None:
        """kvspec's bulk lookup; None for a pool without one (vLLM)."""
        lookup = getattr(self.pool, "get_cached_prefix", None)
        if lookup is None:
            return None
        return [b.block_id for b in lookup(list(block_hashes), group_id, max_blocks)]

    def evict_blocks(self, block_ids: set[int]) -> None:
        self.pool.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        return bool(self.pool.reset_prefix_cache())

    def get_num_free_blocks(self) -> int:
        return int(self.pool.get_num_free_blocks())

    def get_usage(self) -> float:
        return float(self.pool.get_usage())

    def take_events(self) -> list[Event]:
        return [spec_event(e) for e in self.pool.take_events()]

    def _map_entries(self) -> list[tuple[Key, tuple[int, ...]]]:
        cache_map = self.pool.cached_block_hash_to_block
        if hasattr(cache_map, "items"):
            return [(k, tuple(b.block_id for b in v)) for k, v in cache_map.items()]
        entries = []
        for key, value in cache_map._cache.items():  # vLLM: a bare block or {id: block}
            blocks = list(value.values()) if isinstance(value, dict) else [value]
            entries.append((key, tuple(b.block_id for b in blocks)))
        return entries

    def view(self) -> PoolView:
        pool = self.pool
        blocks = [pool.blocks[i] for i in range(self.num_blocks)]
        ref = tuple(0 if i == NULL_BLOCK else b.ref_cnt for i, b in enumerate(blocks))
        free = tuple(b.block_id for b in pool.free_block_queue.get_all_free_blocks())
        key_of = tuple(b.block_hash for b in blocks)
        cached = tuple(sorted(self._map_entries()))
        pending = tuple(spec_event(e) for e in getattr(pool, "kv_event_queue", []))
        return PoolView(ref, free, key_of, cached, pending)


def target_from_name(name: str) -> VllmApiPool:
    """``impl``, ``vllm`` (whatever vLLM is importable) or ``package.module:Class``."""
    if name == "impl":
        return VllmApiPool()
    if name == "vllm":
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        return VllmApiPool("vllm.v1.core.block_pool:BlockPool", "vllm.v1.core.kv_cache_utils",
                           name="vllm")
    if ":" in name:
        module_name = name.partition(":")[0]
        block_module = module_name.rsplit(".", 1)[0] + ".kv_cache_utils"
        try:
            importlib.import_module(block_module)
        except ImportError:
            block_module = "kvspec.impl.kv_cache_utils"
        return VllmApiPool(name, block_module, name=name)
    raise LookupError(f"unknown target {name!r}: use impl, vllm or package.module:Class")
