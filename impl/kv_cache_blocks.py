"""KV-cache blocks, their owner seam and the free-block queue (``kv_cache_utils`` re-exports them).

Why a module of their own
-------------------------
vLLM's names for these classes are in ``vllm.v1.core.kv_cache_utils``, and kvspec's
``kv_cache_utils`` re-exports them from here. vLLM's own tests ``importlib.reload`` that module
(``test_none_hash``); a reload re-executes a module's source in its old namespace, so a class
defined there would become a new class object, and every block made before the reload would
then fail the new class's ``isinstance`` checks (the old class's methods read the module's
globals, which now name the new class). Nothing reloads this module, so ``KVCacheBlock`` is the
same class before and after a reload of ``kv_cache_utils``, in both builds: the pure-Python
build re-executes ``kv_cache_utils`` (re-importing these same objects), and the compiled build
compiles this module, not ``kv_cache_utils``.

The fast free queue
-------------------
vLLM links every block into an intrusive doubly linked list: one Python object and two
pointers per block, walked one block at a time. Here the free order is a plain list of
block objects read from a head index, so a request's blocks move in and out with single
C-level slice and extend calls:

* ``_entries[_head:]`` is the free order after the *fresh run* (see below); appends go to
  the tail with one ``extend``, allocations take a slice from the head.
* ``remove(block)`` (a cache hit on a free block) is lazy: the block's entry stays where it
  is and becomes *stale*; ``_stale[block]`` counts a block's stale entries. A block's
  entries sit in the list in the order it was freed, so all but its newest are stale, and
  ``popleft_n`` skips a block's entry while its stale count is positive. Nothing is indexed,
  so freeing costs the same whether or not hits come later.
* The *fresh run* ``[_fresh_next, _fresh_end)`` is the ids never handed out yet, which
  always sit at the head: a pool of a million blocks starts as two integers, and block
  objects are created the first time a block is allocated.

The order is exactly the linked list's: head first, appends at the tail, removal in place.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol, SupportsIndex

from mypy_extensions import mypyc_attr

from kvspec.impl.checks import BlockLike, Flag, HashBytes, as_int
from kvspec.impl.errors import (
    BlockAlreadyCachedError,
    BlockNotFreeError,
    BlockOwnershipError,
    InvalidBlockFieldError,
    InvalidFreeQueueArgument,
    NoFreeBlocksError,
)
from kvspec.impl.hashing import BlockHashWithGroupId

__all__ = ["BlockOwner", "FreeKVCacheBlockQueue", "FreeingPool", "KVCacheBlock"]


def _blocks_argument(blocks: object) -> list[KVCacheBlock]:
    """``blocks`` read whole into a list of distinct ``KVCacheBlock``s, or a typed refusal."""
    if type(blocks) is list:
        listed: list[object] = blocks
    else:
        try:
            iterator = iter(blocks)  # type: ignore[call-overload]
        except TypeError:
            raise InvalidFreeQueueArgument(
                f"blocks must be an iterable of KVCacheBlock, got {blocks!r}") from None
        listed = list(iterator)  # the caller's own failure, if any, comes through as it is
    for block in listed:
        if not isinstance(block, KVCacheBlock):
            raise InvalidFreeQueueArgument(f"{block!r} is not a KVCacheBlock")
    if len({id(block) for block in listed}) != len(listed):
        twice = next(b for i, b in enumerate(listed) if any(b is c for c in listed[:i]))
        raise InvalidFreeQueueArgument(
            f"block {twice.block_id} is listed twice")  # type: ignore[attr-defined]
    return listed  # type: ignore[return-value]


@mypyc_attr(allow_interpreted_subclasses=True)  # BlockPool subclasses it, and forks BlockPool
class BlockOwner:
    """What a block made by a pool reads of that pool: the seam between ``KVCacheBlock`` and
    ``BlockPool`` (impl/block_pool.py), which implements it. This module does not import the
    pool: the pool sits above it.

    A pool's block is a thin handle whose ``owner`` is the pool: its ref count, its key and
    whether it is queued are the pool's, read through these members on every ``ref_cnt`` and
    ``block_hash`` read. It is a compiled base class rather than a ``typing.Protocol`` because
    the managers read ``ref_cnt`` per block on their hot paths: mypyc calls a base class's
    method through its vtable, a Protocol's by name (some 30 ns more per call, measured).
    """

    free_block_queue: FreeKVCacheBlockQueue
    """The owner's free queue: its blocks of ref count 0, but the null block."""

    def ref_count(self, block: BlockLike) -> int:
        """The ref count of one of the owner's blocks (``BlockNotInPoolError`` for any other)."""
        raise NotImplementedError

    def block_hash_of(self, block: BlockLike) -> BlockHashWithGroupId | None:
        """The key one of the owner's blocks is cached under (hash + 4-byte group id), None if
        it has none (``BlockNotInPoolError`` for any other block)."""
        raise NotImplementedError

    def block_hash_num_tokens_of(self, block: BlockLike) -> int | None:
        """The prefix length (tokens) one of the owner's blocks' key covers (vLLM 0.33's
        ``block_hash_num_tokens``), None when the owner does not record it."""
        return None

    def set_ref_count(self, block: BlockLike, value: SupportsIndex) -> None:
        """``block.ref_cnt = value`` on one of the owner's blocks. Refused by default: the
        owner moves its blocks itself. A vLLM 0.33 pool accepts what 0.33's managers write
        (one more reference to a block in use, for a copy-on-write pair)."""
        raise BlockOwnershipError(
            f"block {getattr(block, 'block_id', block)}'s ref count belongs to its BlockPool; "
            f"use touch/free_blocks instead of setting ref_cnt={value!r}"
        )


class FreeingPool(Protocol):
    """A pool a free can be forwarded to (vLLM 0.33's ``KVCacheBlock.pool``: deferred frees
    may hold blocks of several pools, and each pool hands the others theirs)."""

    def free_blocks(self, ordered_blocks: Any) -> None: ...


def _field_int(name: str, value: object) -> int:
    """An integer field of a block (``as_int``: an int or a numpy integer, never a bool)."""
    number = value if type(value) is int else as_int(value)
    if number is None:
        raise InvalidBlockFieldError(f"{name} must be an int, got {value!r}")
    return number


class KVCacheBlock:
    """One KV-cache block's metadata.

    A block made by a ``BlockPool`` is a thin handle: its ref count and hash are read from
    the pool, which owns them. A block made directly (``KVCacheBlock(3)``) keeps its own,
    as vLLM's dataclass does.

    Two fields are the owning pool's, written by it alone (the ``BlockOwner`` seam):
    ``owner``, the pool that made the block (None for a block made directly), and
    ``extra_refs``, the block's ref count minus 1 while the pool's block is shared (0
    otherwise). Everyone else reads a block through vLLM's fields.
    """

    __slots__ = ("_block_hash", "_given_pool", "_next", "_prev", "_queue", "_ref_cnt",
                 "block_id", "extra_refs", "is_null", "owner")

    def __init__(
        self,
        block_id: SupportsIndex,
        ref_cnt: SupportsIndex = 0,
        _block_hash: HashBytes | None = None,
        prev_free_block: BlockLike | None = None,
        next_free_block: BlockLike | None = None,
        is_null: Flag = False,
        *,
        pool: FreeingPool | None = None,
    ) -> None:
        checked_id = block_id if type(block_id) is int else _field_int("block_id", block_id)
        checked_refs = ref_cnt if type(ref_cnt) is int else _field_int("ref_cnt", ref_cnt)
        if _block_hash is not None and type(_block_hash) is not bytes:
            raise InvalidBlockFieldError(f"a block hash must be bytes, got {_block_hash!r}")
        for link in (prev_free_block, next_free_block):
            if link is not None and not isinstance(link, KVCacheBlock):
                raise InvalidBlockFieldError(f"a free-list link must be a block, got {link!r}")
        if type(is_null) is not bool:
            raise InvalidBlockFieldError(f"is_null must be a bool, got {is_null!r}")
        if pool is not None and not callable(getattr(pool, "free_blocks", None)):
            raise InvalidBlockFieldError(f"pool must have free_blocks, got {pool!r}")
        self.block_id: int = checked_id
        self._ref_cnt: int = checked_refs
        self._block_hash: BlockHashWithGroupId | None = _block_hash  # type: ignore[assignment]
        self.is_null: bool = is_null
        self.owner: BlockOwner | None = None
        self.extra_refs = 0  # a pool block's ref count minus 1, while it is shared
        # A block outside any free queue keeps the pointers it was given (vLLM's fields);
        # inside one, they are read from the queue (see prev_free_block).
        self._prev: KVCacheBlock | None = prev_free_block  # type: ignore[assignment]
        self._next: KVCacheBlock | None = next_free_block  # type: ignore[assignment]
        self._queue: FreeKVCacheBlockQueue | None = None  # a standalone queue holding it
        # vLLM 0.33's KVCacheBlock(..., pool=p): a block made directly for pool p, to which
        # a free of it is forwarded (a pool's own blocks answer their owner instead).
        self._given_pool: FreeingPool | None = pool

    @property
    def ref_cnt(self) -> int:
        owner = self.owner
        return self._ref_cnt if owner is None else owner.ref_count(self)

    @ref_cnt.setter
    def ref_cnt(self, value: SupportsIndex) -> None:
        owner = self.owner
        if owner is not None:
            owner.set_ref_count(self, value)  # refused unless the owner takes it
            return
        self._ref_cnt = _field_int("ref_cnt", value)

    @property
    def pool(self) -> BlockOwner | FreeingPool | None:
        """vLLM 0.33's name for the pool that owns the block: the pool that made it
        (``owner``), else the one it was made for (``pool=``); a free of it is forwarded
        there."""
        owner = self.owner
        return self._given_pool if owner is None else owner

    @property
    def block_hash_num_tokens(self) -> int | None:
        """vLLM 0.33: the prefix length (tokens) the block's key covers; None without a key."""
        owner = self.owner
        return None if owner is None else owner.block_hash_num_tokens_of(self)

    @property
    def block_hash(self) -> BlockHashWithGroupId | None:
        owner = self.owner
        return self._block_hash if owner is None else owner.block_hash_of(self)

    @block_hash.setter
    def block_hash(self, block_hash: HashBytes) -> None:
        if self.owner is not None:
            raise BlockOwnershipError(
                f"block {self.block_id}'s hash belongs to its BlockPool; use cache_full_blocks"
            )
        if type(block_hash) is not bytes:
            raise InvalidBlockFieldError(f"a block hash must be bytes, got {block_hash!r}")
        if self._block_hash is not None:
            raise BlockAlreadyCachedError(
                f"block {self.block_id} already has a hash: {self._block_hash!r}")
        self._block_hash = BlockHashWithGroupId(block_hash)

    def reset_hash(self) -> None:
        if self.owner is not None:
            raise BlockOwnershipError(
                f"block {self.block_id}'s hash belongs to its BlockPool; use evict_blocks"
            )
        self._block_hash = None

    # vLLM links free blocks through these two fields. Here the free queue is a list, so the
    # pointers are a read-only view of it, computed on demand in O(free): for tests and
    # debugging, never for the pool's own work.

    @property
    def prev_free_block(self) -> KVCacheBlock | None:
        """The block before this one in its free queue (the queue's head sentinel if first);
        None when it is not in a free queue."""
        queue = self._free_queue()
        return self._prev if queue is None else queue._neighbour(self, -1)

    @prev_free_block.setter
    def prev_free_block(self, block: BlockLike | None) -> None:
        self._prev = self._link(block)

    @property
    def next_free_block(self) -> KVCacheBlock | None:
        """The block after this one in its free queue (the tail sentinel if last); None when
        it is not in a free queue."""
        queue = self._free_queue()
        return self._next if queue is None else queue._neighbour(self, 1)

    @next_free_block.setter
    def next_free_block(self, block: BlockLike | None) -> None:
        self._next = self._link(block)

    def _free_queue(self) -> FreeKVCacheBlockQueue | None:
        """The free queue this block is in, if any."""
        if self._queue is not None:
            return self._queue
        owner = self.owner
        if owner is None or self.is_null or owner.ref_count(self):
            return None
        return owner.free_block_queue

    def _link(self, block: object) -> KVCacheBlock | None:
        """A link a block outside every queue and pool may be given (vLLM's plain fields)."""
        if self._free_queue() is not None or self.owner is not None:
            raise BlockOwnershipError(
                f"block {self.block_id}'s free-queue links belong to its queue; they are read-only"
            )
        if block is not None and not isinstance(block, KVCacheBlock):
            raise InvalidBlockFieldError(f"a free-list link must be a block, got {block!r}")
        return block

    def __repr__(self) -> str:
        return (
            f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, "
            f"block_hash={self.block_hash!r}, is_null={self.is_null})"
        )


class FreeKVCacheBlockQueue:
    """The free blocks in eviction order: the head is reused first (LRU).

    Same operations and order as vLLM's linked list; see the module docstring for the layout.
    ``fake_free_list_head`` / ``fake_free_list_tail`` and the blocks' ``prev_free_block`` /
    ``next_free_block`` are a read-only view of that list in vLLM's linked-list terms.

    A queue built directly from blocks (``FreeKVCacheBlockQueue(blocks)``, as vLLM's callers
    and tests do) marks its members, so that a block knows it is queued, and every operation
    checks its argument before changing anything: a block must be a ``KVCacheBlock`` of no
    pool, in no other queue, listed once. The pool's own queue (``for_pool``) does not pay for
    that per block (a pool block is queued exactly when its ref count is 0), and vLLM's
    mutators refuse to change it behind the pool's back.

    The owner's seam: ``take_unchecked``, ``extend_unchecked``, ``prepend_unchecked`` and
    ``remove_unchecked`` move blocks without checking them, for the queue's owner (the pool)
    and the pool's eviction policy (impl/eviction.py ``PolicyQueue``), which guarantee what
    each says it takes. ``check_representation()`` checks the layout (tests, debugging).
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        entries = _blocks_argument(blocks)
        for block in entries:
            if block.owner is not None or block._queue is not None:
                raise InvalidFreeQueueArgument(
                    f"block {block.block_id} already belongs to "
                    f"{'a pool' if block.owner is not None else 'a free queue'}")
        # A copy: the queue appends to its entries, which must never grow the caller's list
        # (vLLM's tests read their list after appending to the queue).
        self._entries: list[KVCacheBlock] = entries.copy()
        self._head = 0
        self._stale: dict[KVCacheBlock, int] = {}
        self._num_stale = 0
        self._fresh_next = 0
        self._fresh_end = 0
        self._materialize: Callable[[int, int], list[KVCacheBlock]] | None = None
        self.num_free_blocks = len(entries)
        self._marks_members = True
        for block in self._entries:
            block._queue = self
        self.fake_free_list_head = KVCacheBlock(-1)
        self.fake_free_list_tail = KVCacheBlock(-1)
        self.fake_free_list_head._queue = self
        self.fake_free_list_tail._queue = self

    @classmethod
    def for_pool(
        cls, first: SupportsIndex, end: SupportsIndex,
        materialize: Callable[[int, int], list[KVCacheBlock]],
    ) -> FreeKVCacheBlockQueue:
        """A pool's own queue of the never-used ids [first, end), whose blocks
        ``materialize(first, end)`` makes (in id order) the first time they are taken. It does
        not mark its members: the pool knows which of its blocks are free."""
        low, high = as_int(first), as_int(end)
        if low is None or high is None or not 0 <= low <= high:
            raise InvalidFreeQueueArgument(
                f"a pool's free queue holds the ids [first, end), 0 <= first <= end: got "
                f"first={first!r}, end={end!r}")
        if not callable(materialize):
            raise InvalidFreeQueueArgument(
                f"materialize must make the blocks of ids [first, end), got {materialize!r}")
        queue = cls([])
        queue._marks_members = False  # the pool knows which of its blocks are free
        queue._fresh_next, queue._fresh_end = low, high
        queue._materialize = materialize
        queue.num_free_blocks = high - low
        return queue

    # -- taking blocks out ---------------------------------------------------------------

    def popleft(self) -> KVCacheBlock:
        self._refuse_for_pool("popleft")
        if self.num_free_blocks == 0:
            raise NoFreeBlocksError("No free blocks available")
        return self.take_unchecked(1)[0]

    def popleft_n(self, n: SupportsIndex) -> list[KVCacheBlock]:
        self._refuse_for_pool("popleft_n")
        count = n if type(n) is int else as_int(n)
        if count is None or count < 0:
            raise InvalidFreeQueueArgument(f"the number of blocks to pop must be an int >= 0, "
                                           f"got {n!r}")
        if count > self.num_free_blocks:
            raise NoFreeBlocksError(
                f"cannot pop {count} blocks from a free queue of {self.num_free_blocks}"
            )
        return self.take_unchecked(count)

    def take_unchecked(self, n: int) -> list[KVCacheBlock]:
        """The first ``n`` free blocks, out of the queue. The owner's seam: the caller
        guarantees 0 <= n <= num_free_blocks."""
        if n == 0:
            return []
        self.num_free_blocks -= n
        fresh: list[KVCacheBlock] | None = None
        first = self._fresh_next
        if first < self._fresh_end:
            last = min(first + n, self._fresh_end)
            fresh = self._materialize(first, last)  # type: ignore[misc]
            self._fresh_next = last
            n -= last - first
            if n == 0:
                return fresh  # a fresh run exists only in the pool's queue: nothing to unmark
        entries, stale = self._entries, self._stale
        start = self._head
        stop = start + n
        taken = entries[start:stop]
        if stale and not stale.keys().isdisjoint(taken):
            live: list[KVCacheBlock] = []
            while True:
                for block in taken:
                    count = stale.get(block)
                    if count:
                        self._num_stale -= 1
                        if count == 1:
                            del stale[block]
                        else:
                            stale[block] = count - 1
                    else:
                        live.append(block)
                missing = n - len(live)
                if not missing:
                    break
                taken = entries[stop : stop + missing]
                stop += missing
            taken = live
        self._head = stop
        if stop > 1024 and stop > len(entries) >> 1:
            del entries[:stop]
            self._head = 0
        if self._marks_members:
            for block in taken:
                block._queue = None
        return taken if fresh is None else fresh + taken

    def remove(self, block: BlockLike) -> None:
        """Take a queued block out of the queue, wherever it is."""
        self._refuse_for_pool("remove")
        if not isinstance(block, KVCacheBlock):
            raise BlockNotFreeError(f"{block!r} is not a block, so not in the free queue")
        if block._queue is not self:
            raise BlockNotFreeError(f"block {block.block_id} is not in the free queue")
        self.remove_unchecked([block])

    def remove_unchecked(self, blocks: list[KVCacheBlock]) -> None:
        """Take blocks out of the queue, wherever they are. The owner's seam: the caller
        guarantees each is in this queue and listed once."""
        if self._fresh_next < self._fresh_end and any(
                self._fresh_next <= b.block_id < self._fresh_end for b in blocks):
            self._spill_fresh_run()
        stale = self._stale
        for block in blocks:
            stale[block] = stale.get(block, 0) + 1
        if self._marks_members:
            for block in blocks:
                block._queue = None
        self._num_stale += len(blocks)
        self.num_free_blocks -= len(blocks)
        if self._num_stale > 64 and self._num_stale > self.num_free_blocks:
            self._drop_stale_entries()

    def _live_entries(self) -> list[KVCacheBlock]:
        """entries[head:] without the stale ones, in order."""
        skip = dict(self._stale)
        live = []
        for block in self._entries[self._head :]:
            count = skip.get(block)
            if count:
                skip[block] = count - 1
            else:
                live.append(block)
        return live

    def _drop_stale_entries(self) -> None:
        self._entries[:] = self._live_entries()
        self._head = 0
        self._stale.clear()
        self._num_stale = 0

    def _spill_fresh_run(self) -> None:
        """Turn the fresh run into ordinary entries (only a hit on a never-used block needs it)."""
        fresh = self._materialize(self._fresh_next, self._fresh_end)  # type: ignore[misc]
        self._fresh_next = self._fresh_end
        self._entries[: self._head] = fresh
        self._head = 0

    # -- putting blocks back -------------------------------------------------------------

    def append(self, block: BlockLike) -> None:
        """Put a block at the tail (it will be reused last)."""
        self.append_n([block])  # type: ignore[list-item]  # append_n checks it

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Put blocks at the tail, in order. The argument is read whole and checked before the
        queue changes."""
        self._refuse_for_pool("append_n")
        joining = _blocks_argument(blocks)
        for block in joining:
            if block.owner is not None:
                raise InvalidFreeQueueArgument(
                    f"block {block.block_id} belongs to a pool, which frees it itself")
            if block._queue is not None:
                raise InvalidFreeQueueArgument(f"block {block.block_id} is already queued")
        self.extend_unchecked(joining)

    def extend_unchecked(self, blocks: list[KVCacheBlock]) -> None:
        """Put blocks at the tail, in order. The owner's seam: the caller guarantees each is
        out of every queue and listed once."""
        self._entries.extend(blocks)
        self.num_free_blocks += len(blocks)
        if self._marks_members:
            for block in blocks:
                block._queue = self

    def prepend_unchecked(self, blocks: list[KVCacheBlock]) -> None:
        """Put blocks at the head, in order (an eviction policy's: ``lru-lifo-unhashed`` reuses
        unkeyed blocks first). The owner's seam: the caller guarantees each is out of every
        queue and listed once."""
        if not blocks:
            return
        if self._fresh_next < self._fresh_end:
            self._spill_fresh_run()  # the fresh run is the head: make it ordinary entries
        if self._stale and not self._stale.keys().isdisjoint(blocks):
            # A block's stale entry lies after the head; skipping "the first entry" of it
            # would skip the new one: drop the stale entries first.
            self._drop_stale_entries()
        head = self._head
        self._entries[:head] = blocks  # in place of the taken entries before the head
        self._head = 0
        self.num_free_blocks += len(blocks)
        if self._marks_members:
            for block in blocks:
                block._queue = self

    def _refuse_for_pool(self, operation: str) -> None:
        if not self._marks_members:
            raise BlockOwnershipError(
                f"{operation} on a BlockPool's own free queue: the pool moves its blocks "
                f"(get_new_blocks, free_blocks, touch), or its ref counts would disagree")

    # -- inspection ----------------------------------------------------------------------

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Every free block, head first. Costs O(free); meant for tests and audits."""
        fresh: list[KVCacheBlock] = []
        if self._fresh_next < self._fresh_end:
            fresh = self._materialize(self._fresh_next, self._fresh_end)  # type: ignore[misc]
        return fresh + self._live_entries()

    def __iter__(self) -> Iterator[KVCacheBlock]:
        return iter(self.get_all_free_blocks())

    def _check(self) -> None:
        """``check_representation()``, by its former name."""
        self.check_representation()

    def check_representation(self) -> None:
        """The representation invariant, for tests and debugging (O(entries)); raises an
        ``AssertionError`` naming the broken property. No ``assert``: it runs under -O.

        The free order is the fresh run then the live entries of ``_entries[_head:]``; a
        block's entries there are all stale but its newest (``_stale`` counts the stale ones),
        so each block has at most one live entry, and ``num_free_blocks`` counts the fresh
        run and the live entries."""
        entries, stale = self._entries, self._stale
        if not 0 <= self._head <= len(entries):
            raise AssertionError(f"free queue: head {self._head} outside the "
                                 f"{len(entries)} entries")
        if not 0 <= self._fresh_next <= self._fresh_end:
            raise AssertionError(f"free queue: fresh run [{self._fresh_next}, "
                                 f"{self._fresh_end}) is not a range")
        fresh = self._fresh_end - self._fresh_next
        if fresh and self._materialize is None:
            raise AssertionError("free queue: a fresh run without a way to make its blocks")
        if any(count < 1 for count in stale.values()):
            raise AssertionError(f"free queue: stale counts must be positive, got "
                                 f"{sorted(stale.values())}")
        if sum(stale.values()) != self._num_stale:
            raise AssertionError(f"free queue: stale count total {self._num_stale} is not the "
                                 f"sum of the stale counts {sum(stale.values())}")
        occurrences: dict[KVCacheBlock, int] = {}
        for block in entries[self._head :]:
            occurrences[block] = occurrences.get(block, 0) + 1
        for block, count in stale.items():
            if count > occurrences.get(block, 0):
                raise AssertionError(f"free queue: block {block.block_id} has {count} stale "
                                     f"entries but {occurrences.get(block, 0)} entries")
        live = self._live_entries()
        if len({id(block) for block in live}) != len(live):
            raise AssertionError("free queue: a block has two live entries (queued twice)")
        if len(live) + fresh != self.num_free_blocks:
            raise AssertionError(f"free queue: num_free_blocks {self.num_free_blocks} is not the "
                                 f"live entries ({len(live)}) plus the fresh run ({fresh})")
        if fresh and any(self._fresh_next <= b.block_id < self._fresh_end for b in live):
            raise AssertionError("free queue: a block is both in the fresh run and an entry")
        if self._marks_members:
            live_blocks = set(live)
            if any(block._queue is not self for block in live):
                raise AssertionError("free queue: a live entry's block is not marked as queued")
            if any(block._queue is self for block in occurrences if block not in live_blocks):
                raise AssertionError("free queue: a block with only stale entries is still "
                                     "marked as queued")

    def _neighbour(self, block: KVCacheBlock, step: int) -> KVCacheBlock | None:
        """The block ``step`` (-1 or 1) places from ``block`` in vLLM's linked list: the free
        blocks between the head and tail sentinels. O(free)."""
        head, tail = self.fake_free_list_head, self.fake_free_list_tail
        order = [head, *self.get_all_free_blocks(), tail]
        if block is head:
            return order[1] if step > 0 else None
        if block is tail:
            return order[-2] if step < 0 else None
        position = next(i for i, b in enumerate(order) if b is block)
        return order[position + step]
