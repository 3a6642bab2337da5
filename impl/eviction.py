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
A third party writes its own by subclassing `EvictionPolicy` and overriding its hooks;
``kvspec audit --target module:Class --policy NAME`` checks it against the spec.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvspec.impl.errors import BlockPoolError

if TYPE_CHECKING:
    from kvspec.impl.block_pool import BlockPool
    from kvspec.impl.kv_cache_utils import KVCacheBlock

MIN_PRIORITY = 0
MAX_PRIORITY = 100
DEFAULT_PRIORITY = 35
UNCACHED_PRIORITY = -1  # a free block without a key holds nothing worth keeping

POLICY_NAMES = ("lru", "lru-lifo-unhashed", "priority", "pinned")


class PolicyNotSupportedError(BlockPoolError, ValueError):
    """A policy operation the pool's eviction policy does not have (pinning under lru)."""


class InvalidRetentionError(BlockPoolError, ValueError):
    """A retention hint or priority that cannot be honoured."""


class BlockNotCachedError(BlockPoolError, LookupError):
    """A retention priority or a pin asked for a block without a key."""


class ClockWentBackError(BlockPoolError, ValueError):
    """advance_clock to a time before the pool's."""


class PinRefusedError(BlockPoolError, ValueError):
    """A pin over the cap, a block pinned twice, or evicting or freeing what a pin holds."""


class BlockNotPinnedError(BlockPoolError, LookupError):
    """unpin of a block that is not pinned."""


@dataclass(frozen=True)
class TokenRangeRetention:
    """A request's retention hint (``request.kv_retention``, a list of them): tokens
    [start, end) (end None: to the end) are worth ``priority`` for ``duration`` time units
    after they are cached (None: until evicted). TensorRT-LLM's TokenRangeRetentionConfig."""

    start: int
    end: int | None
    priority: int
    duration: int | None = None


def check_retention(start: object, end: object, priority: object, duration: object) -> None:
    """Refuse a hint that cannot be honoured, naming the value."""
    if type(priority) is not int or not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise InvalidRetentionError(f"retention priority must be an int in [{MIN_PRIORITY}, "
                                    f"{MAX_PRIORITY}], got {priority!r}")
    if duration is not None and (type(duration) is not int or duration < 1):
        raise InvalidRetentionError(
            f"retention duration must be None or an int >= 1, got {duration!r}")
    if type(start) is not int or start < 0 or (
            end is not None and (type(end) is not int or end < start)):
        raise InvalidRetentionError(
            f"retention token range [{start!r}, {end!r}) is not a range of token positions")


class EvictionPolicy:
    """The hooks a BlockPool calls; the base class is LRU (vLLM 0.13). Every hook is called
    only after the pool has checked its arguments, but `check_free`, `check_evict` and
    `check_hints`, which may refuse, before anything changes."""

    name = "lru"
    has_priorities = False
    has_pins = False

    def __init__(self) -> None:
        self.pool: BlockPool | None = None
        self.pinned: set[KVCacheBlock] = set()  # kept by a policy with pins

    @property
    def cap(self) -> int:
        """How many blocks may be pinned at once (none without pins)."""
        return 0

    def set(self, block: KVCacheBlock, priority: int, duration: int | None) -> None:
        """A cached block's retention priority, checked by the pool (a policy with
        priorities keeps it)."""

    def attach(self, pool: BlockPool) -> None:
        """Called once, by the pool's constructor, when every block is free."""
        if self.pool is not None:
            raise PolicyNotSupportedError(
                f"this {self.name} policy object already serves a pool: give each its own")
        self.pool = pool

    def _pool(self) -> BlockPool:
        pool = self.pool
        if pool is None:
            raise PolicyNotSupportedError(f"the {self.name} policy serves no pool yet")
        return pool

    def take(self, n: int) -> list[KVCacheBlock]:
        """Take the n blocks to reuse out of the free queue (n <= free blocks)."""
        return self._pool().free_block_queue._take(n)

    def freed(self, blocks: list[KVCacheBlock]) -> None:
        """Blocks that reached ref 0, in that order, join the free queue."""
        self._pool().free_block_queue._extend(blocks)

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
        """The policy's representation invariant (``BlockPool._check()`` calls it)."""

    def retention(self) -> tuple[tuple[int, int, int | None], ...]:
        """The retention entries that are not the default, (block id, priority, expires at),
        sorted: the policy's state in the spec's terms."""
        return ()

    def pinned_ids(self) -> tuple[int, ...]:
        """The pinned block ids, sorted."""
        return ()

    def advance_clock(self, now: int) -> None:
        """The pool's clock moved to ``now`` (``pool._now``, already set)."""


class LruLifoUnhashed(EvictionPolicy):
    """vLLM 0.33: a block freed without a key (or with caching off) is reused first."""

    name = "lru-lifo-unhashed"

    def freed(self, blocks: list[KVCacheBlock]) -> None:
        pool = self._pool()
        queue = pool.free_block_queue
        if not pool.enable_caching:
            queue._prepend(blocks)
            return
        key_of = pool._key_of
        unkeyed = [b for b in blocks if b not in key_of]
        if unkeyed:
            queue._prepend(unkeyed)
            if len(unkeyed) < len(blocks):
                queue._extend([b for b in blocks if b in key_of])
        else:
            queue._extend(blocks)


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
        if block not in pool._key_of:
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
        if entry is not None and block not in self._pool()._in_use:
            self._push(block, entry[1])

    def attach(self, pool: BlockPool) -> None:
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
        heap, entry, in_use = self._heap, self._entry, pool._in_use
        chosen: list[KVCacheBlock] = []
        while len(chosen) < n:
            worth, stamp, block_id = heapq.heappop(heap)
            block = pool._block(block_id)
            if entry.get(block) == (worth, stamp) and block not in in_use:
                del entry[block]
                chosen.append(block)
        queue._remove_free(chosen)
        return chosen

    def freed(self, blocks: list[KVCacheBlock]) -> None:
        pool = self._pool()
        queue = pool.free_block_queue
        queue._extend(blocks)
        for block in blocks:
            self._stamp += 1
            self._push(block, self._stamp)
        if len(self._heap) > 2 * queue.num_free_blocks + 64:
            self._heap = [(w, s, b.block_id) for b, (w, s) in self._entry.items()
                          if b not in pool._in_use]
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
            check_retention(getattr(hint, "start", None), getattr(hint, "end", None),
                            getattr(hint, "priority", None), getattr(hint, "duration", None))
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
            expires = None if duration is None else self._pool()._now + duration
            self._priority[block] = (priority, expires)
            if expires is not None:
                heapq.heappush(self._expiries, (expires, block.block_id, priority))
        self._rekey(block)

    def advance_clock(self, now: int) -> None:
        pool = self._pool()
        expiries, priorities = self._expiries, self._priority
        while expiries and expiries[0][0] <= now:
            expires, block_id, priority = heapq.heappop(expiries)
            block = pool._block(block_id)
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
            if block not in pool._key_of:
                raise AssertionError(f"priority policy: block {block.block_id} has a "
                                     f"priority but no key")
            if expires is not None and expires <= pool._now:
                raise AssertionError(f"priority policy: block {block.block_id} keeps a "
                                     f"priority that expired at {expires} (now {pool._now})")
        for block in self._entry:
            if block in pool._in_use:
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
        pool = self._pool()
        listings = Counter(b for b in blocks if b in pinned)  # one pass, not one per block
        for block, count in listings.items():
            if pool._ref_count(block) - count < 1:
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
            if block not in pool._key_of or block not in pool._in_use:
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

