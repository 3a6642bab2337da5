"""Coordinators: one shared BlockPool and one single-type manager per KV-cache group.

vLLM 0.13's ``kv_cache_coordinator`` API (spec: spec/manager.py). The hybrid coordinator
generalises 0.13's "one full-attention type plus one other type" to any number of attention
types: the prefix-cache lookup runs each type in turn (full attention first) with the hit
length found so far as its limit, and repeats until a whole pass shortens nothing. With two
types this is exactly 0.13's two-step lookup.

Refused configs raise ``InvalidKVCacheConfig`` (a ``ValueError``) when the coordinator is built:
a group whose block size is not a multiple of ``hash_block_size``; prefix caching with a
cross-attention group (encoder-decoder models run without prefix caching); EAGLE with more
than one attention type; context parallelism with more than one attention type; sizes and
flags of the wrong type or out of range.

Every public method checks its arguments for all groups, in one block at its top, before any
group changes, and raises ``InvalidManagerArgument`` naming the bad value: a value only the
last group refuses has changed no group. Checked once (docs/architecture.md): where those
checks read the stack's state or scan a list (the slots a request holds, its cache hits, the
free blocks, its block hashes), the work after them is a twin named ``..._unchecked``
(``allocate_new_blocks_unchecked``, ...), and the public method is its checks plus the twin.
``KVCacheManager`` checks a scheduler's call once, before anything changes, then runs the
coordinator's twins, which run the group managers' twins; checking again at every layer
would double the allocation path's work. ``free``, ``has_blocks``, ``get_blocks`` and
``get_num_common_prefix_blocks`` check only that the request id is a str: they have no twin,
and a caller that has checked the id already pays one type comparison.
The checks a whole request needs live here: ``check_computed_tokens`` (no token counted as
computed without a slot in every group), ``check_keys`` (the hashes, token ids and LoRA that
keying a request's blocks reads) and ``check_hits`` (cache hits that are this request's: each
real block the one cached under the request's hash at its position).

A coordinator is built from a KV-cache config and a ``KVCacheSettings``, the sizes and flags
checked once by ``check_settings``; ``get_kv_cache_coordinator`` takes vLLM's arguments.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import SupportsIndex

from kvspec.impl.block_pool import new_pool
from kvspec.impl.checks import (
    MAX_NUM_TOKENS,
    Flag,
    Text,
    block_hashes_of,
    check_count,
    check_flag,
    check_request_id,
    check_world_sizes,
    request_id_of,
)
from kvspec.impl.errors import (
    InvalidKVCacheConfig,
    InvalidManagerArgument,
    InvalidPoolConfigError,
    PrefixCachingNotSupported,
)
from kvspec.impl.eviction import EvictionPolicy
from kvspec.impl.hashing import BlockHash, BlockHashListWithBlockSize
from kvspec.impl.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    KVCacheConfig,
    KVCacheConfigLike,
    KVCacheSpec,
    as_kv_cache_config,
)
from kvspec.impl.kv_cache_metrics import KVCacheMetricsCollector
from kvspec.impl.kv_cache_utils import KVCacheBlock
from kvspec.impl.request import RequestLike
from kvspec.impl.single_type_kv_cache_manager import (
    CrossAttentionManager,
    FullAttentionManager,
    SingleTypeKVCacheManager,
    check_block_hashes,
    check_block_list,
    get_manager_for_kv_cache_spec,
    spec_manager_map,
)

BlockHashList = list[BlockHash] | BlockHashListWithBlockSize

__all__ = [
    "HybridKVCacheCoordinator",
    "KVCacheCoordinator",
    "KVCacheCoordinatorNoPrefixCache",
    "KVCacheSettings",
    "UnitaryKVCacheCoordinator",
    "check_settings",
    "get_kv_cache_coordinator",
]


Groups = tuple[Sequence[KVCacheBlock], ...]


@dataclass(frozen=True)
class KVCacheSettings:
    """The settings the manager stack is built with, checked once: ``check_settings`` builds
    it from vLLM's constructor arguments, and ``KVCacheManager`` and ``get_kv_cache_coordinator``
    hand it to the coordinator, which builds the block pool and the single-type managers from
    it. ``metrics_collector`` and ``eviction_policy`` are the block pool's, checked by the
    pool (``InvalidPoolConfigError``), which owns them."""

    max_model_len: int
    use_eagle: bool
    enable_caching: bool
    enable_kv_cache_events: bool
    dcp_world_size: int
    pcp_world_size: int
    hash_block_size: int
    metrics_collector: KVCacheMetricsCollector | None = None
    max_pending_kv_events: int | None = None
    eviction_policy: EvictionPolicy | None = None


def check_settings(
    max_model_len: SupportsIndex,
    use_eagle: Flag,
    enable_caching: Flag,
    enable_kv_cache_events: Flag,
    dcp_world_size: SupportsIndex,
    pcp_world_size: SupportsIndex,
    hash_block_size: SupportsIndex,
    metrics_collector: KVCacheMetricsCollector | None = None,
    max_pending_kv_events: SupportsIndex | None = None,
    eviction_policy: EvictionPolicy | None = None,
) -> KVCacheSettings:
    """The settings, checked (``InvalidKVCacheConfig`` naming the value; a bad
    ``max_pending_kv_events`` ``InvalidPoolConfigError``, as the pool refuses it)."""
    dcp, pcp = check_world_sizes(dcp_world_size, pcp_world_size)
    max_len = check_count("max_model_len", max_model_len, low=1, error=InvalidKVCacheConfig)
    eagle = check_flag("use_eagle", use_eagle, InvalidKVCacheConfig)
    caching = check_flag("enable_caching", enable_caching, InvalidKVCacheConfig)
    events = check_flag("enable_kv_cache_events", enable_kv_cache_events, InvalidKVCacheConfig)
    hash_size = check_count("hash_block_size", hash_block_size, low=1,
                            error=InvalidKVCacheConfig)
    bound = None
    if max_pending_kv_events is not None:
        bound = check_count("max_pending_kv_events", max_pending_kv_events, low=1,
                            error=InvalidPoolConfigError)
    return KVCacheSettings(max_len, eagle, caching, events, dcp, pcp, hash_size,
                           metrics_collector, bound, eviction_policy)


class KVCacheCoordinator:
    """Drives one single-type manager per KV-cache group over one shared BlockPool. (Not an
    ``abc.ABC``, for the reason ``SingleTypeKVCacheManager`` gives.)

    Built from a KV-cache config and the checked ``KVCacheSettings`` (``get_kv_cache_coordinator``
    takes vLLM's arguments and builds both)."""

    def __init__(self, kv_cache_config: KVCacheConfigLike, settings: KVCacheSettings) -> None:
        # The caller's config (vLLM's own, in vLLM) is kept as given; impl computes with its
        # own equal config.
        self.kv_cache_config = kv_cache_config
        config = as_kv_cache_config(kv_cache_config)
        self.settings = settings
        self.max_model_len: int = settings.max_model_len
        self.use_eagle: bool = settings.use_eagle
        self.enable_caching: bool = settings.enable_caching
        self.dcp_world_size: int = settings.dcp_world_size
        self.pcp_world_size: int = settings.pcp_world_size
        self.hash_block_size: int = settings.hash_block_size
        self.block_pool = new_pool(config.num_blocks, settings.enable_caching,
                                   settings.hash_block_size, settings.enable_kv_cache_events,
                                   settings.metrics_collector,
                                   max_pending_kv_events=settings.max_pending_kv_events,
                                   eviction_policy=settings.eviction_policy)
        self.single_type_managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            get_manager_for_kv_cache_spec(
                group.kv_cache_spec,
                block_pool=self.block_pool,
                kv_cache_group_id=group_id,
                dcp_world_size=settings.dcp_world_size,
                pcp_world_size=settings.pcp_world_size,
            )
            for group_id, group in enumerate(kv_cache_config.kv_cache_groups)
        )
        # The groups that hold the decoder's tokens (cross-attention holds the encoder's).
        self._decoder_managers = tuple(
            m for m in self.single_type_managers if type(m) is not CrossAttentionManager)
        self.has_cross_attention = len(self._decoder_managers) < len(self.single_type_managers)

    # -- checks --------------------------------------------------------------------------

    def _check_groups(self, groups: object, what: str) -> Groups:
        """One list (or tuple) of blocks per KV-cache group."""
        if type(groups) is not tuple and type(groups) is not list:
            raise InvalidManagerArgument(
                f"{what} must be a tuple of one block list per KV-cache group, got {groups!r}")
        if len(groups) != len(self.single_type_managers):
            raise InvalidManagerArgument(
                f"{what} has {len(groups)} groups, the coordinator "
                f"{len(self.single_type_managers)}")
        return tuple(check_block_list(blocks, what) for blocks in groups)

    def check_computed_tokens(
        self, request_id: str, name: str, num_tokens: int,
        error: type[InvalidManagerArgument] = InvalidManagerArgument,
    ) -> None:
        """Refuse ``num_tokens`` computed tokens when a decoder group's blocks do not hold
        them: vLLM's callers give every token a slot before they count it as computed
        (async scheduling's placeholder tokens included)."""
        for manager in self._decoder_managers:
            held = manager.num_slots_held_unchecked(request_id)
            if num_tokens > held:
                raise error(
                    f"{name}={num_tokens} is more than the {held} tokens the blocks of "
                    f"request {request_id!r} hold in KV-cache group {manager.kv_cache_group_id}")

    def check_keys(
        self, request: object, request_id: str, num_tokens: int, num_hit_tokens: int,
        error: type[InvalidManagerArgument] = InvalidManagerArgument,
    ) -> None:
        """Refuse a request whose blocks filled by ``num_tokens`` tokens cannot be keyed: too
        few block hashes, a hash that is not bytes, and, with KV events on, token ids or a
        LoRA no ``BlockStored`` event can carry. Reads only what keying reads: the hashes
        (and tokens) from the first block not keyed yet (``num_hit_tokens``: cache hits about
        to be attached, which are keyed already)."""
        hashes = block_hashes_of(request, error)
        hash_block_size = self.hash_block_size
        end = num_tokens // hash_block_size
        if len(hashes) < end:
            raise error(
                f"request {request_id!r} has {len(hashes)} block hashes, too few to cache "
                f"{num_tokens} tokens (was it built with a block_hasher?)")
        first = self._first_unkeyed_token(request_id, num_hit_tokens) // hash_block_size
        if first >= end:
            return
        new: list[object] = hashes[first:end]  # untyped: any element may be a stranger
        if list(map(type, new)).count(bytes) != len(new):
            bad = next(h for h in new if type(h) is not bytes)
            raise error(
                f"request {request_id!r} has a block hash that is not bytes: {bad!r}")
        if self.block_pool.enable_kv_cache_events:
            _check_event_fields(request, request_id, first * hash_block_size,
                                end * hash_block_size, error)

    def _first_unkeyed_token(self, request_id: str, num_hit_tokens: int) -> int:
        """The first token of the first block not keyed yet in some group (cache hits about
        to be attached count as keyed)."""
        first = min((manager.num_cached_block.get(request_id, 0) * manager.block_size
                     for manager in self._decoder_managers), default=0)
        return first if first > num_hit_tokens else num_hit_tokens

    def check_hits(
        self, block_hashes: list[BlockHash], hits: Groups, num_hit_tokens: int,
        error: type[InvalidManagerArgument] = InvalidManagerArgument,
    ) -> None:
        """Refuse cache hits that are not this request's: per group, ``num_hit_tokens``
        tokens of blocks, null blocks only before the real ones and only where blocks slide
        out of the window, and each real block the one the pool has cached under the
        request's hash at its position (what ``find_longest_cache_hit`` gives)."""
        pool = self.block_pool
        null = pool.null_block
        hash_block_size = self.hash_block_size
        for group_id, (manager, blocks) in enumerate(
                zip(self.single_type_managers, hits, strict=True)):
            block_size = manager.block_size
            if len(blocks) * block_size != num_hit_tokens:
                raise error(
                    f"{len(blocks)} hit blocks of {block_size} tokens in KV-cache group "
                    f"{group_id} do not make num_new_computed_tokens={num_hit_tokens}")
            num_null = blocks.count(null) if manager.skips_blocks else 0
            if num_null and null in blocks[num_null:]:
                raise error(
                    f"null blocks after a real hit block in KV-cache group {group_id}: "
                    f"{list(blocks)!r}")
            if num_null == len(blocks):
                continue
            hashes: BlockHashList = block_hashes
            if block_size != hash_block_size:
                hashes = BlockHashListWithBlockSize(block_hashes, hash_block_size, block_size)
            if len(hashes) < len(blocks):
                raise error(
                    f"{len(blocks)} hit blocks in KV-cache group {group_id}, but the request "
                    f"has hashes for {len(hashes)} blocks of {block_size} tokens")
            # Read untyped: an element may be anything (the compiled build would check it).
            real: list[object] = list(blocks[num_null:])
            found = pool.get_cached_prefix(hashes[num_null:len(blocks)], group_id, len(real))
            if found != real:
                index = next(i for i, b in enumerate(real) if i >= len(found) or b is not found[i])
                raise error(
                    f"{real[index]!r} is not the block cached for the request's hash at "
                    f"position {num_null + index} of KV-cache group {group_id}")

    def check_cacheable(self, request: RequestLike, num_tokens: SupportsIndex,
                        high: int = MAX_NUM_TOKENS) -> int:
        """``num_tokens`` as an int if ``cache_blocks(request, num_tokens)`` can key every
        group's blocks: a request holding that many tokens' slots, whose hashes (and, with
        events on, token ids and LoRA) keying reads are sound. Also checked with prefix
        caching off, where nothing is keyed."""
        request_id = request_id_of(request)
        block_hashes_of(request)
        count = check_count("num_computed_tokens", num_tokens, high)
        self.check_computed_tokens(request_id, "num_computed_tokens", count)
        if self.enable_caching:
            self.check_keys(request, request_id, count, 0)
        return count

    # -- allocation ----------------------------------------------------------------------

    def get_num_blocks_to_allocate(
        self,
        request_id: Text,
        num_tokens: SupportsIndex,
        new_computed_blocks: Sequence[Sequence[KVCacheBlock]],
        num_encoder_tokens: SupportsIndex,
    ) -> int:
        """New blocks all groups need together. A group that needs none (its count is 0 or
        negative, e.g. cross-attention after its encoder blocks) adds 0: its surplus is not
        free for the other groups (vLLM 0.13 sums the raw counts)."""
        checked_id = check_request_id(request_id)
        count = check_count("num_tokens", num_tokens)
        groups = self._check_groups(new_computed_blocks, "new_computed_blocks")
        encoder = check_count("num_encoder_tokens", num_encoder_tokens)
        return self.get_num_blocks_to_allocate_unchecked(checked_id, count, groups, encoder)

    def get_num_blocks_to_allocate_unchecked(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Groups,
        num_encoder_tokens: int,
    ) -> int:
        total = 0
        for manager, computed in zip(self.single_type_managers, new_computed_blocks, strict=True):
            if type(manager) is CrossAttentionManager:
                wanted = manager.get_num_blocks_to_allocate_unchecked(
                    request_id, num_encoder_tokens, [])
            else:
                wanted = manager.get_num_blocks_to_allocate_unchecked(
                    request_id, num_tokens, computed)
            if wanted > 0:
                total += wanted
        return total

    def get_max_num_blocks_to_allocate(
        self,
        request_id: Text,
        num_tokens: SupportsIndex,
        new_computed_blocks: Sequence[Sequence[KVCacheBlock]],
        num_encoder_tokens: SupportsIndex,
    ) -> int:
        """An upper bound of ``get_num_blocks_to_allocate`` that counts every cache hit as
        evictable, so it never reads a ref count: when it fits, the exact count fits too."""
        checked_id = check_request_id(request_id)
        count = check_count("num_tokens", num_tokens)
        groups = self._check_groups(new_computed_blocks, "new_computed_blocks")
        encoder = check_count("num_encoder_tokens", num_encoder_tokens)
        return self.get_max_num_blocks_to_allocate_unchecked(checked_id, count, groups, encoder)

    def get_max_num_blocks_to_allocate_unchecked(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Groups,
        num_encoder_tokens: int,
    ) -> int:
        total = 0
        for manager in self.single_type_managers:
            if type(manager) is CrossAttentionManager:
                wanted = manager.get_num_blocks_to_allocate_unchecked(
                    request_id, num_encoder_tokens, [])
            else:
                wanted = manager.get_num_blocks_to_allocate_unchecked(request_id, num_tokens, ())
            if wanted > 0:
                total += wanted
        return total

    def num_blocks_freed_by_skip(
        self, request_id: Text, num_computed_tokens: SupportsIndex
    ) -> int:
        """Blocks ``remove_skipped_blocks`` would return to the free queue."""
        checked_id = check_request_id(request_id)
        count = check_count("num_computed_tokens", num_computed_tokens)
        self.check_computed_tokens(checked_id, "num_computed_tokens", count)
        return self.num_blocks_freed_by_skip_unchecked(checked_id, count)

    def num_blocks_freed_by_skip_unchecked(self, request_id: str, num_computed_tokens: int
                                           ) -> int:
        return sum(
            manager.num_blocks_freed_by_skip_unchecked(request_id, num_computed_tokens)
            for manager in self.single_type_managers
        )

    def save_new_computed_blocks(
        self, request_id: Text, new_computed_blocks: Sequence[Sequence[KVCacheBlock]],
    ) -> None:
        """Attach a new request's cache hits (already touched), every group checked first."""
        checked_id = check_request_id(request_id)
        groups = self._check_groups(new_computed_blocks, "new_computed_blocks")
        if any(groups) and self.has_blocks(checked_id):
            raise InvalidManagerArgument(
                f"request {checked_id!r} already holds blocks and cannot take cache hits")
        for manager, blocks in zip(self.single_type_managers, groups, strict=True):
            if blocks and type(manager) is CrossAttentionManager:
                raise PrefixCachingNotSupported(
                    f"cross-attention never has cache hits, got {len(blocks)} for request "
                    f"{checked_id!r}")
            manager.check_hits(checked_id, blocks)
        self.save_new_computed_blocks_unchecked(checked_id, groups)

    def save_new_computed_blocks_unchecked(self, request_id: str, new_computed_blocks: Groups
                                           ) -> None:
        for manager, computed in zip(self.single_type_managers, new_computed_blocks, strict=True):
            manager.save_new_computed_blocks_unchecked(request_id, computed)

    def allocate_new_blocks(
        self, request_id: Text, num_tokens: SupportsIndex,
        num_encoder_tokens: SupportsIndex = 0,
    ) -> tuple[list[KVCacheBlock], ...]:
        """Blocks for ``num_tokens`` tokens in every group (``num_encoder_tokens`` in
        cross-attention groups); more than the pool has free is refused before any group
        takes one."""
        checked_id = check_request_id(request_id)
        count = check_count("num_tokens", num_tokens)
        encoder = check_count("num_encoder_tokens", num_encoder_tokens)
        empty = tuple(() for _ in self.single_type_managers)
        wanted = self.get_num_blocks_to_allocate_unchecked(checked_id, count, empty, encoder)
        if wanted > self.block_pool.get_num_free_blocks():
            raise InvalidManagerArgument(
                f"num_tokens={count} (num_encoder_tokens={encoder}) needs {wanted} new "
                f"blocks, the pool has {self.block_pool.get_num_free_blocks()} free")
        return self.allocate_new_blocks_unchecked(checked_id, count, encoder)

    def allocate_new_blocks_unchecked(
        self, request_id: str, num_tokens: int, num_encoder_tokens: int = 0
    ) -> tuple[list[KVCacheBlock], ...]:
        return tuple(
            manager.allocate_new_blocks_unchecked(
                request_id,
                num_encoder_tokens if type(manager) is CrossAttentionManager else num_tokens,
            )
            for manager in self.single_type_managers
        )

    def cache_blocks(self, request: RequestLike, num_computed_tokens: SupportsIndex) -> None:
        """Key every group's blocks that ``num_computed_tokens`` tokens fill; everything
        keying reads is checked, for all groups, before the first is keyed."""
        count = self.check_cacheable(request, num_computed_tokens)
        self.cache_blocks_unchecked(request, count)

    def cache_blocks_unchecked(self, request: RequestLike, num_computed_tokens: int) -> None:
        for manager in self.single_type_managers:
            manager.cache_blocks_unchecked(request, num_computed_tokens)

    def free(self, request_id: Text) -> None:
        checked_id = request_id if type(request_id) is str else check_request_id(request_id)
        for manager in self.single_type_managers:
            manager.free(checked_id)

    def get_num_common_prefix_blocks(self, running_request_id: Text) -> list[int]:
        checked_id = (running_request_id if type(running_request_id) is str
                      else check_request_id(running_request_id))
        return [manager.get_num_common_prefix_blocks(checked_id)
                for manager in self.single_type_managers]

    def remove_skipped_blocks(
        self, request_id: Text, num_computed_tokens: SupportsIndex
    ) -> None:
        checked_id = check_request_id(request_id)
        count = check_count("num_computed_tokens", num_computed_tokens)
        self.check_computed_tokens(checked_id, "num_computed_tokens", count)
        self.remove_skipped_blocks_unchecked(checked_id, count)

    def remove_skipped_blocks_unchecked(self, request_id: str, num_computed_tokens: int) -> None:
        for manager in self.single_type_managers:
            manager.remove_skipped_blocks_unchecked(request_id, num_computed_tokens)

    def get_blocks(self, request_id: Text) -> tuple[list[KVCacheBlock], ...]:
        checked_id = request_id if type(request_id) is str else check_request_id(request_id)
        return tuple(
            manager.req_to_blocks.get(checked_id) or [] for manager in self.single_type_managers
        )

    def has_blocks(self, request_id: Text) -> bool:
        """Whether any group holds a block list for the request."""
        checked_id = request_id if type(request_id) is str else check_request_id(request_id)
        return any(checked_id in m.req_to_blocks for m in self.single_type_managers)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: SupportsIndex
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """Per group, the blocks of the longest prefix-cache hit, and its length in tokens.
        ``block_hashes``: a list of bytes, or a ``BlockHashListWithBlockSize`` over one."""
        hashes = check_block_hashes(block_hashes)
        length = check_count("max_cache_hit_length", max_cache_hit_length)
        return self.find_longest_cache_hit_unchecked(hashes, length)

    @abstractmethod
    def find_longest_cache_hit_unchecked(
        self, block_hashes: BlockHashList, max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        raise NotImplementedError(f"{type(self).__name__} has no prefix-cache lookup")


class KVCacheCoordinatorNoPrefixCache(KVCacheCoordinator):
    """Prefix caching off: any groups, no lookups."""

    def __init__(self, kv_cache_config: KVCacheConfigLike, settings: KVCacheSettings) -> None:
        if settings.enable_caching:
            raise InvalidKVCacheConfig(
                "KVCacheCoordinatorNoPrefixCache needs settings with enable_caching=False")
        super().__init__(kv_cache_config, settings)
        self.num_single_type_manager = len(self.single_type_managers)

    def get_num_common_prefix_blocks(self, running_request_id: Text) -> list[int]:
        if type(running_request_id) is not str:
            check_request_id(running_request_id)
        return [0] * self.num_single_type_manager

    def cache_blocks_unchecked(self, request: RequestLike, num_computed_tokens: int) -> None:
        """Nothing is keyed without prefix caching."""

    def find_longest_cache_hit_unchecked(
        self, block_hashes: BlockHashList, max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        return tuple([] for _ in range(self.num_single_type_manager)), 0


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """One KV-cache group (one attention type): lookups go straight to its manager."""

    def __init__(self, kv_cache_config: KVCacheConfigLike, settings: KVCacheSettings) -> None:
        eagle, caching, hash_size = (settings.use_eagle, settings.enable_caching,
                                     settings.hash_block_size)
        dcp, pcp = settings.dcp_world_size, settings.pcp_world_size
        config = as_kv_cache_config(kv_cache_config)
        groups = config.kv_cache_groups
        if len(groups) != 1:
            raise InvalidKVCacheConfig(
                f"UnitaryKVCacheCoordinator needs exactly 1 KV-cache group, got {len(groups)}"
            )
        spec = groups[0].kv_cache_spec
        block_size = spec.block_size * dcp * pcp
        if caching and block_size != hash_size:
            raise InvalidKVCacheConfig(
                f"with one KV-cache group the block size {block_size} must equal "
                f"hash_block_size {hash_size}"
            )
        _check_caching_supported(config, caching)
        if eagle and isinstance(spec, ChunkedLocalAttentionSpec):
            raise InvalidKVCacheConfig("chunked local attention does not support EAGLE")
        super().__init__(kv_cache_config, settings)
        self.kv_cache_spec: KVCacheSpec = spec
        self.block_size = block_size
        self._manager = self.single_type_managers[0]
        self._manager_class = type(self._manager)
        self._group_ids = [0]

    # One group: the per-group loops of the base class, without the loop.

    def check_computed_tokens(
        self, request_id: str, name: str, num_tokens: int,
        error: type[InvalidManagerArgument] = InvalidManagerArgument,
    ) -> None:
        if num_tokens and self._manager.num_slots_held_unchecked(request_id) < num_tokens:
            super().check_computed_tokens(request_id, name, num_tokens, error)

    def _first_unkeyed_token(self, request_id: str, num_hit_tokens: int) -> int:
        first = self._manager.num_cached_block.get(request_id, 0) * self.block_size
        return first if first > num_hit_tokens else num_hit_tokens

    def get_num_blocks_to_allocate_unchecked(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
        num_encoder_tokens: int,
    ) -> int:
        wanted = self._manager.get_num_blocks_to_allocate_unchecked(
            request_id, num_tokens, new_computed_blocks[0])
        return wanted if wanted > 0 else 0

    def get_max_num_blocks_to_allocate_unchecked(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
        num_encoder_tokens: int,
    ) -> int:
        wanted = self._manager.get_num_blocks_to_allocate_unchecked(request_id, num_tokens, ())
        return wanted if wanted > 0 else 0

    def num_blocks_freed_by_skip_unchecked(self, request_id: str, num_computed_tokens: int) -> int:
        return self._manager.num_blocks_freed_by_skip_unchecked(request_id, num_computed_tokens)

    def save_new_computed_blocks_unchecked(
        self, request_id: str, new_computed_blocks: tuple[Sequence[KVCacheBlock], ...]
    ) -> None:
        self._manager.save_new_computed_blocks_unchecked(request_id, new_computed_blocks[0])

    def allocate_new_blocks_unchecked(
        self, request_id: str, num_tokens: int, num_encoder_tokens: int = 0
    ) -> tuple[list[KVCacheBlock], ...]:
        return (self._manager.allocate_new_blocks_unchecked(request_id, num_tokens),)

    def cache_blocks_unchecked(self, request: RequestLike, num_computed_tokens: int) -> None:
        self._manager.cache_blocks_unchecked(request, num_computed_tokens)

    def free(self, request_id: Text) -> None:
        self._manager.free(request_id)  # one group: its check is the only one needed

    def remove_skipped_blocks_unchecked(self, request_id: str, num_computed_tokens: int) -> None:
        if self._manager.skips_blocks:
            self._manager.remove_skipped_blocks_unchecked(request_id, num_computed_tokens)

    def has_blocks(self, request_id: Text) -> bool:
        checked_id = request_id if type(request_id) is str else check_request_id(request_id)
        return checked_id in self._manager.req_to_blocks

    def find_longest_cache_hit_unchecked(
        self, block_hashes: BlockHashList, max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        hit = self._manager_class.find_longest_cache_hit_unchecked(
            block_hashes, max_cache_hit_length, self._group_ids, self.block_pool,
            self.kv_cache_spec, self.use_eagle, self.block_size, self.dcp_world_size,
            self.pcp_world_size,
        )
        return hit, len(hit[0]) * self.block_size


class HybridKVCacheCoordinator(KVCacheCoordinator):
    """Several attention types. Groups with equal specs are looked up together (a hit must
    hit in all of them); the types are looked up in turn until their hit lengths agree."""

    def __init__(self, kv_cache_config: KVCacheConfigLike, settings: KVCacheSettings) -> None:
        eagle, caching, hash_size = (settings.use_eagle, settings.enable_caching,
                                     settings.hash_block_size)
        dcp, pcp = settings.dcp_world_size, settings.pcp_world_size
        config = as_kv_cache_config(kv_cache_config)
        groups = config.kv_cache_groups
        if len(groups) < 2:
            raise InvalidKVCacheConfig(
                f"HybridKVCacheCoordinator needs at least 2 KV-cache groups, got {len(groups)}"
            )
        if dcp != 1 or pcp != 1:
            raise InvalidKVCacheConfig(
                "context parallelism (dcp/pcp > 1) needs a single KV-cache group"
            )
        if eagle:
            raise InvalidKVCacheConfig("EAGLE with several KV-cache groups is not supported")
        _check_caching_supported(config, caching)
        for group_id, group in enumerate(groups):
            if group.kv_cache_spec.block_size % hash_size:
                raise InvalidKVCacheConfig(
                    f"block size {group.kv_cache_spec.block_size} of KV-cache group {group_id} "
                    f"is not a multiple of hash_block_size {hash_size}"
                )
        super().__init__(kv_cache_config, settings)
        self.attention_types = _attention_types(config)
        self.lcm_block_size = math.lcm(*(spec.block_size for spec, _ in self.attention_types))
        for spec, _ in self.attention_types:
            if isinstance(spec, ChunkedLocalAttentionSpec) and spec.block_size != (
                self.lcm_block_size
            ):
                raise InvalidKVCacheConfig(
                    f"chunked local attention with block size {spec.block_size} cannot share a "
                    f"model with block sizes whose least common multiple is "
                    f"{self.lcm_block_size}"
                )
        self._lookups = [
            (spec, group_ids, type(self.single_type_managers[group_ids[0]]))
            for spec, group_ids in self.attention_types
        ]
        # A type with larger blocks reads hashes joined from the fine ones, which must be
        # bytes before they are joined (the pool checks only the hashes it is given).
        self._joins_hashes = any(spec.block_size != hash_size
                                 for spec, _ in self.attention_types)

    def verify_and_split_kv_cache_groups(self) -> None:
        """vLLM 0.13's view of a hybrid config as one full-attention type and one other type:
        sets ``full_attention_group_ids``, ``other_group_ids``, ``full_attention_spec``,
        ``other_spec``, their block sizes and manager classes, and ``full_attn_first``.

        kvspec's lookup does not need it (it takes any number of types, in any group order);
        it is here for callers of vLLM's API. Raises ``InvalidKVCacheConfig`` where 0.13's
        split does not apply: not exactly two types, or their group ids interleaved.
        """
        full = [(spec, ids) for spec, ids in self.attention_types if _is_full_attention(spec)]
        other = [(spec, ids) for spec, ids in self.attention_types if not _is_full_attention(spec)]
        if len(full) != 1 or len(other) != 1:
            raise InvalidKVCacheConfig(
                f"vLLM 0.13's hybrid split needs one full-attention spec and one other spec, "
                f"got {[spec for spec, _ in self.attention_types]!r}"
            )
        (full_spec, full_ids), (other_spec, other_ids) = full[0], other[0]
        if max(full_ids) < min(other_ids):
            full_attn_first = True
        elif max(other_ids) < min(full_ids):
            full_attn_first = False
        else:
            raise InvalidKVCacheConfig(
                f"full-attention groups {full_ids} and other groups {other_ids} interleave"
            )
        self.full_attention_group_ids = full_ids
        self.other_group_ids = other_ids
        self.full_attention_spec = full_spec
        self.other_spec = other_spec
        self.full_attention_block_size = full_spec.block_size
        self.other_block_size = other_spec.block_size
        self.full_attention_manager_cls = type(self.single_type_managers[full_ids[0]])
        self.other_attention_cls = type(self.single_type_managers[other_ids[0]])
        self.full_attn_first = full_attn_first

    def _hashes_for(self, block_hashes: BlockHashList, block_size: int) -> BlockHashList:
        if block_size == self.hash_block_size:
            return block_hashes
        return BlockHashListWithBlockSize(
            block_hashes, self.hash_block_size, block_size  # type: ignore[arg-type]
        )

    def find_longest_cache_hit_unchecked(
        self, block_hashes: BlockHashList, max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        if self._joins_hashes:
            check_block_hashes(block_hashes[:max_cache_hit_length // self.hash_block_size])
        hit_length = max_cache_hit_length
        hits: list[tuple[list[KVCacheBlock], ...]] = [() for _ in self._lookups]
        converged = False
        while not converged:
            converged = True
            for index, (spec, group_ids, manager_class) in enumerate(self._lookups):
                found = manager_class.find_longest_cache_hit_unchecked(
                    self._hashes_for(block_hashes, spec.block_size), hit_length, group_ids,
                    self.block_pool, spec, self.use_eagle, self.lcm_block_size,
                )
                hits[index] = found
                found_length = len(found[0]) * spec.block_size
                if found_length < hit_length:
                    hit_length = found_length
                    converged = False
        per_group: list[list[KVCacheBlock]] = [[] for _ in self.single_type_managers]
        for (_, group_ids, _), found in zip(self._lookups, hits, strict=True):
            for group_id, blocks in zip(group_ids, found, strict=True):
                per_group[group_id] = blocks
        return tuple(per_group), hit_length


def _attention_types(
    kv_cache_config: KVCacheConfig,
) -> list[tuple[KVCacheSpec, list[int]]]:
    """Distinct specs with the ids of their groups: full attention first, then the others in
    group order."""
    by_spec: dict[KVCacheSpec, list[int]] = {}
    for group_id, group in enumerate(kv_cache_config.kv_cache_groups):
        by_spec.setdefault(group.kv_cache_spec, []).append(group_id)
    types = list(by_spec.items())
    types.sort(key=lambda item: not _is_full_attention(item[0]))
    return types


def _is_full_attention(spec: KVCacheSpec) -> bool:
    manager_class = spec_manager_map.get(type(spec))
    return manager_class is not None and issubclass(manager_class, FullAttentionManager)


def _check_caching_supported(kv_cache_config: KVCacheConfig, enable_caching: bool) -> None:
    if not enable_caching:
        return
    for group_id, group in enumerate(kv_cache_config.kv_cache_groups):
        if isinstance(group.kv_cache_spec, CrossAttentionSpec):
            raise InvalidKVCacheConfig(
                f"KV-cache group {group_id} is cross-attention, which is never prefix-cached: "
                f"build the manager with enable_caching=False"
            )


def _check_event_fields(request: object, request_id: str, first_token: int,
                        end_token: int, error: type[InvalidManagerArgument]) -> None:
    """What a ``BlockStored`` event of tokens ``[first_token, end_token)`` reads of the
    request (the pool builds the event before it keys a block): int token ids, and a LoRA
    with an int ``adapter_id``."""
    tokens = getattr(request, "all_token_ids", None)
    try:
        chunk = tokens[first_token:end_token]  # type: ignore[index]
        types = list(map(type, chunk))
    except TypeError:
        types = []
    if len(types) != end_token - first_token or types.count(int) != len(types):
        raise error(
            f"request {request_id!r}: all_token_ids {tokens!r} do not hold "
            f"{end_token - first_token} int token ids from {first_token}")
    lora = getattr(request, "lora_request", None)
    if lora is not None and type(getattr(lora, "adapter_id", None)) is not int:
        raise error(
            f"request {request_id!r}: its lora_request {lora!r} has no int adapter_id")


def get_kv_cache_coordinator(
    kv_cache_config: KVCacheConfigLike,
    max_model_len: SupportsIndex,
    use_eagle: Flag,
    enable_caching: Flag,
    enable_kv_cache_events: Flag,
    dcp_world_size: SupportsIndex,
    pcp_world_size: SupportsIndex,
    hash_block_size: SupportsIndex,
    metrics_collector: KVCacheMetricsCollector | None = None,
    *,
    max_pending_kv_events: SupportsIndex | None = None,
    eviction_policy: EvictionPolicy | None = None,
) -> KVCacheCoordinator:
    """No prefix cache when caching is off; unitary for one group; hybrid otherwise (vLLM's
    arguments, checked once into a ``KVCacheSettings``)."""
    settings = check_settings(max_model_len, use_eagle, enable_caching, enable_kv_cache_events,
                              dcp_world_size, pcp_world_size, hash_block_size,
                              metrics_collector, max_pending_kv_events, eviction_policy)
    return coordinator_for(kv_cache_config, settings)


def coordinator_for(kv_cache_config: KVCacheConfigLike, settings: KVCacheSettings
                    ) -> KVCacheCoordinator:
    """``get_kv_cache_coordinator`` for settings already checked."""
    if not settings.enable_caching:
        return KVCacheCoordinatorNoPrefixCache(kv_cache_config, settings)
    if len(as_kv_cache_config(kv_cache_config).kv_cache_groups) == 1:
        return UnitaryKVCacheCoordinator(kv_cache_config, settings)
    return HybridKVCacheCoordinator(kv_cache_config, settings)
