"""Eviction policies: a plug-in a BlockPool (and a KVCacheManager) takes at construction.

``BlockPool(..., eviction_policy=None)`` is vLLM 0.13's pool, at its speed: the policy hooks
are behind one ``is None`` test per call. A policy object decides which free block goes next
and where a freed block goes; the pool keeps everything else (ref counts, keys, events), and
its free queue always holds every free block in the order they became free, so a policy
never has to re-implement the pool. The spec of each is ``spec/eviction.py``.

- `LruLifoUnhashed` (``lru-lifo-unhashed``, vLLM 0.33): blocks freed without a key go to the
  head of the free queue, to be reused first.
- `PriorityPolicy` (``priority``): cached blocks carry a retention priority in [0, 100]
  (default 35) with an optional expiry; the lowest goes first, LRU within a priority, a free
  block without a key before any cached one. Priorities come from the request's
  ``kv_retention`` hints (`TokenRangeRetention`) when its blocks are cached, or from
  ``BlockPool.set_retention``; ``BlockPool.advance_clock(now)`` makes them expire.
- `PinnedPolicy` (``pinned``): LRU, and ``BlockPool.pin_blocks`` pins cached blocks (the pin
  holds a reference: the block is never free, never evicted) up to ``max_pinned_share`` of
  the pool.

A policy object serves one pool. `make_policy(name)` builds one by name (None for ``lru``).

Writing a policy
----------------
The policy API is public: a third party writes its own policy by subclassing
`EvictionPolicy` and overriding its hooks (``take``, ``freed``, ...), reading the pool only
through `PolicyPool` and moving free blocks only through `PolicyQueue`, the two protocols
below; tests/example_policy.py is one, written against nothing else. ``kvspec audit --target
module:Class --policy NAME`` checks it against the spec of the policy it claims
(docs/policies.md).

The contract, in one place:

* The pool keeps every block's ref count, key and events; its free queue
  (``pool.free_block_queue``) holds exactly the free blocks (ref count 0, never the null
  block). A policy decides only the order: which free blocks ``take(n)`` hands out, and
  where ``freed(blocks)`` puts blocks that just became free.
* ``take(n)`` must take exactly ``n`` free blocks out of the queue (``take_unchecked`` or
  ``remove_unchecked``) and return them; ``freed(blocks)`` must put every one of ``blocks``
  into it (``extend_unchecked`` or ``prepend_unchecked``), each once.
* Every hook runs after the pool checked its arguments; ``check_free``, ``check_evict`` and
  ``check_hints`` may refuse (a ``BlockPoolError``), and run before anything changes.
* ``check()`` is the policy's own representation invariant (the pool's
  ``check_representation()`` calls it; raise ``AssertionError``).

This module sits below impl/block_pool.py (it imports only the blocks and the free queue of
impl/kv_cache_utils.py): the pool implements `PolicyPool`.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Collection, Sequence, Set as AbstractSet
from dataclasses import dataclass
from typing import Any, Protocol, SupportsIndex

from kvspec.impl.checks import as_int
from kvspec.impl.errors import (
    BlockNotCachedError as BlockNotCachedError,
    BlockNotPinnedError as BlockNotPinnedError,
    ClockWentBackError as ClockWentBackError,
    InvalidRetentionError as InvalidRetentionError,
    PinRefusedError as PinRefusedError,
    PolicyNotSupportedError as PolicyNotSupportedError,
)
from kvspec.impl.kv_cache_utils import KVCacheBlock

MIN_PRIORITY = 0
MAX_PRIORITY = 100
DEFAULT_PRIORITY = 35
UNCACHED_PRIORITY = -1  # a free block without a key holds nothing worth keeping

POLICY_NAMES = ("lru", "lru-lifo-unhashed", "priority", "pinned")


class PolicyQueue(Protocol):
    """What an eviction policy may do to its pool's free queue (impl's
    ``FreeKVCacheBlockQueue``): read it, and move blocks in and out of it unchecked. The policy
    guarantees what each move says it takes (the pool does not check a policy's moves; its
    ``check_representation()`` finds a broken promise)."""

    @property
    def num_free_blocks(self) -> int:
        """How many blocks are free."""
        ...

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Every free block, head (reused first under LRU) first; O(free)."""
        ...

    def take_unchecked(self, n: int) -> list[KVCacheBlock]:
        """The first ``n`` free blocks, out of the queue (0 <= n <= num_free_blocks)."""
        ...

    def remove_unchecked(self, blocks: list[KVCacheBlock]) -> None:
        """Take these free blocks (each in the queue, listed once) out of it."""
        ...

    def extend_unchecked(self, blocks: list[KVCacheBlock]) -> None:
        """Put blocks that are out of the queue (each listed once) at its tail, in order."""
        ...

    def prepend_unchecked(self, blocks: list[KVCacheBlock]) -> None:
        """Put blocks that are out of the queue (each listed once) at its head, in order."""
        ...


class PolicyPool(Protocol):
    """What an eviction policy may read of the pool it serves (impl's ``BlockPool``). Views
    are live and read-only: the pool changes them, the policy never does."""

    @property
    def num_gpu_blocks(self) -> int:
        """How many blocks the pool has, the null block (id 0) included."""
        ...

    @property
    def enable_caching(self) -> bool:
        """Whether the pool keys blocks (prefix caching)."""
        ...

    @property
    def null_block(self) -> KVCacheBlock:
        """The null block: never free, never in use, never keyed."""
        ...

    @property
    def blocks(self) -> Sequence[KVCacheBlock]:
        """Block ``i`` of the pool is ``blocks[i]``."""
        ...

    @property
    def free_block_queue(self) -> PolicyQueue:
        """The free blocks, in the order the policy keeps them."""
        ...

    @property
    def cached_blocks(self) -> Collection[KVCacheBlock]:
        """The blocks that have a key (a prefix-cache entry)."""
        ...

    @property
    def blocks_in_use(self) -> AbstractSet[KVCacheBlock]:
        """The blocks of ref count >= 1 (each block's count is its ``ref_cnt``)."""
        ...

    @property
    def clock(self) -> int:
        """The policies' time: what the last ``advance_clock`` set (0 at first)."""
        ...


@dataclass(frozen=True)
class TokenRangeRetention:
    """A request's retention hint (``request.kv_retention``, a list of them): tokens
    [start, end) (end None: to the end) are worth ``priority`` for ``duration`` time units
    after they are cached (None: until evicted). TensorRT-LLM's TokenRangeRetentionConfig."""

    start: int
    end: int | None
    priority: int
    duration: int | None = None


def check_retention(
    start: SupportsIndex, end: SupportsIndex | None, priority: SupportsIndex,
    duration: SupportsIndex | None,
) -> tuple[int, int | None, int, int | None]:
    """A hint's (start, end, priority, duration) as plain ints (impl's integer rule: an int or
    a numpy integer, never a bool), or a refusal of one that cannot be honoured, naming it."""
    checked_priority = as_int(priority)
    if checked_priority is None or not MIN_PRIORITY <= checked_priority <= MAX_PRIORITY:
        raise InvalidRetentionError(f"retention priority must be an int in [{MIN_PRIORITY}, "
                                    f"{MAX_PRIORITY}], got {priority!r}")
    checked_duration = None if duration is None else as_int(duration)
    if duration is not None and (checked_duration is None or checked_duration < 1):
        raise InvalidRetentionError(
            f"retention duration must be None or an int >= 1, got {duration!r}")
    checked_start = as_int(start)
    checked_end = None if end is None else as_int(end)
    if checked_start is None or checked_start < 0 or (end is not None and (
            checked_end is None or checked_end < checked_start)):
        raise InvalidRetentionError(
            f"retention token range [{start!r}, {end!r}) is not a range of token positions")
    return checked_start, checked_end, checked_priority, checked_duration


class EvictionPolicy:
    """The hooks a BlockPool calls; the base class is LRU (vLLM 0.13), and the public API a
    third-party policy subclasses (the module docstring states the contract).

    Every hook is called only after the pool has checked its arguments, but `check_free`,
    `check_evict` and `check_hints`, which may refuse, before anything changes. A policy
    reads its pool (``self.pool``, set by `attach`) through `PolicyPool` only and moves free
    blocks through `PolicyQueue` only. ``name`` names it in messages; ``has_priorities`` and
    ``has_pins`` turn on the pool's ``set_retention`` and ``pin_blocks``."""

    name = "lru"
    has_priorities = False
    has_pins = False

    def __init__(self) -> None:
        self.pool: PolicyPool | None = None
        self.pinned: set[KVCacheBlock] = set()  # kept by a policy with pins

    @property
    def cap(self) -> int:
        """How many blocks may be pinned at once (none without pins)."""
        return 0

    def set(self, block: KVCacheBlock, priority: int, duration: int | None) -> None:
        """A cached block's retention priority, checked by the pool (a policy with
        priorities keeps it)."""

    def attach(self, pool: PolicyPool) -> None:
        """Called once, by the pool's constructor, when every block is free."""
        if self.pool is not None:
            raise PolicyNotSupportedError(
                f"this {self.name} policy object already serves a pool: give each its own")
        self.pool = pool

    def _pool(self) -> PolicyPool:
        pool = self.pool
        if pool is None:
            raise PolicyNotSupportedError(f"the {self.name} policy serves no pool yet")
        return pool

    def take(self, n: int) -> list[KVCacheBlock]:
        """Take the n blocks to reuse out of the free queue (n <= free blocks)."""
        return self._pool().free_block_queue.take_unchecked(n)

    def freed(self, blocks: list[KVCacheBlock]) -> None:
        """Blocks that reached ref 0, in that order, join the free queue."""
        self._pool().free_block_queue.extend_unchecked(blocks)

    def check_free(self, blocks: list[KVCacheBlock]) -> None:
        """Refuse a free_blocks call before anything changes (pins: their own reference)."""

    def check_evict(self, blocks: list[KVCacheBlock]) -> None:
        """Refuse an evict_blocks call before anything changes (pinned blocks)."""

    def check_hints(self, request: object) -> list[TokenRangeRetention] | None:
        """The request's hints, checked, where the policy reads them (None: it does not)."""
        return None

    def cached(self, hints: list[TokenRangeRetention], blocks: Sequence[KVCacheBlock],
               first: int, block_size: int) -> None:
        """blocks[i] (block index first + i of its request; the null block skipped) just
        got its key."""

    def uncached(self, blocks: list[KVCacheBlock]) -> None:
        """These blocks just lost their keys (evicted, or a KV connector's evict_blocks)."""

    def reset(self) -> None:
        """reset_prefix_cache forgot every key."""

    def check(self) -> None:
        """The policy's representation invariant (``BlockPool.check_representation()`` calls
        it); raises ``AssertionError`` naming what is broken."""

    def retention(self) -> tuple[tuple[int, int, int | None], ...]:
        """The retention entries that are not the default, (block id, priority, expires at),
        sorted: the policy's state in the spec's terms."""
        return ()

    def pinned_ids(self) -> tuple[int, ...]:
        """The pinned block ids, sorted."""
        return ()

    def advance_clock(self, now: int) -> None:
        """The pool's clock moved to ``now`` (``pool.clock``, already set)."""


class LruLifoUnhashed(EvictionPolicy):
    """vLLM 0.33: a block freed without a key (or with caching off) is reused first."""

    name = "lru-lifo-unhashed"

    def freed(self, blocks: list[KVCacheBlock]) -> None:
        pool = self._pool()
        queue = pool.free_block_queue
        if not pool.enable_caching:
            queue.prepend_unchecked(blocks)
            return
        cached = pool.cached_blocks
        unkeyed = [b for b in blocks if b not in cached]
        if unkeyed:
            queue.prepend_unchecked(unkeyed)
            if len(unkeyed) < len(blocks):
                queue.extend_unchecked([b for b in blocks if b in cached])
        else:
            queue.extend_unchecked(blocks)


class PriorityPolicy(EvictionPolicy):
    """TensorRT-LLM's prioritised LRU, over the pool's free queue.

    The trick: free blocks sit in one heap of ``(worth, stamp, block id)``, where ``stamp``
    counts frees (so within one worth the heap is LRU). An entry is current only while
    ``_entry[block]`` is that very ``(worth, stamp)`` and the block is still free: a block
    touched, re-stamped or re-prioritised leaves its old entry behind, skipped when popped,
    and the heap is rebuilt from the current entries when it grows past twice the free
    blocks. Expiries wait in a second heap, popped by ``advance_clock``.
    """

    name = "priority"
    has_priorities = True

    def __init__(self) -> None:
        super().__init__()
        self._priority: dict[KVCacheBlock, tuple[int, int | None]] = {}  # not the default
        self._heap: list[tuple[int, int, int]] = []
        self._entry: dict[KVCacheBlock, tuple[int, int]] = {}  # free block -> current entry
        self._expiries: list[tuple[int, int, int]] = []  # (expires at, block id, priority)
        self._stamp = 0

    def _worth(self, block: KVCacheBlock) -> int:
        pool = self._pool()
        if block not in pool.cached_blocks:
            return UNCACHED_PRIORITY
        found = self._priority.get(block)
        return DEFAULT_PRIORITY if found is None else found[0]

    def _push(self, block: KVCacheBlock, stamp: int) -> None:
        worth = self._worth(block)
        self._entry[block] = (worth, stamp)
        heapq.heappush(self._heap, (worth, stamp, block.block_id))

    def _rekey(self, block: KVCacheBlock) -> None:
        """A free block's worth changed: a new entry at its old stamp (its LRU place)."""
        entry = self._entry.get(block)
        if entry is not None and block not in self._pool().blocks_in_use:
            self._push(block, entry[1])

    def attach(self, pool: PolicyPool) -> None:
        """Every block is free, in id order: stamp them (this makes the pool's block
        objects, which an lru pool makes lazily)."""
        super().attach(pool)
        for block in pool.free_block_queue.get_all_free_blocks():
            self._stamp += 1
            self._push(block, self._stamp)

    def take(self, n: int) -> list[KVCacheBlock]:
        pool = self._pool()
        if n == 0:
            return []
        queue = pool.free_block_queue
        heap, entry, in_use, blocks = self._heap, self._entry, pool.blocks_in_use, pool.blocks
        chosen: list[KVCacheBlock] = []
        while len(chosen) < n:
            worth, stamp, block_id = heapq.heappop(heap)
            block = blocks[block_id]
            if entry.get(block) == (worth, stamp) and block not in in_use:
                del entry[block]
                chosen.append(block)
        queue.remove_unchecked(chosen)
        return chosen

    def freed(self, blocks: list[KVCacheBlock]) -> None:
        pool = self._pool()
        queue = pool.free_block_queue
        queue.extend_unchecked(blocks)
        for block in blocks:
            self._stamp += 1
            self._push(block, self._stamp)
        if len(self._heap) > 2 * queue.num_free_blocks + 64:
            in_use = pool.blocks_in_use
            self._heap = [(w, s, b.block_id) for b, (w, s) in self._entry.items()
                          if b not in in_use]
            heapq.heapify(self._heap)

    def check_hints(self, request: object) -> list[TokenRangeRetention] | None:
        hints = getattr(request, "kv_retention", None)
        if not hints:
            return None
        try:
            listed = list(hints)
        except TypeError:
            raise InvalidRetentionError(
                f"kv_retention must be a list of TokenRangeRetention, got {hints!r}") from None
        for hint in listed:
            read: list[Any] = [getattr(hint, field, None)
                               for field in ("start", "end", "priority", "duration")]
            check_retention(*read)
        return listed

    def cached(self, hints: list[TokenRangeRetention], blocks: Sequence[KVCacheBlock],
               first: int, block_size: int) -> None:
        null = self._pool().null_block
        for offset, block in enumerate(blocks):
            if block is null:
                continue
            start = (first + offset) * block_size
            end = start + block_size
            best: TokenRangeRetention | None = None
            for hint in hints:
                if hint.start < end and (hint.end is None or hint.end > start) and (
                        best is None or hint.priority > best.priority):
                    best = hint
            if best is not None:
                self.set(block, best.priority, best.duration)

    def set(self, block: KVCacheBlock, priority: int, duration: int | None) -> None:
        """A cached block's retention priority (checked by the caller)."""
        if priority == DEFAULT_PRIORITY and duration is None:
            self._priority.pop(block, None)
        else:
            expires = None if duration is None else self._pool().clock + duration
            self._priority[block] = (priority, expires)
            if expires is not None:
                heapq.heappush(self._expiries, (expires, block.block_id, priority))
        self._rekey(block)

    def advance_clock(self, now: int) -> None:
        pool = self._pool()
        expiries, priorities = self._expiries, self._priority
        while expiries and expiries[0][0] <= now:
            expires, block_id, priority = heapq.heappop(expiries)
            block = pool.blocks[block_id]
            if priorities.get(block) == (priority, expires):  # not since replaced or dropped
                del priorities[block]
                self._rekey(block)

    def uncached(self, blocks: list[KVCacheBlock]) -> None:
        priorities = self._priority
        for block in blocks:
            priorities.pop(block, None)
            self._rekey(block)  # a free block without a key goes first

    def reset(self) -> None:
        """Every block is free and now unkeyed: each keeps its stamp, at the lowest worth."""
        self._priority.clear()
        self._expiries.clear()
        entry = self._entry
        for block, (_, stamp) in entry.items():
            entry[block] = (UNCACHED_PRIORITY, stamp)
        self._heap = [(UNCACHED_PRIORITY, stamp, b.block_id) for b, (_, stamp) in entry.items()]
        heapq.heapify(self._heap)

    def check(self) -> None:
        pool = self._pool()
        for block, (_, expires) in self._priority.items():
            if block not in pool.cached_blocks:
                raise AssertionError(f"priority policy: block {block.block_id} has a "
                                     f"priority but no key")
            if expires is not None and expires <= pool.clock:
                raise AssertionError(f"priority policy: block {block.block_id} keeps a "
                                     f"priority that expired at {expires} (now {pool.clock})")
        for block in self._entry:
            if block in pool.blocks_in_use:
                continue
            worth, _ = self._entry[block]
            if worth != self._worth(block):
                raise AssertionError(f"priority policy: free block {block.block_id} is "
                                     f"queued at worth {worth}, not {self._worth(block)}")

    def retention(self) -> tuple[tuple[int, int, int | None], ...]:
        return tuple(sorted((b.block_id, p, e) for b, (p, e) in self._priority.items()))


class PinnedPolicy(EvictionPolicy):
    """LRU with pins: a pinned block holds one reference of the pool's own."""

    name = "pinned"
    has_pins = True

    def __init__(self, max_pinned_share: float = 0.25) -> None:
        super().__init__()
        if type(max_pinned_share) not in (int, float) or not 0 <= max_pinned_share <= 1:
            raise InvalidRetentionError(
                f"max_pinned_share must be a number in [0, 1], got {max_pinned_share!r}")
        self.max_pinned_share = float(max_pinned_share)

    @property
    def cap(self) -> int:
        return int(self.max_pinned_share * (self._pool().num_gpu_blocks - 1))

    def check_free(self, blocks: list[KVCacheBlock]) -> None:
        pinned = self.pinned
        if not pinned or pinned.isdisjoint(blocks):
            return
        listings = Counter(b for b in blocks if b in pinned)  # one pass, not one per block
        for block, count in listings.items():
            if block.ref_cnt - count < 1:
                raise PinRefusedError(
                    f"block {block.block_id} is held only by its pin: unpin it instead")

    def check_evict(self, blocks: list[KVCacheBlock]) -> None:
        for block in blocks:
            if block in self.pinned:
                raise PinRefusedError(
                    f"block {block.block_id} is pinned: unpin it before evicting it")

    def check(self) -> None:
        pool = self._pool()
        for block in self.pinned:
            if block not in pool.cached_blocks or block not in pool.blocks_in_use:
                raise AssertionError(f"pinned policy: pinned block {block.block_id} is "
                                     f"not cached and in use")

    def pinned_ids(self) -> tuple[int, ...]:
        return tuple(sorted(b.block_id for b in self.pinned))


def make_policy(name: str, *, max_pinned_share: float = 0.25) -> EvictionPolicy | None:
    """The policy called ``name``: None for ``lru`` (vLLM 0.13's pool, its fast path)."""
    if name == "lru":
        return None
    if name == "lru-lifo-unhashed":
        return LruLifoUnhashed()
    if name == "priority":
        return PriorityPolicy()
    if name == "pinned":
        return PinnedPolicy(max_pinned_share)
    raise PolicyNotSupportedError(
        f"no eviction policy {name!r}: the policies are {', '.join(POLICY_NAMES)}")

