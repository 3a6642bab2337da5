"""BlockPool: vLLM 0.13's block pool API, laid out for batch moves (spec: spec/pool.py).

Where the state lives
---------------------
* ref counts: ``_in_use`` is the set of blocks with ref >= 1 and ``_shared`` the subset
  with ref >= 2, whose ``block._extra_refs`` holds ref - 1. A request's unshared blocks
  are allocated and freed with one set update each instead of a loop over ref counts.
* the free order: ``free_block_queue`` (see impl/kv_cache_utils.py).
* keys: ``_key_of`` maps a keyed block to its block hash and ``_group_of`` to its group id
  when that is not 0 (a one-group pool builds no key tuples); ``cached_block_hash_to_block``
  maps a key to its blocks. Both empty means nothing to evict, which is checked once per call.
* block objects are made the first time a block is handed out (``blocks`` is lazy), so a
  pool of a million blocks costs a list of a million empty slots to build.

Every input is checked before anything changes: a refused call leaves the pool as it was.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from itertools import chain, islice, repeat, takewhile
from operator import attrgetter, truth
from typing import TYPE_CHECKING, overload

from mypy_extensions import mypyc_attr

from kvspec.impl import host_types
from kvspec.impl.errors import (
    BlockAlreadyCachedError as BlockAlreadyCachedError,
    BlockNotInPoolError as BlockNotInPoolError,
    BlockNotInUseError as BlockNotInUseError,
    BlockPoolError as BlockPoolError,
    InvalidBlockCountError as InvalidBlockCountError,
    InvalidBlockHashError as InvalidBlockHashError,
    NotEnoughFreeBlocksError as NotEnoughFreeBlocksError,
)
from kvspec.impl.hashing import (
    BlockHash,
    BlockHashListWithBlockSize,
    BlockHashWithGroupId,
    maybe_convert_block_hash,
)
from kvspec.impl.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock
from kvspec.impl.kv_events import MEDIUM_GPU, KVCacheEvent

if TYPE_CHECKING:
    from kvspec.impl.kv_cache_metrics import KVCacheMetricsCollector
    from kvspec.impl.request import RequestLike

logger = logging.getLogger(__name__)

_GROUP_ID_SUFFIXES = tuple(gid.to_bytes(4, "big") for gid in range(256))
_GROUP_0 = _GROUP_ID_SUFFIXES[0]
_pool_of = attrgetter("_pool")


def _suffix(group_id: int) -> bytes:
    if type(group_id) is int and 0 <= group_id < 256:
        return _GROUP_ID_SUFFIXES[group_id]
    if not isinstance(group_id, int) or not 0 <= group_id < 2**32:
        raise InvalidBlockHashError(f"group id must be an int in [0, 2**32), got {group_id!r}")
    return group_id.to_bytes(4, "big")


def _split_key(key: bytes) -> tuple[bytes, int]:
    if type(key) is not bytes or len(key) < 4:
        raise InvalidBlockHashError(f"a block hash key must be bytes of length >= 4, got {key!r}")
    return key[:-4], int.from_bytes(key[-4:], "big")


class BlockHashToBlockMap:
    """Prefix-cache key -> the blocks cached under it, first inserted first.

    Keys are ``BlockHashWithGroupId`` (block hash + 4-byte group id) as in vLLM, but they are
    stored split, so that a lookup is one dict ``get`` on the bare hash (whose hash the bytes
    object has cached) and a request's whole prefix is looked up with ``map`` at C speed:

    * ``_groups[group_id][block_hash]``: the first block cached under the key;
    * ``_later[(group_id, block_hash)]``: the blocks cached under it after the first, in
      order. The same content may be cached in several blocks (two requests computed it at
      once; block tables are append-only, so there is no de-duplication), which is rare:
      ``_later`` is usually empty, and then every keyed block is its key's first.
    """

    def __init__(self) -> None:
        self._groups: dict[int, dict[bytes, KVCacheBlock]] = {}
        self._later: dict[tuple[int, bytes], list[KVCacheBlock]] = {}

    def get_one_block(self, key: BlockHashWithGroupId) -> KVCacheBlock | None:
        block_hash, group_id = _split_key(key)
        group = self._groups.get(group_id)
        return None if group is None else group.get(block_hash)

    def insert(self, key: BlockHashWithGroupId, block: KVCacheBlock) -> None:
        block_hash, group_id = _split_key(key)
        self._insert(group_id, block_hash, block)

    def pop(self, key: BlockHashWithGroupId, block_id: int) -> KVCacheBlock | None:
        block_hash, group_id = _split_key(key)
        for block in self._blocks(group_id, block_hash):
            if block.block_id == block_id:
                self._remove(group_id, block_hash, block)
                return block
        return None

    def __len__(self) -> int:
        return sum(len(group) for group in self._groups.values())

    def clear(self) -> None:
        self._groups.clear()
        self._later.clear()

    def items(self) -> Iterator[tuple[bytes, list[KVCacheBlock]]]:
        """Each key (hash + group id) with its blocks, first inserted first (for audits)."""
        for group_id, group in self._groups.items():
            suffix = group_id.to_bytes(4, "big")
            for block_hash in group:
                yield block_hash + suffix, self._blocks(group_id, block_hash)

    def _blocks(self, group_id: int, block_hash: bytes) -> list[KVCacheBlock]:
        first = self._groups.get(group_id, {}).get(block_hash)
        if first is None:
            return []
        return [first, *self._later.get((group_id, block_hash), ())]

    def _insert(self, group_id: int, block_hash: bytes, block: KVCacheBlock) -> None:
        group = self._groups.get(group_id)
        if group is None:
            self._groups[group_id] = {block_hash: block}
        elif block_hash in group:
            self._later.setdefault((group_id, block_hash), []).append(block)
        else:
            group[block_hash] = block

    def _remove(self, group_id: int, block_hash: bytes, block: KVCacheBlock) -> None:
        """Drop one block cached under the key (it must be there)."""
        group = self._groups[group_id]
        later = self._later.get((group_id, block_hash)) if self._later else None
        if group[block_hash] is block:
            if later:
                group[block_hash] = later.pop(0)
            else:
                del group[block_hash]
        else:
            later.remove(block)  # type: ignore[union-attr]
        if later is not None and not later:
            del self._later[(group_id, block_hash)]


class _LazyBlocks(Sequence[KVCacheBlock]):
    """``pool.blocks``: block i's object, made on first access."""

    __slots__ = ("_pool",)

    def __init__(self, pool: BlockPool) -> None:
        self._pool = pool

    def __len__(self) -> int:
        return self._pool.num_gpu_blocks

    @overload
    def __getitem__(self, index: int) -> KVCacheBlock: ...

    @overload
    def __getitem__(self, index: slice) -> list[KVCacheBlock]: ...

    def __getitem__(self, index: int | slice) -> KVCacheBlock | list[KVCacheBlock]:
        pool = self._pool
        if isinstance(index, slice):
            return [pool._block(i) for i in range(*index.indices(pool.num_gpu_blocks))]
        if not -pool.num_gpu_blocks <= index < pool.num_gpu_blocks:
            raise IndexError(f"block index {index} out of range for {pool.num_gpu_blocks} blocks")
        return pool._block(index % pool.num_gpu_blocks)

    def __iter__(self) -> Iterator[KVCacheBlock]:
        return (self._pool._block(i) for i in range(self._pool.num_gpu_blocks))


@mypyc_attr(allow_interpreted_subclasses=True)  # forks and tests subclass it
class BlockPool:
    """The pool of KV-cache blocks: allocation, freeing, prefix-cache lookup and eviction."""

    def __init__(
        self,
        num_gpu_blocks: int | object,
        enable_caching: bool,
        hash_block_size: int,
        enable_kv_cache_events: bool = False,
        metrics_collector: KVCacheMetricsCollector | None = None,
    ) -> None:
        if type(num_gpu_blocks) is not int or num_gpu_blocks < 1:
            raise InvalidBlockCountError(
                f"num_gpu_blocks must be a positive int, got {num_gpu_blocks!r}"
            )
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.enable_kv_cache_events = enable_kv_cache_events
        self.metrics_collector = metrics_collector
        self._objects: list[KVCacheBlock | None] = [None] * num_gpu_blocks
        self.null_block = KVCacheBlock._owned_by(self, 0)
        self.null_block.is_null = True
        self._objects[0] = self.null_block
        self.blocks: Sequence[KVCacheBlock] = _LazyBlocks(self)
        self.free_block_queue = FreeKVCacheBlockQueue._fresh(1, num_gpu_blocks, self._materialize)
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        self._groups = self.cached_block_hash_to_block._groups
        self._in_use: set[KVCacheBlock] = set()
        self._shared: set[KVCacheBlock] = set()  # ref >= 2; block._extra_refs = ref - 1
        self._key_of: dict[KVCacheBlock, bytes] = {}  # keyed block -> its block hash
        self._group_of: dict[KVCacheBlock, int] = {}  # keyed block -> its group, if not 0
        self.kv_event_queue: list[KVCacheEvent] = []

    # -- block objects -------------------------------------------------------------------

    def _block(self, block_id: int) -> KVCacheBlock:
        block = self._objects[block_id]
        if block is None:
            block = self._objects[block_id] = KVCacheBlock._owned_by(self, block_id)
        return block

    def _materialize(self, first: int, end: int) -> list[KVCacheBlock]:
        chunk = self._objects[first:end]
        if chunk.count(None) == len(chunk):
            made = [KVCacheBlock._owned_by(self, i) for i in range(first, end)]
            self._objects[first:end] = made
            return made
        return [self._block(i) for i in range(first, end)]

    def _ref_count(self, block: KVCacheBlock) -> int:
        if block in self._in_use:
            return block._extra_refs + 1
        return 0

    def _check_owned(self, blocks: list[KVCacheBlock]) -> None:
        try:
            if set(map(_pool_of, blocks)) <= {self}:
                return
        except AttributeError:
            pass
        stranger = next(b for b in blocks if not isinstance(b, KVCacheBlock) or b._pool is not self)
        raise BlockNotInPoolError(f"{stranger!r} is not a block of this pool")

    # -- prefix-cache lookup -------------------------------------------------------------

    def get_cached_block(
        self, block_hash: BlockHash | object, kv_cache_group_ids: Sequence[int]
    ) -> list[KVCacheBlock] | None:
        """The first block cached under block_hash in each group, or None if any group misses."""
        if type(block_hash) is not bytes:
            raise InvalidBlockHashError(f"block hash must be bytes, got {block_hash!r}")
        groups = self._groups
        found = []
        for group_id in kv_cache_group_ids:
            group = groups.get(group_id)
            if group is None:
                _suffix(group_id)  # refuses a malformed group id
                return None
            block = group.get(block_hash)
            if block is None:
                return None
            found.append(block)
        return found

    def get_cached_prefix(
        self,
        block_hashes: Sequence[BlockHash] | BlockHashListWithBlockSize,
        kv_cache_group_id: int,
        max_blocks: int,
    ) -> list[KVCacheBlock]:
        """The leading run of ``block_hashes[:max_blocks]`` cached in one group, first block
        under each key: ``get_cached_block`` until the first miss, in one call (kvspec's
        bulk lookup; vLLM 0.13 has none)."""
        group = self._groups.get(kv_cache_group_id)
        if group is None:
            _suffix(kv_cache_group_id)  # refuses a malformed group id
            group = {}
        limit = max(max_blocks, 0)
        wanted = block_hashes[:limit] if type(block_hashes) is list else list(
            islice(block_hashes, limit))
        try:
            hit: list[KVCacheBlock] = list(takewhile(truth, map(group.get, wanted)))  # type: ignore[arg-type]
        except TypeError:  # an unhashable "hash" before the first miss
            hit = []
            for block_hash in wanted:
                block = group.get(block_hash) if type(block_hash) is bytes else None
                if block is None:
                    break
                hit.append(block)
        if len(hit) < len(wanted) and type(wanted[len(hit)]) is not bytes:
            raise InvalidBlockHashError(f"block hash must be bytes, got {wanted[len(hit)]!r}")
        return hit

    def cache_full_blocks(
        self,
        request: RequestLike,
        blocks: list[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
    ) -> None:
        """Key blocks[num_cached_blocks:num_full_blocks] with the request's chain hashes."""
        if num_cached_blocks >= num_full_blocks or not self.enable_caching:
            return
        hashes: Sequence[BlockHash] | BlockHashListWithBlockSize = request.block_hashes
        if block_size != self.hash_block_size:
            hashes = BlockHashListWithBlockSize(request.block_hashes, self.hash_block_size,
                                                block_size)
        if num_cached_blocks < 0 or num_full_blocks > min(len(blocks), len(hashes)):
            raise InvalidBlockHashError(
                f"cannot cache blocks [{num_cached_blocks}, {num_full_blocks}) of "
                f"{len(blocks)} blocks with {len(hashes)} block hashes"
            )
        new_blocks = blocks[num_cached_blocks:num_full_blocks]
        new_hashes = hashes[num_cached_blocks:num_full_blocks]
        if type(new_hashes) is not list:
            new_hashes = list(new_hashes)
        if not self._in_use.issuperset(new_blocks):  # free, foreign or null blocks
            null = self.null_block
            if null in new_blocks:
                kept = [i for i, b in enumerate(new_blocks) if b is not null]
                new_blocks = [new_blocks[i] for i in kept]
                new_hashes = [new_hashes[i] for i in kept]
            self._check_owned(new_blocks)
        if not new_blocks:
            return
        group = self._groups.get(kv_cache_group_id)
        if group is None:
            _suffix(kv_cache_group_id)  # refuses a malformed group id
        key_of = self._key_of
        if not key_of.keys().isdisjoint(new_blocks):
            keyed = next(b for b in new_blocks if b in key_of)
            raise BlockAlreadyCachedError(
                f"block {keyed.block_id} already has a key {keyed.block_hash!r}"
            )
        if list(map(type, new_hashes)).count(bytes) != len(new_hashes):
            bad = next(h for h in new_hashes if type(h) is not bytes)
            raise InvalidBlockHashError(f"block hash must be bytes, got {bad!r}")
        num_keyed = len(key_of)
        key_of.update(zip(new_blocks, new_hashes, strict=True))
        if len(key_of) - num_keyed != len(new_blocks):  # a block listed twice: undo
            for block in new_blocks:
                key_of.pop(block, None)
            raise BlockAlreadyCachedError(
                f"a block appears twice in {[b.block_id for b in new_blocks]}"
            )
        if kv_cache_group_id:
            self._group_of.update(zip(new_blocks, repeat(kv_cache_group_id)))
        if group is None:
            group = self._groups[kv_cache_group_id] = {}
        num_hashes = len(group)
        if group.keys().isdisjoint(new_hashes):
            group.update(zip(new_hashes, new_blocks, strict=True))
            inserted = len(group) - num_hashes == len(new_blocks)
            if not inserted:  # a hash listed twice: the first of its blocks must stay first
                for block_hash in new_hashes:
                    group.pop(block_hash, None)
        else:
            inserted = False
        if not inserted:
            insert = self.cached_block_hash_to_block._insert
            for block_hash, block in zip(new_hashes, new_blocks, strict=True):
                insert(kv_cache_group_id, block_hash, block)
        if self.enable_kv_cache_events:
            lora = getattr(request, "lora_request", None)
            parent = hashes[num_cached_blocks - 1] if num_cached_blocks > 0 else None
            self.kv_event_queue.append(host_types.BlockStored(
                block_hashes=[maybe_convert_block_hash(BlockHash(key_of[b])) for b in new_blocks],
                parent_block_hash=None if parent is None else maybe_convert_block_hash(parent),
                token_ids=list(request.all_token_ids[
                    num_cached_blocks * block_size : num_full_blocks * block_size]),
                block_size=block_size,
                lora_id=None if lora is None else lora.adapter_id,
                medium=MEDIUM_GPU,
            ))

    # -- allocation ----------------------------------------------------------------------

    def get_new_blocks(self, num_blocks: int | object) -> list[KVCacheBlock]:
        """Take num_blocks from the head of the free queue, evicting their keys; ref 0 -> 1."""
        if type(num_blocks) is not int or num_blocks < 0:
            raise InvalidBlockCountError(
                f"num_blocks must be a non-negative int, got {num_blocks!r}"
            )
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise NotEnoughFreeBlocksError(f"Cannot get {num_blocks} free blocks from the pool")
        blocks = self.free_block_queue.popleft_n(num_blocks)
        key_of = self._key_of
        if key_of and not key_of.keys().isdisjoint(blocks):
            self._evict_all(list(filter(key_of.__contains__, blocks)))
        collector = self.metrics_collector
        if collector is not None:
            for block in blocks:
                if self.enable_caching:
                    collector.on_block_evicted(block)
                collector.on_block_allocated(block)
        self._in_use.update(blocks)
        return blocks

    def _evict_all(self, keyed: list[KVCacheBlock]) -> None:
        """Drop the keys of keyed blocks (each has one) from the blocks and from the map."""
        hashes = list(map(self._key_of.pop, keyed))
        cache_map, group_of = self.cached_block_hash_to_block, self._group_of
        if group_of or cache_map._later:
            for block_hash, block in zip(hashes, keyed, strict=True):
                cache_map._remove(group_of.pop(block, 0), block_hash, block)
        else:  # group 0 only, and every key's one block is the one evicted
            group = self._groups[0]
            for block_hash in hashes:
                del group[block_hash]
        if self.enable_kv_cache_events:
            removed = host_types.BlockRemoved
            self.kv_event_queue.extend(
                removed(block_hashes=[maybe_convert_block_hash(BlockHash(block_hash))],
                        medium=MEDIUM_GPU)
                for block_hash in hashes)

    def touch(self, blocks: Sequence[Sequence[KVCacheBlock]] | Sequence[KVCacheBlock]) -> None:
        """A prefix-cache hit: free blocks leave the free queue, every ref count + 1.

        Takes vLLM 0.13's tuple of per-group block lists, or one flat list (0.33).
        """
        flat: list[KVCacheBlock] = (
            list(blocks) if not blocks or isinstance(blocks[0], KVCacheBlock)  # type: ignore[arg-type]
            else list(chain.from_iterable(blocks))  # type: ignore[arg-type]
        )
        in_use = self._in_use
        if in_use.issuperset(flat):
            self._share(flat)
        else:  # some are free (or the null block, which is never in use)
            leaving = [b for b in flat if b not in in_use]
            null = self.null_block
            if null in leaving:
                flat = [b for b in flat if b is not null]
                leaving = [b for b in leaving if b is not null]
            if len(set(leaving)) == len(leaving):
                self._check_owned(leaving)
                self.free_block_queue._remove_free(leaving)
                if len(leaving) < len(flat):
                    self._share([b for b in flat if b in in_use])
                in_use.update(leaving)
            else:
                self._touch_one_by_one(flat)
        if self.metrics_collector is not None:
            for block in flat:
                self.metrics_collector.on_block_accessed(block)

    def _share(self, blocks: list[KVCacheBlock]) -> None:
        """One more reference to each listing of blocks already in use."""
        self._shared.update(blocks)
        for block in blocks:
            block._extra_refs += 1

    def _touch_one_by_one(self, flat: list[KVCacheBlock]) -> None:
        """touch() when a free block is listed twice: the first hit takes it out of the queue."""
        leaving = [b for b in dict.fromkeys(flat) if b not in self._in_use]
        self._check_owned(leaving)
        self.free_block_queue._remove_free(leaving)
        self._in_use.update(leaving)
        rest = list(flat)
        for block in leaving:
            rest.remove(block)
        self._share(rest)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Ref - 1 for each block; blocks reaching 0 go to the free queue's tail in order."""
        blocks = ordered_blocks if type(ordered_blocks) is list else list(ordered_blocks)
        in_use, shared = self._in_use, self._shared
        if not in_use.issuperset(blocks):
            null = self.null_block
            if null in blocks:
                blocks = [b for b in blocks if b is not null]
            if not in_use.issuperset(blocks):
                self._check_owned(blocks)
                stranger = next(b for b in blocks if b not in in_use)
                raise BlockNotInUseError(f"block {stranger.block_id} is freed with ref count 0")
        listed, still_shared = blocks, None
        if shared and not shared.isdisjoint(blocks):
            still_shared = [b for b in blocks if b in shared]
            if len(set(still_shared)) != len(still_shared):
                self._free_one_by_one(listed)
                return
            blocks = [b for b in blocks if b not in shared]
        before = len(in_use)
        in_use.difference_update(blocks)
        if before - len(in_use) != len(blocks):  # a block listed twice
            in_use.update(blocks)
            self._free_one_by_one(listed)
            return
        if still_shared:
            for block in still_shared:
                block._extra_refs -= 1
                if not block._extra_refs:
                    shared.discard(block)
        self.free_block_queue.append_n(blocks)

    def _free_one_by_one(self, blocks: list[KVCacheBlock]) -> None:
        """free_blocks() when a block is listed twice: each listing drops one reference."""
        remaining: dict[KVCacheBlock, int] = {}
        zeroed = []
        for block in blocks:
            refs = remaining[block] if block in remaining else self._ref_count(block)
            if refs == 0:
                raise BlockNotInUseError(f"block {block.block_id} is freed with ref count 0")
            remaining[block] = refs - 1
            if refs == 1:
                zeroed.append(block)
        for block, refs in remaining.items():
            if refs == 0:
                self._in_use.discard(block)
            block._extra_refs = max(refs - 1, 0)
            if refs <= 1:
                self._shared.discard(block)
        self.free_block_queue.append_n(zeroed)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the keys of the given blocks, in the order the set iterates (as vLLM does);
        ref counts and the free queue stay. Every id is checked before any key goes."""
        ids = list(dict.fromkeys(block_ids))
        for block_id in ids:
            if type(block_id) is not int or not 0 <= block_id < self.num_gpu_blocks:
                raise BlockNotInPoolError(
                    f"block id {block_id!r} is outside the pool of {self.num_gpu_blocks} blocks"
                )
        for block_id in ids:
            block = self._objects[block_id]
            if block is not None:
                if self.metrics_collector is not None:
                    self.metrics_collector.on_block_evicted(block)
                if block in self._key_of:
                    self._evict_all([block])

    def reset_prefix_cache(self) -> bool:
        """Forget every cached key; refused (False) while any block but the null one is in use."""
        num_used = self.num_gpu_blocks - self.get_num_free_blocks()
        if num_used != 1:
            logger.warning(
                "Failed to reset prefix cache because some blocks (%d) are not freed yet",
                num_used - 1,
            )
            return False
        self.cached_block_hash_to_block.clear()
        self._key_of.clear()
        self._group_of.clear()
        if self.metrics_collector is not None:
            self.metrics_collector.reset()
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(host_types.AllBlocksCleared())
        return True

    # -- accounting ----------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        total = self.num_gpu_blocks - 1
        if total == 0:
            return 0.0
        return 1.0 - self.free_block_queue.num_free_blocks / total

    def take_events(self) -> list[KVCacheEvent]:
        if not self.enable_kv_cache_events:
            return []
        events, self.kv_event_queue = self.kv_event_queue, []
        return events
