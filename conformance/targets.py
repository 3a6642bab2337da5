"""Pool adapters: how the checker performs `spec.pool`'s commands on a block pool.

A command speaks block ids; the adapter turns them into the target's block objects and turns
the target's state back into a `PoolView` (the abstraction function, `pool_view`).
`VllmApiPool` drives any class with vLLM 0.13's BlockPool API (kvspec's impl/, vLLM itself, a
fork); `vllm_targets.Vllm033Pool` drives 0.33's. Each adapter also writes a command as a call
on the pool's own API, for counterexamples (`lockstep.counterexample_source`).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvspec.conformance.lockstep import Unsupported
from kvspec.spec import pool as model
from kvspec.spec.pool import NULL_BLOCK, Cleared, Event, Key, PoolState, Removed, Stored


@dataclass(frozen=True)
class PoolView:
    """What a pool's state looks like from outside: the spec state without its history."""

    ref: tuple[int, ...]
    free: tuple[int, ...]
    key_of: tuple[Key | None, ...]
    cached: tuple[tuple[Key, tuple[int, ...]], ...]
    pending_events: tuple[Event, ...]
    # The eviction policy's state (spec.eviction): the clock, the retention priorities that
    # are not the default (block, priority, expires at), the pinned blocks. A pool without
    # policies shows the defaults.
    now: int = 0
    retention: tuple[tuple[int, int, int | None], ...] = ()
    pinned: tuple[int, ...] = ()


def view_of(state: PoolState) -> PoolView:
    """The spec state as a target would show it."""
    return PoolView(state.ref, state.free, state.key_of, state.cached,
                    state.events[state.num_taken:], state.now, state.retention, state.pinned)


# impl's plug-in for each policy but lru (impl's default pool is lru).
IMPL_POLICIES = {
    "lru-lifo-unhashed": "kvspec.impl.eviction:LruLifoUnhashed",
    "priority": "kvspec.impl.eviction:PriorityPolicy",
    "pinned": "kvspec.impl.eviction:PinnedPolicy",
}


def plug_in_arguments(policy: Any) -> dict[str, Any]:
    """What a policy plug-in class is built with: a policy with pins takes its cap
    (``max_pinned_share``); the others take nothing."""
    if policy is not None and policy.has_pins:
        return {"max_pinned_share": policy.max_pinned_share}
    return {}


def load(path: str) -> Any:
    """The object ``module:name`` names."""
    module_name, _, name = path.partition(":")
    return getattr(importlib.import_module(module_name), name)


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
    kv_retention: list[Any] = field(default_factory=list)  # retention hints (impl/eviction.py)


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


def request_for(block_hashes: Sequence[bytes], token_ids: Sequence[int],
                lora_id: int | None = None, retention: Sequence[Any] = ()) -> _Request:
    """The stand-in request vLLM 0.13's BlockPool.cache_full_blocks reads (and its
    retention hints, which a pool with the ``priority`` policy reads)."""
    lora = None if lora_id is None else _LoRA(lora_id)
    return _Request(list(block_hashes), list(token_ids), lora, kv_retention=list(retention))


def ids(blocks: Any) -> tuple[int, ...]:
    """Block objects as their ids."""
    return tuple(b.block_id for b in blocks)


def ids_or_none(blocks: Any) -> tuple[int, ...] | None:
    return None if blocks is None else ids(blocks)


def spec_events(events: Any) -> tuple[Event, ...]:
    return tuple(spec_event(e) for e in events)


def _map_entries(pool: Any) -> list[tuple[Key, tuple[int, ...]]]:
    cache_map = pool.cached_block_hash_to_block
    if hasattr(cache_map, "items"):
        return [(k, tuple(b.block_id for b in v)) for k, v in cache_map.items()]
    entries = []
    for key, value in cache_map._cache.items():  # vLLM: a bare block or {id: block}
        blocks = list(value.values()) if isinstance(value, dict) else [value]
        entries.append((key, tuple(b.block_id for b in blocks)))
    return entries


def pool_view(pool: Any) -> PoolView:
    """A BlockPool's state in the spec's terms (the abstraction function).

    vLLM 0.33 can give a block secondary keys (``cached_block_hashes_by_block``); the spec
    allows one key a block, so the first secondary key is shown in place of the primary one
    and the comparison fails there.
    """
    blocks = list(pool.blocks)
    ref = tuple(0 if i == NULL_BLOCK else b.ref_cnt for i, b in enumerate(blocks))
    free = tuple(b.block_id for b in pool.free_block_queue.get_all_free_blocks())
    key_of = [b.block_hash for b in blocks]
    for block_id, keys in (getattr(pool, "cached_block_hashes_by_block", None) or {}).items():
        if keys and 0 <= block_id < len(key_of):
            key_of[block_id] = sorted(keys)[0]
    cached = tuple(sorted(_map_entries(pool)))
    pending = tuple(spec_event(e) for e in getattr(pool, "kv_event_queue", []))
    policy = getattr(pool, "eviction_policy", None)
    retention = () if policy is None else tuple(policy.retention())
    pinned = () if policy is None else tuple(policy.pinned_ids())
    return PoolView(ref, free, tuple(key_of), cached, pending, int(getattr(pool, "clock", 0)),
                    retention, pinned)


# The eviction-policy commands, as calls on a target's policy API: impl's pool and manager
# (and a pool claiming a policy) name them alike.
_POLICY_METHODS: dict[type, str] = {
    model.SetRetention: "set_retention", model.AdvanceClock: "advance_clock",
    model.PinBlocks: "pin_blocks", model.UnpinBlocks: "unpin_blocks",
}


def _policy_arguments(command: Any) -> tuple[Any, ...]:
    if isinstance(command, model.SetRetention):
        return list(command.block_ids), command.priority, command.duration
    if isinstance(command, model.AdvanceClock):
        return (command.now,)
    return (list(command.block_ids),)


def perform_policy_command(target: Any, command: Any) -> None:
    """Run a `spec.pool.POLICY_COMMANDS` command on a pool or manager; `Unsupported` where
    the target lacks the call."""
    method = getattr(target, _POLICY_METHODS[type(command)], None)
    if method is None:
        raise Unsupported(f"the target has no {_POLICY_METHODS[type(command)]}")
    method(*_policy_arguments(command))


def policy_call_source(variable: str, command: Any) -> str:
    """A policy command as a call on ``variable`` (for counterexamples)."""
    arguments = ", ".join(repr(a) for a in _policy_arguments(command))
    return f"{variable}.{_POLICY_METHODS[type(command)]}({arguments})"


class VllmApiPool:
    """Performs pool commands on a class with vLLM 0.13's BlockPool API (``module:Class``).

    ``block_module`` names where KVCacheBlock lives (for blocks foreign to the pool).
    ``policy_path`` names an eviction-policy plug-in class (``module:Class``, impl's
    `EvictionPolicy` API) the pool is built with (``eviction_policy=Class()``); without one,
    the pool is built as it is (its own policy, or vLLM's LRU). Policy commands go to the
    pool's ``set_retention``, ``advance_clock``, ``pin_blocks`` and ``unpin_blocks``.
    """

    variable = "pool"
    flat_touch = False  # 0.13: touch takes a tuple of per-group block lists

    def __init__(self, pool_path: str = "kvspec.impl.block_pool:BlockPool",
                 block_module: str = "kvspec.impl.kv_cache_utils", name: str = "impl",
                 hash_block_size: int = 2, policy_path: str | None = None) -> None:
        self.policy_path = policy_path
        self.policy_class: Any = None if policy_path is None else load(policy_path)
        self.pool_path = pool_path
        module_name, _, class_name = pool_path.partition(":")
        self.pool_class: Any = getattr(importlib.import_module(module_name), class_name)
        self.block_module = block_module
        self.block_class: Any = importlib.import_module(block_module).KVCacheBlock
        self.name = name
        self.hash_block_size = hash_block_size
        self.pool: Any = None
        self.num_blocks = 0
        self._event_bound: bool | None = None  # supports_event_bound(), once known

    # -- the commands --------------------------------------------------------------------

    def perform(self, command: Any) -> object:
        """Run one `spec.pool` command on the pool; the output in the spec's terms."""
        c = command
        if isinstance(c, model.NewPool):
            self.num_blocks = c.num_blocks
            extra: dict[str, Any] = {} if c.max_pending_events is None else {
                "max_pending_kv_events": c.max_pending_events}
            if self.policy_class is not None:
                extra["eviction_policy"] = self.policy_class(**plug_in_arguments(c.policy))
            self.pool = self.pool_class(c.num_blocks, c.enable_caching, self.hash_block_size,
                                        enable_kv_cache_events=c.enable_events, **extra)
            return None
        pool = self.pool
        if isinstance(c, model.GetNewBlocks):
            return ids(pool.get_new_blocks(c.n))
        if isinstance(c, model.FreeBlocks):
            pool.free_blocks(self._block(i) for i in c.block_ids)
            return None
        if isinstance(c, model.Touch):
            blocks = [self._block(i) for i in c.block_ids]
            pool.touch(blocks if self.flat_touch else (blocks,))
            return None
        if isinstance(c, model.CacheFullBlocks):
            pool.cache_full_blocks(self._request(c), [self._block(i) for i in c.block_ids],
                                   c.num_cached, c.num_full, c.block_size, c.group_id)
            return None
        if isinstance(c, model.GetCachedBlock):
            return ids_or_none(pool.get_cached_block(c.block_hash, list(c.group_ids)))
        if isinstance(c, model.GetCachedPrefix):
            lookup = getattr(pool, "get_cached_prefix", None)
            if lookup is None:
                raise Unsupported("the pool has no bulk prefix lookup (vLLM's has none)")
            return ids(lookup(list(c.block_hashes), c.group_id, c.max_blocks))
        if isinstance(c, model.EvictBlocks):
            pool.evict_blocks(set(c.block_ids))
            return None
        if isinstance(c, model.ResetPrefixCache):
            return bool(pool.reset_prefix_cache())
        if isinstance(c, model.TakeEvents):
            return spec_events(pool.take_events())
        if isinstance(c, model.GetNumFreeBlocks):
            return int(pool.get_num_free_blocks())
        if isinstance(c, model.GetUsage):
            return float(pool.get_usage())
        if isinstance(c, model.POLICY_COMMANDS):
            perform_policy_command(pool, c)
            return None
        raise LookupError(f"not a pool command: {command!r}")

    def _block(self, block_id: int) -> Any:
        if 0 <= block_id < self.num_blocks:
            return self.pool.blocks[block_id]
        return self.block_class(block_id)  # a block this pool never made

    def _tokens(self, command: model.CacheFullBlocks) -> list[int]:
        """The request's tokens: the cached blocks' (never read) and the new blocks'."""
        return [0] * (command.num_cached * command.block_size) + list(command.token_ids)

    def _request(self, command: model.CacheFullBlocks) -> Any:
        """The stand-in request cache_full_blocks reads (a release may read more fields)."""
        return request_for(command.block_hashes, self._tokens(command), command.lora_id,
                           command.retention)

    def view(self) -> PoolView:
        return pool_view(self.pool)

    def check_representation(self) -> None:
        """The pool's own representation check, where it has one (impl's ``_check()``)."""
        check = getattr(self.pool, "_check", None)
        if check is not None:
            check()

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

    # -- the commands as calls on the pool's own API (counterexamples) -------------------

    def imports(self) -> list[str]:
        module_name, _, class_name = self.pool_path.partition(":")
        plug_in = []
        if self.policy_path is not None:
            policy_module, _, policy_class = self.policy_path.partition(":")
            plug_in = [f"from {policy_module} import {policy_class}"]
        return [f"from {module_name} import {class_name}", *plug_in,
                f"from {self.block_module} import KVCacheBlock",
                "from kvspec.spec.eviction import TokenRangeRetention",
                "from kvspec.conformance.targets import (PoolView, ids, ids_or_none, "
                "pool_view, request_for,\n    spec_events)",
                "from kvspec.spec.pool import Cleared, Removed, Stored"]

    def _block_source(self, block_id: int) -> str:
        if 0 <= block_id < self.num_blocks:
            return f"pool.blocks[{block_id}]"
        return f"KVCacheBlock({block_id})"

    def _blocks_source(self, block_ids: Sequence[int]) -> str:
        return "[" + ", ".join(self._block_source(i) for i in block_ids) + "]"

    def call_source(self, command: Any) -> str:
        c = command
        if isinstance(c, model.NewPool):
            self.num_blocks = c.num_blocks
            bound = ("" if c.max_pending_events is None
                     else f", max_pending_kv_events={c.max_pending_events}")
            if self.policy_path is not None:
                arguments = "".join(f"{k}={v!r}" for k, v in plug_in_arguments(c.policy).items())
                bound += f", eviction_policy={self.policy_path.partition(':')[2]}({arguments})"
            return (f"{self.pool_path.partition(':')[2]}({c.num_blocks}, {c.enable_caching}, "
                    f"{self.hash_block_size}, enable_kv_cache_events={c.enable_events}{bound})")
        if isinstance(c, model.GetNewBlocks):
            return f"pool.get_new_blocks({c.n})"
        if isinstance(c, model.FreeBlocks):
            return f"pool.free_blocks({self._blocks_source(c.block_ids)})"
        if isinstance(c, model.Touch):
            blocks = self._blocks_source(c.block_ids)
            return f"pool.touch({blocks if self.flat_touch else f'({blocks},)'})"
        if isinstance(c, model.CacheFullBlocks):
            hints = f", {list(c.retention)!r}" if c.retention else ""
            request = (f"request_for({list(c.block_hashes)!r}, {self._tokens(c)!r}, "
                       f"{c.lora_id!r}{hints})")
            return (f"pool.cache_full_blocks({request}, {self._blocks_source(c.block_ids)}, "
                    f"{c.num_cached}, {c.num_full}, {c.block_size}, {c.group_id})")
        if isinstance(c, model.GetCachedBlock):
            return f"pool.get_cached_block({c.block_hash!r}, {list(c.group_ids)!r})"
        if isinstance(c, model.GetCachedPrefix):
            return (f"pool.get_cached_prefix({list(c.block_hashes)!r}, {c.group_id}, "
                    f"{c.max_blocks})")
        if isinstance(c, model.EvictBlocks):
            return f"pool.evict_blocks({set(c.block_ids) or 'set()'})"
        if isinstance(c, model.ResetPrefixCache):
            return "pool.reset_prefix_cache()"
        if isinstance(c, model.TakeEvents):
            return "pool.take_events()"
        if isinstance(c, model.GetNumFreeBlocks):
            return "pool.get_num_free_blocks()"
        if isinstance(c, model.POLICY_COMMANDS):
            return policy_call_source("pool", c)
        return "pool.get_usage()"

    def output_source(self, command: Any, expression: str) -> str:
        if isinstance(command, (model.GetNewBlocks, model.GetCachedPrefix)):
            return f"ids({expression})"
        if isinstance(command, model.GetCachedBlock):
            return f"ids_or_none({expression})"
        if isinstance(command, model.TakeEvents):
            return f"spec_events({expression})"
        return expression

    def view_source(self) -> str:
        return "pool_view(pool)"

    def check_source(self) -> str | None:
        """The pool's own representation check, where its class has one."""
        return "pool._check()" if hasattr(self.pool_class, "_check") else None
