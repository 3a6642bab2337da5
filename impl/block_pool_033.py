"""BlockPool033: vLLM 0.33's block pool API (``vllm/v1/core/block_pool.py`` of 0.33.x; spec:
spec/pool.py under the vllm-0.33 profile).

vLLM 0.33's pool is vLLM 0.13's (``kvspec.impl.block_pool.BlockPool``) with these
differences, each an override here, each written down in spec/pool.py's ``Profile``:

* the free order: a freed block without a key goes to the head of the free queue (reused
  first), a keyed one to the tail (LRU); with caching off every block goes to the head;
* partial prefix-cache entries: a block may be reachable from a shorter prefix than its
  full key (``cache_partial_block``, a hybrid Mamba group's partial hit), under its primary
  key or beside it (``cached_block_hashes_by_block``: block id -> its other keys); a block
  keyed by a shorter prefix is promoted to its full key when it is cached full; each block
  records the prefix length its primary key covers (``block_hash_num_tokens``);
* copy-on-write: ``move_block_hashes`` moves every key of a block to its private copy, and
  a block's ref count may be set by 0.33's managers (``set_ref_count``);
* reuse watchers: ``unpin_blocks(blocks, on_reuse)`` frees blocks that stay readable until
  the pool hands them out again or resets, and calls ``on_reuse(block)`` then;
* frees of blocks another pool owns (``KVCacheBlock.pool``) are forwarded to that pool;
* ``cache_full_blocks`` takes a ``block_mask``, views coarser blocks by their last hash-block
  hash, and reports a range of only null blocks with an empty ``BlockStored``;
* events: vLLM 0.33's family (``kvspec.impl.kv_events_033``, or vLLM's own classes inside
  a vLLM 0.33 process), with the group, medium, LoRA name, extra keys, session and lookahead
  tokens; one ``BlockRemoved`` per removed key; ``emit_cached_block_events`` reports hits.

``BlockPool(..., vllm_api="0.33")``, or ``BlockPool(...)`` inside a vLLM 0.33 process, builds
this class (``kvspec.impl.block_pool.pool_class_for``); so does ``BlockPool033(...)``. Its
state beyond 0.13's (partial entries, token counts, watchers, the lookahead and the medium)
lives here; the base class keeps none of it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from operator import attrgetter
from typing import Any, NamedTuple, SupportsIndex

from mypy_extensions import mypyc_attr

from kvspec.impl import host_profile, host_types
from kvspec.impl.block_pool import (
    BlockPool,
    RequestToCache,
    as_list,
    check_block_count,
    check_group_id,
    check_lookahead,
    check_medium,
    split_key,
)
from kvspec.impl.checks import BlockLike, Flag, HashBytes, Text, as_int, check_flag
from kvspec.impl.errors import (
    BlockAlreadyCachedError,
    BlockNotInPoolError,
    BlockNotInUseError,
    InvalidBlockCountError,
    InvalidBlockHashError,
    InvalidBlockListError,
    InvalidPoolConfigError,
    InvalidRequestForCachingError,
    PolicyNotSupportedError,
)
from kvspec.impl.eviction import EvictionPolicy
from kvspec.impl.hashing import (
    BlockHash,
    BlockHashListWithBlockSize,
    BlockHashWithGroupId,
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
)
from kvspec.impl.kv_cache_metrics import MetricsCollectorLike
from kvspec.impl.kv_cache_utils import KVCacheBlock
from kvspec.impl.kv_events import MEDIUM_GPU, KVCacheEvent
from kvspec.impl.kv_events_033 import event_classes

__all__ = ["BlockPool033"]

logger = logging.getLogger(__name__)

_block_id_of = attrgetter("block_id")


class _VllmEvents(NamedTuple):
    """vLLM's own event classes, in ``kv_events_033.EventClasses``'s names."""

    BlockStored: Any
    BlockRemoved: Any
    AllBlocksCleared: Any


def _events_033() -> Any:
    """The classes of 0.33's events: vLLM's own inside vLLM 0.33 (``host_types``), else
    impl's map-encoded 0.33 family (``kv_events_033``): next to vLLM 0.13 the host's classes
    lack 0.33's fields, so a pool serving 0.33's API uses impl's."""
    if host_types.bound_to() == "vllm" and host_profile.current().profile == "vllm-0.33":
        return _VllmEvents(host_types.BlockStored, host_types.BlockRemoved,
                           host_types.AllBlocksCleared)
    return event_classes("vllm-0.33")


def _event_extra_keys(extra_keys: list[tuple[Any, ...] | None]) -> list[Any] | None:
    """vLLM 0.33's KV-event form of per-block tagged extra keys: untagged again (a LoRA name, a
    salt, an ``(identifier, offset)`` pair, a prompt-embeddings digest), None for no blocks."""
    if not extra_keys:
        return None
    return [None if keys is None else
            tuple(key[1:] if key[0] == "mm" else key[1] for key in keys)
            for keys in extra_keys]


def _view_033(hashes: list[Any], hash_block_size: int, block_size: int) -> list[Any]:
    """vLLM 0.33's hashes at a coarser block size: each block's is the last hash-block hash
    inside it (it already chains over the whole prefix; 0.13 joined them all)."""
    if block_size % hash_block_size:
        raise InvalidBlockCountError(f"block size {block_size} is not a multiple of the hash "
                                     f"block size {hash_block_size}")
    scale = block_size // hash_block_size
    return hashes[scale - 1 :: scale]


def _first_mm_feature_ending_after(mm_features: Sequence[Any], start: int) -> int:
    """The index of the first multimodal feature (sorted, disjoint) that ends after ``start``."""
    for index, feature in enumerate(mm_features):
        position = feature.mm_position
        if position.offset + position.length > start:
            return index
    return len(mm_features)


@mypyc_attr(allow_interpreted_subclasses=True)  # vLLM 0.33's hisparse host pool subclasses it
class BlockPool033(BlockPool):
    """vLLM 0.33's pool of KV-cache blocks (module docstring): vLLM 0.13's, with 0.33's
    differences as overrides and 0.33's operations."""

    def __init__(
        self,
        num_gpu_blocks: SupportsIndex,
        enable_caching: Flag,
        hash_block_size: SupportsIndex,
        enable_kv_cache_events: Flag = False,
        metrics_collector: MetricsCollectorLike | None = None,
        num_hash_lookahead_tokens: SupportsIndex = 0,
        medium: Text = MEDIUM_GPU,
        *,
        max_pending_kv_events: SupportsIndex | None = None,
        eviction_policy: EvictionPolicy | None = None,
        vllm_api: Text | None = None,
    ) -> None:
        # vLLM 0.33's multi-key blocks: block id -> the keys (hash + group id) it is cached
        # under besides its primary one (partial entries); public, as vLLM's offloading reads it.
        self.cached_block_hashes_by_block: dict[int, set[BlockHashWithGroupId]] = {}
        self._tokens_of: dict[KVCacheBlock, int] = {}  # prefix tokens a primary key covers
        # unpin_blocks(blocks, on_reuse): block id -> the callback to run when it is reused.
        self._reuse_watchers: dict[int, Callable[[KVCacheBlock], object]] = {}
        # Every argument is checked there, in the order of the base class (this class is
        # 0.33's whatever the process's default: vllm_api may only confirm it).
        super().__init__(
            num_gpu_blocks, enable_caching, hash_block_size, enable_kv_cache_events,
            metrics_collector, num_hash_lookahead_tokens, medium,
            max_pending_kv_events=max_pending_kv_events, eviction_policy=eviction_policy,
            vllm_api="0.33" if vllm_api is None else vllm_api)
        self.num_hash_lookahead_tokens: int = check_lookahead(num_hash_lookahead_tokens)
        self.medium: str = check_medium(medium)

    def _pool_api(self) -> str:
        return "0.33"

    # -- what 0.33 does differently ---------------------------------------------------------

    def block_hash_num_tokens_of(self, block: BlockLike) -> int | None:
        """The prefix length its primary key covers, for one of this pool's blocks (vLLM
        0.33's ``block_hash_num_tokens``)."""
        return self._tokens_of.get(self._own(block))

    def set_ref_count(self, block: BlockLike, value: SupportsIndex) -> None:
        """``block.ref_cnt = value``: a new count >= 1 for a block in use (0.33's managers add
        the reference of a copy-on-write pair that way); anything else is refused (the pool
        moves its blocks itself)."""
        owned = self._own(block)
        count = value if type(value) is int else as_int(value)
        if count is not None and count >= 1 and owned in self._in_use:
            owned.extra_refs = count - 1
            if count > 1:
                self._shared.add(owned)
            else:
                self._shared.discard(owned)
            return
        super().set_ref_count(block, value)

    def _taken(self, blocks: list[KVCacheBlock]) -> None:
        """get_new_blocks(): a block unpinned with a reuse watcher calls it as it is handed
        out, before its keys go (as vLLM 0.33 does)."""
        if self._reuse_watchers:
            self._notify_reuse(blocks)

    def _evict_all(self, keyed: list[KVCacheBlock]) -> None:
        """Drop every key of keyed blocks (primary keys and partial entries), one 0.33
        ``BlockRemoved`` per key."""
        for block in keyed:
            self._removed_events(self._remove_keys(block))
        if self.enable_kv_cache_events and self.max_pending_kv_events is not None:
            self._bound_kv_events()

    def _free_foreign(self, blocks: list[Any]) -> bool:
        foreign = self._foreign_blocks(blocks)
        if foreign:
            self._free_and_forward(blocks, foreign)
        return bool(foreign)

    def _release(self, zeroed: list[KVCacheBlock]) -> None:
        """Blocks that reached ref 0 (in that order) join the free queue where the policy puts
        them; without one, unkeyed blocks go to the head (LIFO: reused first), keyed ones to
        the tail (LRU), and with caching off every block goes to the head."""
        if self._policy is not None:
            self._policy.freed(zeroed)
        elif not self.enable_caching:
            self.free_block_queue.prepend_unchecked(zeroed)
        else:
            key_of = self._key_of
            if key_of.keys().isdisjoint(zeroed):
                self.free_block_queue.prepend_unchecked(zeroed)
            else:
                self.free_block_queue.prepend_unchecked(
                    [b for b in zeroed if b not in key_of])
                self.free_block_queue.extend_unchecked(list(filter(key_of.__contains__, zeroed)))

    def _clear_keys(self) -> None:
        """reset_prefix_cache(), once allowed: every key goes, partial entries too, and every
        reuse watcher fires."""
        super()._clear_keys()
        self.cached_block_hashes_by_block.clear()
        self._tokens_of.clear()
        if self._reuse_watchers:
            self._notify_reuse([self._block(i) for i in list(self._reuse_watchers)])
        logger.info("Successfully reset prefix cache")

    def _num_keys(self) -> int:
        partial = self.cached_block_hashes_by_block
        return len(self._key_of) + (sum(map(len, partial.values())) if partial else 0)

    def _snapshot(self) -> list[KVCacheEvent]:
        """The base class's snapshot (a clear, then the blocks' primary keys by block id), then
        the partial entries by block id, each block's in key order."""
        snapshot = super()._snapshot()
        partial = self.cached_block_hashes_by_block
        for block_id in sorted(partial):
            for key in sorted(partial[block_id]):
                snapshot.append(self._snapshot_stored(key[:-4], int.from_bytes(key[-4:], "big")))
        return snapshot

    def _all_blocks_cleared(self) -> KVCacheEvent:
        cleared: KVCacheEvent = _events_033().AllBlocksCleared()
        return cleared

    def _snapshot_stored(self, block_hash: bytes, group_id: int) -> KVCacheEvent:
        """A snapshot's store of one key: its hash, no parent, no token ids, its group's block
        size and index, the pool's medium, no LoRA; the pool keeps no more."""
        block_size = self._stored_block_sizes.get(group_id, self.hash_block_size)
        stored: KVCacheEvent = _events_033().BlockStored(
            block_hashes=[maybe_convert_block_hash(BlockHash(block_hash))],
            parent_block_hash=None, token_ids=[], block_size=block_size, lora_id=None,
            medium=self.medium, lora_name=None, group_idx=group_id)
        return stored

    def _check_keys(self) -> None:
        """The keys' part of the representation invariant, with 0.33's: partial entries and
        token counts belong to keyed blocks only (a partial key never outlives its block's
        primary key), watchers to blocks of the pool."""
        partial = self.cached_block_hashes_by_block
        for block_id, keys in partial.items():
            block = self._objects[block_id] if 0 <= block_id < self.num_gpu_blocks else None
            if block is None or block not in self._key_of or not keys:
                raise AssertionError(f"block pool: partial keys of block {block_id}, which "
                                     f"has no primary key")
            for key in keys:
                block_hash, group_id = key[:-4], int.from_bytes(key[-4:], "big")
                if not any(b is block for b in
                           self.cached_block_hash_to_block.blocks_under(group_id, block_hash)):
                    raise AssertionError(f"block pool: partial key {key!r} of block "
                                         f"{block_id} is not in the map")
        if not self._tokens_of.keys() <= self._key_of.keys():
            raise AssertionError("block pool: a token count for a block without a key")
        if any(not 0 < i < self.num_gpu_blocks for i in self._reuse_watchers):
            raise AssertionError("block pool: a reuse watcher on a block outside the pool")
        self._check_keys_beside(partial)

    def _cache_blocks(
        self, request: Any, request_hashes: list[Any], block_list: list[KVCacheBlock],
        new_blocks: list[Any], first: int, end: int, size: int, group_id: int,
        block_mask: Sequence[bool] | None,
    ) -> None:
        """cache_full_blocks() of a 0.33 pool: null and masked-out blocks skipped, a block
        keyed by a shorter (partial) prefix promoted to its full key, 0.33's events."""
        hashes: Sequence[BlockHash] | BlockHashListWithBlockSize = request_hashes
        if size != self.hash_block_size:
            hashes = _view_033(request_hashes, self.hash_block_size, size)
        if end > len(hashes):
            raise InvalidBlockHashError(
                f"cannot cache blocks [{first}, {end}) with {len(hashes)} block hashes")
        if block_mask is not None:
            mask = as_list(block_mask, "block_mask")
            if len(mask) != len(new_blocks):
                raise InvalidBlockListError(f"block_mask has {len(mask)} entries for "
                                            f"{len(new_blocks)} blocks")
        null = self.null_block
        kept = [i for i, b in enumerate(new_blocks)
                if b is not null and (block_mask is None or mask[i])]
        key_of, tokens_of = self._key_of, self._tokens_of
        # Read as objects: the compiled build would unbox a non-bytes entry with a TypeError.
        raw_hashes: Any = hashes
        seen: set[KVCacheBlock] = set()
        for i in kept:
            block = new_blocks[i]
            if block in seen:
                raise BlockAlreadyCachedError(f"block {block.block_id} appears twice")
            seen.add(block)
            if block in key_of:
                covered = tokens_of.get(block)
                if covered is None or covered >= (first + i + 1) * size:
                    raise BlockAlreadyCachedError(
                        f"block {block.block_id} already has a key {block.block_hash!r}")
            if type(raw_hashes[first + i]) is not bytes:
                raise InvalidBlockHashError(f"block hash must be bytes, got "
                                            f"{raw_hashes[first + i]!r}")
        if not kept and not self.enable_kv_cache_events:
            return
        # With events on, a range of only null (or masked-out) blocks still reports an empty
        # BlockStored, as vLLM 0.33's cache_full_blocks does (docs/findings.md, D2).
        stored = None
        if self.enable_kv_cache_events:
            extra_keys: list[tuple[Any, ...] | None] = []
            lookahead: list[list[int]] | None = [] if self.num_hash_lookahead_tokens else None
            mm_idx = 0
            for i in kept:
                start = (first + i) * size
                keys, mm_idx = self._event_keys(request, start, start + size, mm_idx)
                extra_keys.append(keys)
                if lookahead is not None:
                    lookahead.append(self._lookahead_ids(request, start + size))
            parent = None if first == 0 else maybe_convert_block_hash(hashes[first - 1])
            stored = self._stored_event_033(
                request, [maybe_convert_block_hash(hashes[first + i]) for i in kept], parent,
                first * size, end * size, size, group_id, extra_keys, lookahead)
        policy = self._policy
        hints = None if policy is None else policy.check_hints(request)
        # Nothing has changed yet; from here on nothing can fail.
        for i in kept:
            block = new_blocks[i]
            if block in key_of:  # a partial entry's block, now full: its keys go first
                self._removed_events(self._remove_keys(block))
            self._insert_key(group_id, hashes[first + i], block, (first + i + 1) * size)
        if stored is not None:
            self.kv_event_queue.append(stored)
            self._stored_block_sizes[group_id] = size
            if self.max_pending_kv_events is not None:
                self._bound_kv_events()
        if hints:  # the request's retention hints, as in 0.13's path
            policy.cached(hints, block_list[first:end], first, size)  # type: ignore[union-attr]

    def unpin_blocks(self, block_ids: Iterable[Any],
                     on_reuse: Callable[[KVCacheBlock], object] | None = None) -> None:
        """Drop pins (the ``pinned`` policy's, by block id), or, with ``on_reuse``, vLLM 0.33's
        ``unpin_blocks(blocks, on_reuse)``: blocks (not ids) drop a reference, those reaching 0
        join the tail of the free queue while they stay readable, and ``on_reuse(block)`` runs
        when the pool hands the block out again or the prefix cache is reset."""
        if on_reuse is None:
            super().unpin_blocks(block_ids)
            return
        listed: list[Any] = as_list(block_ids, "blocks")
        if not callable(on_reuse):
            raise InvalidPoolConfigError(f"on_reuse must be callable, got {on_reuse!r}")
        self._check_owned(listed)
        counts: dict[KVCacheBlock, int] = {}
        for block in listed:
            counts[block] = counts.get(block, 0) + 1
        for block, times in counts.items():
            if block is self.null_block or self._ref_count(block) < times:
                raise BlockNotInUseError(f"block {block.block_id} is unpinned with ref count "
                                         f"{self._ref_count(block)}")
        released = []
        in_use, shared, watchers = self._in_use, self._shared, self._reuse_watchers
        for block in listed:
            if block.extra_refs:
                block.extra_refs -= 1
                if not block.extra_refs:
                    shared.discard(block)
            else:
                in_use.discard(block)
                released.append(block)
            watchers[block.block_id] = on_reuse
        if self._policy is not None:
            self._policy.freed(released)
        else:
            self.free_block_queue.extend_unchecked(released)

    # -- 0.33's operations ----------------------------------------------------------------

    def _require_no_policy(self, operation: str) -> None:
        if self._policy is not None:
            raise PolicyNotSupportedError(
                f"{operation} moves keys between blocks, which the pool's eviction policy "
                f"{self._policy.name!r} does not follow")

    def _remove_keys(self, block: KVCacheBlock) -> list[tuple[int, bytes]]:
        """Drop every key of ``block`` (its primary key, then its partial entries) from the
        block and the map; returns them as (group id, block hash)."""
        block_hash = self._key_of.pop(block, None)
        if block_hash is None:
            return []
        group_id = self._group_of.pop(block, 0)
        self._tokens_of.pop(block, None)
        cache_map = self.cached_block_hash_to_block
        cache_map.remove_unchecked(group_id, block_hash, block)
        removed = [(group_id, block_hash)]
        extra = (self.cached_block_hashes_by_block.pop(block.block_id, None)
                 if self.cached_block_hashes_by_block else None)
        if extra:
            for key in extra:
                other_hash, other_group = key[:-4], int.from_bytes(key[-4:], "big")
                cache_map.remove_unchecked(other_group, other_hash, block)
                removed.append((other_group, other_hash))
        if self._policy is not None:
            self._policy.uncached([block])
        return removed

    def _removed_events(self, removed: list[tuple[int, bytes]]) -> None:
        """One 0.33 ``BlockRemoved`` per key, with its group."""
        if not self.enable_kv_cache_events or not removed:
            return
        event, medium = _events_033().BlockRemoved, self.medium
        self.kv_event_queue.extend(
            event(block_hashes=[maybe_convert_block_hash(BlockHash(block_hash))],
                  medium=medium, group_idx=group_id)
            for group_id, block_hash in removed)
        # Not bounded here: the operation that removed the keys bounds once at its end, when
        # its keys are in place (a snapshot taken midway would miss them).

    def _insert_key(self, group_id: int, block_hash: bytes, block: KVCacheBlock,
                    num_tokens: int | None) -> None:
        """Cache ``block`` under the key: its primary key (with ``num_tokens``) if it has none,
        else a partial entry; nothing when it is already cached under it."""
        primary = self._key_of.get(block)
        if primary is None:
            self._key_of[block] = block_hash
            if group_id:
                self._group_of[block] = group_id
            if num_tokens is not None:
                self._tokens_of[block] = num_tokens
        else:
            if primary == block_hash and self._group_of.get(block, 0) == group_id:
                return
            key = BlockHashWithGroupId(block_hash + group_id.to_bytes(4, "big"))
            extra = self.cached_block_hashes_by_block.get(block.block_id)
            if extra is None:
                self.cached_block_hashes_by_block[block.block_id] = {key}
            elif key in extra:
                return
            else:
                extra.add(key)
        self.cached_block_hash_to_block.insert_unchecked(group_id, block_hash, block)

    def _insert_block_hash(self, block_hash_with_group_id: HashBytes, block: BlockLike,
                           num_tokens: SupportsIndex | None) -> None:
        """vLLM 0.33's name, which its CPU-offloading manager calls: cache ``block`` under the
        key (primary key or partial entry), no event."""
        self._require_no_policy("_insert_block_hash")
        block_hash, group_id = split_key(block_hash_with_group_id)
        owned = self._own(block)
        if owned is self.null_block:
            raise BlockNotInPoolError("the null block is never cached")
        tokens = None if num_tokens is None else check_block_count("num_tokens", num_tokens)
        self._insert_key(check_group_id(group_id), block_hash, owned, tokens)

    def _maybe_evict_cached_block(self, block: BlockLike) -> bool:
        """vLLM 0.33's name, which its Mamba manager calls: drop every key of ``block`` (with
        their events); whether it had any."""
        owned = self._own(block)
        if self.metrics_collector is not None:
            self.metrics_collector.on_block_evicted(owned)
        removed = self._remove_keys(owned)
        self._removed_events(removed)
        if removed and self.enable_kv_cache_events and self.max_pending_kv_events is not None:
            self._bound_kv_events()
        return bool(removed)

    def _notify_reuse(self, blocks: Iterable[KVCacheBlock]) -> None:
        watchers = self._reuse_watchers
        for block in blocks:
            watcher = watchers.pop(block.block_id, None)
            if watcher is not None:
                watcher(block)

    def _foreign_blocks(self, blocks: list[Any]) -> dict[Any, list[Any]]:
        """The blocks another pool owns, by pool (a null block of any pool is skipped). Empty
        when all are this pool's, the common case."""
        foreign: dict[Any, list[Any]] = {}
        for block in blocks:
            pool = getattr(block, "pool", None)
            if pool is not None and pool is not self and callable(
                    getattr(pool, "free_blocks", None)):
                foreign.setdefault(pool, []).append(block)
        return foreign

    def _free_and_forward(self, blocks: list[Any], foreign: dict[Any, list[Any]]) -> None:
        """free_blocks() with other pools' blocks: this pool's first, then each other pool's
        list, forwarded to it in order (vLLM 0.33's multi-pool deferred frees)."""
        strangers = {id(b) for listed in foreign.values() for b in listed}
        own = [b for b in blocks if id(b) not in strangers
               and getattr(b, "is_null", False) is not True]
        self.free_blocks(own)
        for pool, listed in foreign.items():
            pool.free_blocks([b for b in listed if getattr(b, "is_null", False) is not True])

    def is_block_writable(self, block: BlockLike) -> bool:
        """Whether its sole owner may write the block (ref count 1, no key)."""
        if block is self.null_block:
            return False
        owned = self._own(block)
        return self._ref_count(owned) == 1 and owned not in self._key_of

    def move_block_hashes(self, src_block: BlockLike, dst_block: BlockLike) -> None:
        """Copy-on-write: every key of ``src_block`` moves to ``dst_block`` (the private copy),
        which has none; the entries stay live and no event is sent."""
        self._require_no_policy("move_block_hashes")
        src, dst = self._own(src_block), self._own(dst_block)
        null = self.null_block
        if src is null or dst is null:
            raise BlockNotInPoolError("the null block holds no keys")
        if dst in self._key_of or dst.block_id in self.cached_block_hashes_by_block:
            raise BlockAlreadyCachedError(
                f"block {dst.block_id} already has a key {dst.block_hash!r}")
        num_tokens = self._tokens_of.get(src)
        for group_id, block_hash in self._remove_keys(src):
            self._insert_key(group_id, block_hash, dst, num_tokens)

    def _event_keys(self, request: Any, start: int, end: int, mm_idx: int
                    ) -> tuple[tuple[Any, ...] | None, int]:
        """The tagged extra keys of tokens [start, end) for an event (with the lookahead
        tokens when the pool hashes them) and the next block's multimodal index."""
        lookahead = self.num_hash_lookahead_tokens
        if not lookahead:
            return generate_block_hash_extra_keys(request, start, end, mm_idx)
        keys, next_idx = generate_block_hash_extra_keys(request, start, end + lookahead, mm_idx)
        features = request.mm_features
        while next_idx > 0:  # rewind to the features that reach into the next block
            position = features[next_idx - 1].mm_position
            if position.offset + position.length <= end:
                break
            next_idx -= 1
        return keys, next_idx

    def _stored_event_033(self, request: Any, block_hashes: list[Any], parent: Any,
                          start: int, end: int, block_size: int, group_id: int,
                          extra_keys: list[tuple[Any, ...] | None],
                          lookahead_token_ids: list[list[int]] | None) -> Any:
        """vLLM 0.33's ``BlockStored``, with its optional fields."""
        lora = request.lora_request
        return _events_033().BlockStored(
            block_hashes=block_hashes,
            parent_block_hash=parent,
            token_ids=list(request.all_token_ids[start:end]),
            block_size=block_size,
            lora_id=None if lora is None else lora.adapter_id,
            medium=self.medium,
            lora_name=None if lora is None else lora.name,
            extra_keys=_event_extra_keys(extra_keys),
            group_idx=group_id,
            session_id=getattr(request, "session_id", None),
            lookahead_token_ids=lookahead_token_ids,
        )

    def _lookahead_ids(self, request: Any, end: int) -> list[int]:
        return list(request.all_token_ids[end : end + self.num_hash_lookahead_tokens])

    def emit_cached_block_events(self, request: RequestToCache, num_cached_blocks: SupportsIndex,
                                 block_size: SupportsIndex, kv_cache_group_id: SupportsIndex
                                 ) -> None:
        """The "full" report mode: one ``BlockStored`` for the request's first
        ``num_cached_blocks`` blocks, hit in the prefix cache; the pool does not change."""
        count = check_block_count("num_cached_blocks", num_cached_blocks)
        size = check_block_count("block_size", block_size, 1)
        group_id = check_group_id(kv_cache_group_id)
        if not self.enable_kv_cache_events or count == 0:
            return
        request_hashes = list(getattr(request, "block_hashes", ()))
        hashes: Sequence[BlockHash] = request_hashes
        if size != self.hash_block_size:
            hashes = _view_033(request_hashes, self.hash_block_size, size)
        if count > len(hashes):
            raise InvalidBlockHashError(
                f"cannot report {count} cached blocks with {len(hashes)} block hashes")
        extra_keys: list[tuple[Any, ...] | None] = []
        lookahead: list[list[int]] | None = [] if self.num_hash_lookahead_tokens else None
        mm_idx = 0
        for i in range(count):
            keys, mm_idx = self._event_keys(request, i * size, (i + 1) * size, mm_idx)
            extra_keys.append(keys)
            if lookahead is not None:
                lookahead.append(self._lookahead_ids(request, (i + 1) * size))
        self.kv_event_queue.append(self._stored_event_033(
            request, [maybe_convert_block_hash(hashes[i]) for i in range(count)], None, 0,
            count * size, size, group_id, extra_keys, lookahead))
        if self.max_pending_kv_events is not None:
            self._bound_kv_events()

    def cache_partial_block(
        self,
        request: RequestToCache,
        block: BlockLike,
        num_tokens: SupportsIndex,
        kv_cache_group_id: SupportsIndex,
        block_size: SupportsIndex,
        replace_existing_hashes: Flag = False,
    ) -> BlockHashWithGroupId | None:
        """Make ``block`` reachable from the prefix of ``num_tokens`` tokens (a multiple of the
        hash block size), the request's chain hash there: its primary key if it has none,
        else a partial entry. A block keyed by a shorter prefix, or every key with
        ``replace_existing_hashes``, loses its keys first. Returns the key (None for the null
        block)."""
        self._require_no_policy("cache_partial_block")
        if block is self.null_block:
            return None
        owned = self._own(block)
        tokens = check_block_count("num_tokens", num_tokens, 1)
        size = check_block_count("block_size", block_size, 1)
        group_id = check_group_id(kv_cache_group_id)
        replace = check_flag("replace_existing_hashes", replace_existing_hashes,
                             InvalidPoolConfigError)
        unit = self.hash_block_size
        request_hashes = getattr(request, "block_hashes", None)
        if type(request_hashes) is not list:
            raise InvalidRequestForCachingError(
                f"{request!r} is not a request: it has no list of block hashes")
        if size % unit or tokens % unit or tokens // unit > len(request_hashes):
            raise InvalidBlockCountError(
                f"num_tokens {tokens} and block_size {size} must be multiples of the hash "
                f"block size {unit}, within the request's {len(request_hashes)} hashes")
        num_hash_blocks = tokens // unit
        block_hash = request_hashes[num_hash_blocks - 1]
        if type(block_hash) is not bytes:
            raise InvalidBlockHashError(f"block hash must be bytes, got {block_hash!r}")
        key = BlockHashWithGroupId(block_hash + group_id.to_bytes(4, "big"))
        primary = self._key_of.get(owned)
        extra = self.cached_block_hashes_by_block.get(owned.block_id, ())
        already = (primary == block_hash and self._group_of.get(owned, 0) == group_id) or (
            key in extra)
        stored = None
        if self.enable_kv_cache_events and (replace or not already):
            start = (num_hash_blocks - 1) * unit
            parent = request_hashes[num_hash_blocks - 2] if num_hash_blocks > 1 else None
            mm_idx = 0
            features = request.mm_features if hasattr(request, "mm_features") else None
            if start > 0 and features:
                mm_idx = _first_mm_feature_ending_after(features, start)
            keys, _ = self._event_keys(request, start, tokens, mm_idx)
            stored = self._stored_event_033(
                request, [maybe_convert_block_hash(BlockHash(block_hash))],
                None if parent is None else maybe_convert_block_hash(parent), start, tokens,
                tokens - start, group_id, [keys],
                [self._lookahead_ids(request, tokens)] if self.num_hash_lookahead_tokens
                else None)
        # Nothing has changed yet; from here on nothing can fail.
        covered = self._tokens_of.get(owned)
        if replace or (not already and primary is not None and covered is not None
                       and covered < tokens):
            self._removed_events(self._remove_keys(owned))
        self._insert_key(group_id, block_hash, owned, tokens)
        if stored is not None:
            self.kv_event_queue.append(stored)
            # The group's block size, for a snapshot's BlockStored of this key (a group whose
            # keys are all partial entries has stored no full block to take it from).
            self._stored_block_sizes[group_id] = size
        if self.enable_kv_cache_events and self.max_pending_kv_events is not None:
            self._bound_kv_events()
        return key
