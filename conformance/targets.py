"""Pool adapters: how the checker performs `spec.pool`'s commands on a block pool.

A command speaks block ids; the adapter turns them into the target's block objects and turns
the target's state back into a `PoolView` (the abstraction function, `pool_view`).
`VllmApiPool` drives any class with vLLM 0.13's BlockPool API (kvspec's impl/, vLLM itself, a
fork); `vllm_targets.Vllm033Pool` drives 0.33's. Each adapter also writes a command as a call
on the pool's own API, for counterexamples (`lockstep.counterexample_source`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from kvspec.conformance import vllm_internals
from kvspec.conformance.lockstep import (
    NOTHING,
    Adapter,
    Arg,
    Call,
    Reader,
    Unsupported,
    method,
    representation_check_of,
)
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
    # vLLM 0.33's pool (empty for 0.13's): each block's partial entries (sorted: vLLM keeps
    # a set), the reuse watchers fired so far (watcher, block) and the batches of foreign
    # blocks handed to their owner.
    partial_keys: tuple[tuple[int, tuple[Key, ...]], ...] = ()
    fired: tuple[tuple[int, int], ...] = ()
    forwarded: tuple[tuple[int, ...], ...] = ()


def view_of(state: PoolState) -> PoolView:
    """The spec state as a target would show it."""
    return PoolView(state.ref, state.free, state.key_of, state.cached,
                    state.events[state.num_taken:], state.now, state.retention, state.pinned,
                    sorted_partials(state.partial_keys), state.fired, state.forwarded)


def sorted_partials(entries: Any) -> tuple[tuple[int, tuple[Key, ...]], ...]:
    """Partial entries per block, blocks and keys sorted (a set's order is no state)."""
    return tuple(sorted((int(b), tuple(sorted(keys))) for b, keys in entries if keys))


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


def plug_in_source(policy_path: str | None, policy: Any) -> str:
    """The ``eviction_policy=`` argument of a written constructor call ("" without one)."""
    if policy_path is None:
        return ""
    arguments = "".join(f"{k}={v!r}" for k, v in plug_in_arguments(policy).items())
    return f", eviction_policy={policy_path.partition(':')[2]}({arguments})"


def plug_in_imports(policy_path: str | None) -> list[str]:
    """The import line of a plug-in class, in a written counterexample."""
    if policy_path is None:
        return []
    module_name, _, name = policy_path.partition(":")
    return [f"from {module_name} import {name}"]


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
    # By name: vLLM's classes, or a release's own (impl's ``BlockStoredV033``, say).
    kind = type(event).__name__
    kind = next((name for name in ("BlockStored", "BlockRemoved", "AllBlocksCleared")
                 if kind.startswith(name)), kind)
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
        return [(k, ids(v)) for k, v in cache_map.items()]
    # vLLM's map cannot list itself (vllm_internals says why).
    return [(key, ids(blocks))
            for key, blocks in vllm_internals.block_hash_map_entries(cache_map)]


def pool_view(pool: Any) -> PoolView:
    """A BlockPool's state in the spec's terms (the abstraction function).

    vLLM 0.33 gives a block partial entries beside its primary key
    (``cached_block_hashes_by_block``): the view lists them (``partial_keys``).
    """
    blocks = list(pool.blocks)
    ref = tuple(0 if i == NULL_BLOCK else b.ref_cnt for i, b in enumerate(blocks))
    free = ids(pool.free_block_queue.get_all_free_blocks())
    key_of = tuple(b.block_hash for b in blocks)
    partial = sorted_partials(
        (getattr(pool, "cached_block_hashes_by_block", None) or {}).items())
    cached = tuple(sorted(_map_entries(pool)))
    pending = spec_events(getattr(pool, "kv_event_queue", []))
    return PoolView(ref, free, key_of, cached, pending, *policy_state(pool), partial)


def policy_state(pool: Any) -> tuple[int, tuple[tuple[int, int, int | None], ...],
                                     tuple[int, ...]]:
    """A pool's eviction-policy state as the views show it: the clock, the retention
    priorities, the pinned blocks (the defaults where the pool has no policy)."""
    policy = getattr(pool, "eviction_policy", None)
    if policy is None:
        return int(getattr(pool, "clock", 0)), (), ()
    return int(getattr(pool, "clock", 0)), tuple(policy.retention()), tuple(policy.pinned_ids())


def _policy_call(name: str, arguments: Callable[[Any, Any], tuple[object, ...]]) -> Call:
    """A policy call: `Unsupported` where the target lacks it."""
    call = method(name, arguments)

    def run(adapter: Any, command: Any) -> None:  # whatever the call returns, the spec's None
        if getattr(adapter.target, name, None) is None:
            raise Unsupported(f"the target has no {name}")
        call.run(adapter, command)

    return Call(run, call.write)


# `spec.pool.POLICY_COMMANDS` as calls on a target's policy API, which impl's pool and manager
# (and a pool claiming a policy) name alike: part of both adapters' tables.
POLICY_CALLS: dict[type, Call] = {
    model.SetRetention: _policy_call("set_retention", lambda a, c: (
        list(c.block_ids), c.priority, c.duration)),
    model.AdvanceClock: _policy_call("advance_clock", lambda a, c: (c.now,)),
    model.PinBlocks: _policy_call("pin_blocks", lambda a, c: (list(c.block_ids),)),
    model.UnpinBlocks: _policy_call("unpin_blocks", lambda a, c: (list(c.block_ids),)),
}

class ForeignOwner:
    """Another pool that owns some blocks (``KVCacheBlock.pool``): it records each batch a
    pool's free_blocks hands it, as block ids."""

    def __init__(self) -> None:
        self.batches: list[tuple[int, ...]] = []

    def free_blocks(self, blocks: Any) -> None:
        self.batches.append(ids(blocks))


def _unpin_with_watcher(adapter: VllmApiPool, c: model.UnpinWithWatcher) -> None:
    watcher = adapter.next_watcher
    fired = adapter.fired

    def on_reuse(block: Any) -> None:
        fired.append((watcher, block.block_id))

    adapter.pool.unpin_blocks([adapter.pool.blocks[i] for i in c.block_ids], on_reuse)
    adapter.next_watcher += 1  # only a call that went through registered its watcher


def _free_with_foreign(adapter: VllmApiPool, c: model.FreeWithForeign) -> None:
    try:
        foreign = [adapter.block_class(i, pool=adapter.foreign) for i in c.foreign_ids]
    except TypeError:
        raise Unsupported("the target's KVCacheBlock has no owning pool") from None
    adapter.pool.free_blocks([adapter._block(i) for i in c.block_ids] + foreign)


def _v033(name: str, call: Call) -> Call:
    """A call of vLLM 0.33's pool API: `Unsupported` where the target lacks the method (the
    machine only makes it where `VllmApiPool.has_method` says the target has it)."""
    def run(adapter: Any, command: Any) -> Any:
        if not adapter.has_method(name):
            raise Unsupported(f"the target has no {name}")
        return call.run(adapter, command)

    return Call(run, call.write, call.read)


def _partial_request(a: VllmApiPool, c: model.CachePartialBlock) -> Arg:
    tokens = [0] * (c.num_tokens - len(c.token_ids)) + list(c.token_ids)
    return Arg(f"request_for({list(c.block_hashes)!r}, {tokens!r}, {c.lora_id!r})",
               lambda: a.request_of(c.block_hashes, tokens, c.lora_id))


V0_33_CALLS: dict[type, Call] = {
    model.CachePartialBlock: _v033("cache_partial_block", method(
        "cache_partial_block", lambda a, c: (
            _partial_request(a, c), a.block_arg(c.block_id),
            c.num_tokens, c.group_id, c.block_size, c.replace_existing))),
    model.MoveBlockHashes: _v033("move_block_hashes", method(
        "move_block_hashes", lambda a, c: (a.block_arg(c.src),
                                           a.block_arg(c.dst)),
        NOTHING)),
    model.UnpinWithWatcher: _v033("cache_partial_block", Call(
        _unpin_with_watcher, lambda a, c: f"pool.unpin_blocks({a.blocks_arg(c.block_ids).source}"
        f", on_reuse)", NOTHING)),
    model.IsBlockWritable: _v033("is_block_writable", method(
        "is_block_writable", lambda a, c: (a.block_arg(c.block_id),),
        Reader(bool))),
    model.EmitCachedBlockEvents: _v033("emit_cached_block_events", method(
        "emit_cached_block_events", lambda a, c: (
            Arg(f"request_for({list(c.block_hashes)!r}, {list(c.token_ids)!r}, "
                f"{c.lora_id!r})",
                lambda: a.request_of(c.block_hashes, c.token_ids, c.lora_id)),
            c.num_cached, c.block_size, c.group_id), NOTHING)),
    model.FreeWithForeign: _v033("cache_partial_block", Call(
        _free_with_foreign, lambda a, c: f"pool.free_blocks(...{c})", NOTHING)),
}

IDS = Reader(ids, "ids({})")
EVENTS = Reader(spec_events, "spec_events({})")


def evicted_arg(block_ids: Sequence[int]) -> Arg:
    """The set of block ids evict_blocks takes."""
    return Arg(str(set(block_ids) or "set()"), lambda: set(block_ids))


def _new_pool(adapter: VllmApiPool, c: model.NewPool) -> None:
    adapter.num_blocks = c.num_blocks
    extra: dict[str, Any] = {} if c.max_pending_events is None else {
        "max_pending_kv_events": c.max_pending_events}
    if adapter.policy_class is not None:
        extra["eviction_policy"] = adapter.policy_class(**plug_in_arguments(c.policy))
    extra.update(adapter.pool_arguments)
    adapter.pool = adapter.pool_class(c.num_blocks, c.enable_caching, adapter.hash_block_size,
                                      enable_kv_cache_events=c.enable_events, **extra)


def _new_pool_source(adapter: VllmApiPool, c: model.NewPool) -> str:
    adapter.num_blocks = c.num_blocks
    bound = ("" if c.max_pending_events is None
             else f", max_pending_kv_events={c.max_pending_events}")
    bound += plug_in_source(adapter.policy_path, c.policy)
    bound += "".join(f", {k}={v!r}" for k, v in adapter.pool_arguments.items())
    return (f"{adapter.pool_path.partition(':')[2]}({c.num_blocks}, {c.enable_caching}, "
            f"{adapter.hash_block_size}, enable_kv_cache_events={c.enable_events}{bound})")


def _get_cached_prefix(adapter: VllmApiPool, c: model.GetCachedPrefix) -> Any:
    lookup = getattr(adapter.pool, "get_cached_prefix", None)
    if lookup is None:
        raise Unsupported("the pool has no bulk prefix lookup (vLLM's has none)")
    return lookup(list(c.block_hashes), c.group_id, c.max_blocks)


class VllmApiPool(Adapter):
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
                 hash_block_size: int = 2, policy_path: str | None = None,
                 pool_arguments: dict[str, Any] | None = None) -> None:
        self.policy_path = policy_path
        # Keyword arguments the pool is built with besides the command's (impl's
        # ``vllm_api="0.33"``, say).
        self.pool_arguments: dict[str, Any] = dict(pool_arguments or {})
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
        # vLLM 0.33: the reuse watchers fired (watcher, block), the next watcher's number,
        # and the foreign pool that owns the blocks of FreeWithForeign.
        self.fired: list[tuple[int, int]] = []
        self.next_watcher = 0
        self.foreign = ForeignOwner()

    # -- the commands: how each runs on the pool, and is written as a call ------------------

    calls: ClassVar[dict[type, Call]] = {
        model.NewPool: Call(_new_pool, _new_pool_source),
        model.GetNewBlocks: method("get_new_blocks", lambda a, c: (c.n,), IDS),
        # free_blocks is given a generator, as vLLM's callers give it
        model.FreeBlocks: method("free_blocks", lambda a, c: (a.blocks_arg(c.block_ids, iter),),
                                 NOTHING),
        model.Touch: method("touch", lambda a, c: (a.touch_arg(c.block_ids),), NOTHING),
        model.CacheFullBlocks: method("cache_full_blocks", lambda a, c: (
            Arg(a.request_source(c), lambda: a.request(c)), a.blocks_arg(c.block_ids),
            c.num_cached, c.num_full, c.block_size, c.group_id), NOTHING),
        model.GetCachedBlock: method("get_cached_block",
                                     lambda a, c: (c.block_hash, list(c.group_ids)),
                                     Reader(ids_or_none, "ids_or_none({})")),
        model.GetCachedPrefix: Call(_get_cached_prefix, method(
            "get_cached_prefix", lambda a, c: (list(c.block_hashes), c.group_id,
                                               c.max_blocks)).write, IDS),
        model.EvictBlocks: method("evict_blocks", lambda a, c: (evicted_arg(c.block_ids),),
                                  NOTHING),
        model.ResetPrefixCache: method("reset_prefix_cache", read=Reader(bool)),
        model.TakeEvents: method("take_events", read=EVENTS),
        model.GetNumFreeBlocks: method("get_num_free_blocks", read=Reader(int)),
        model.GetUsage: method("get_usage", read=Reader(float)),
        **POLICY_CALLS,
        **V0_33_CALLS,
    }

    def _block(self, block_id: int) -> Any:
        if 0 <= block_id < self.num_blocks:
            return self.pool.blocks[block_id]
        return self.block_class(block_id)  # a block this pool never made

    def _block_source(self, block_id: int) -> str:
        if 0 <= block_id < self.num_blocks:
            return f"pool.blocks[{block_id}]"
        return f"KVCacheBlock({block_id})"

    def blocks_arg(self, block_ids: Sequence[int],
                   collect: Callable[[Iterator[Any]], Any] = list) -> Arg:
        """The blocks of block_ids (foreign ones for ids outside the pool), collected."""
        source = "[" + ", ".join(self._block_source(i) for i in block_ids) + "]"
        return Arg(source, lambda: collect(self._block(i) for i in block_ids))

    def block_arg(self, block_id: int) -> Arg:
        """One block of the pool (a foreign one for an id outside it)."""
        return Arg(self._block_source(block_id), lambda: self._block(block_id))

    def touch_arg(self, block_ids: Sequence[int]) -> Arg:
        """touch's argument: a tuple of per-group block lists (0.13), or a flat list."""
        blocks = self.blocks_arg(block_ids)
        if self.flat_touch:
            return blocks
        return Arg(f"({blocks.source},)", lambda: (blocks.get(),))

    def tokens(self, command: model.CacheFullBlocks) -> list[int]:
        """The request's tokens: the cached blocks' (never read) and the new blocks'."""
        return [0] * (command.num_cached * command.block_size) + list(command.token_ids)

    def has_method(self, name: str) -> bool:
        """Whether the pool has vLLM 0.33's method ``name`` (``unpin_blocks`` and
        ``free_blocks`` forwarding go with ``cache_partial_block``: kvspec's own
        ``unpin_blocks`` is the pin policy's). The built pool's class is asked where there is
        one: impl's ``BlockPool(..., vllm_api="0.33")`` builds another class than its own."""
        owner = self.pool_class if self.pool is None else type(self.pool)
        return callable(getattr(owner, name, None))

    def request_of(self, block_hashes: Sequence[bytes], token_ids: Sequence[int],
                   lora_id: int | None) -> Any:
        """A stand-in request with these hashes and tokens (this API's request class)."""
        return request_for(block_hashes, token_ids, lora_id)

    def request(self, command: model.CacheFullBlocks) -> Any:
        """The stand-in request cache_full_blocks reads (a release may read more fields)."""
        return request_for(command.block_hashes, self.tokens(command), command.lora_id,
                           command.retention)

    def request_source(self, command: model.CacheFullBlocks) -> str:
        hints = f", {list(command.retention)!r}" if command.retention else ""
        return (f"request_for({list(command.block_hashes)!r}, {self.tokens(command)!r}, "
                f"{command.lora_id!r}{hints})")

    def view(self) -> PoolView:
        view = pool_view(self.pool)
        if self.fired or self.foreign.batches:
            view = replace(view, fired=tuple(self.fired),
                           forwarded=tuple(self.foreign.batches))
        return view

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
        return [f"from {module_name} import {class_name}", *plug_in_imports(self.policy_path),
                f"from {self.block_module} import KVCacheBlock",
                "from kvspec.spec.eviction import TokenRangeRetention",
                "from kvspec.conformance.targets import (PoolView, ids, ids_or_none, "
                "pool_view, request_for,\n    spec_events)",
                "from kvspec.spec.pool import Cleared, Removed, Stored"]

    def view_source(self) -> str:
        return "pool_view(pool)"

    def check_source(self) -> str | None:
        """The pool's own representation check, where its class has one."""
        check = representation_check_of(self.pool_class)
        return None if check is None else f"pool.{check}()"
