"""KVCacheManager: what a scheduler calls (vLLM 0.13's API; spec: spec/manager.py).

``allocate_slots`` runs the five stages of seed 002 (free skipped blocks, capacity check,
attach cache hits, allocate new blocks, cache newly full blocks) as one transaction: every
input is checked and the capacity is counted (including the blocks stage 1 would free) before
anything changes, so a refused call or a ``None`` (not enough free blocks) leaves the manager,
its coordinator and the pool exactly as they were. (vLLM 0.13 frees the skipped blocks before
its capacity check, even when it then returns ``None``.)

``free`` of a request the manager holds no blocks for is a no-op, as in vLLM, whose scheduler
frees every finished request, including ones that never got blocks; build the manager with
``strict_free=True`` to have it raise ``UnknownRequestError`` instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

from mypy_extensions import mypyc_attr

from kvspec.impl import host_types
from kvspec.impl.errors import (
    InvalidAllocationError as InvalidAllocationError,
    UnknownRequestError as UnknownRequestError,
)
from kvspec.impl.kv_cache_coordinator import KVCacheCoordinator, get_kv_cache_coordinator
from kvspec.impl.kv_cache_interface import KVCacheConfigLike
from kvspec.impl.kv_cache_metrics import KVCacheMetricsCollector
from kvspec.impl.kv_cache_utils import KVCacheBlock
from kvspec.impl.kv_events import KVCacheEvent
from kvspec.impl.request import Request as Request, RequestLike
from kvspec.impl.single_type_kv_cache_manager import (
    InvalidKVCacheConfig,
    KVCacheManagerError,
    PrefixCachingNotSupported,
    UnsupportedKVCacheSpec,
)
from kvspec.impl.stats import PrefixCacheStats as PrefixCacheStats

__all__ = [
    "InvalidAllocationError",
    "InvalidKVCacheConfig",
    "KVCacheBlocks",
    "KVCacheManager",
    "KVCacheManagerError",
    "PrefixCacheStats",
    "PrefixCachingNotSupported",
    "Request",
    "UnknownRequestError",
    "UnsupportedKVCacheSpec",
]


@dataclass
class KVCacheBlocks:
    """The blocks of one request, per KV-cache group: ``blocks[group][i]``."""

    blocks: tuple[Sequence[KVCacheBlock], ...]

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        return KVCacheBlocks(
            tuple(list(chain(a, b)) for a, b in zip(self.blocks, other.blocks, strict=True))
        )

    def get_block_ids(self, allow_none: bool = False) -> tuple[list[int], ...] | None:
        """Per group, the block ids; with ``allow_none``, None when every group is empty."""
        if allow_none and all(len(group) == 0 for group in self.blocks):
            return None
        return tuple([block.block_id for block in group] for group in self.blocks)

    def get_unhashed_block_ids(self) -> list[int]:
        """Ids of the blocks without a prefix-cache key (one group only)."""
        if len(self.blocks) != 1:
            raise InvalidAllocationError(
                f"get_unhashed_block_ids needs exactly one KV-cache group, got {len(self.blocks)}"
            )
        return [block.block_id for block in self.blocks[0] if block.block_hash is None]

    def new_empty(self) -> KVCacheBlocks:
        return KVCacheBlocks(tuple(() for _ in self.blocks))


def _count(name: str, value: object) -> int:
    if type(value) is not int or value < 0:
        raise InvalidAllocationError(f"{name} must be an int >= 0, got {value!r}")
    return value


@mypyc_attr(allow_interpreted_subclasses=True)
class KVCacheManager:
    """Allocates, looks up and frees the KV-cache blocks of requests."""

    def __init__(
        self,
        kv_cache_config: KVCacheConfigLike,
        max_model_len: int,
        hash_block_size: int,
        enable_caching: bool = True,
        use_eagle: bool = False,
        log_stats: bool = False,
        enable_kv_cache_events: bool = False,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
        metrics_collector: KVCacheMetricsCollector | None = None,
        *,
        strict_free: bool = False,
    ) -> None:
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.use_eagle = use_eagle
        self.log_stats = log_stats
        self.strict_free = strict_free
        self.hash_block_size = hash_block_size
        self.coordinator: KVCacheCoordinator = get_kv_cache_coordinator(
            kv_cache_config=kv_cache_config,
            max_model_len=max_model_len,
            use_eagle=use_eagle,
            enable_caching=enable_caching,
            enable_kv_cache_events=enable_kv_cache_events,
            dcp_world_size=dcp_world_size,
            pcp_world_size=pcp_world_size,
            hash_block_size=hash_block_size,
            metrics_collector=metrics_collector,
        )
        self.kv_cache_config = kv_cache_config
        self.num_kv_cache_groups = len(kv_cache_config.kv_cache_groups)
        self.block_pool = self.coordinator.block_pool
        self.prefix_cache_stats: PrefixCacheStats | None = (
            host_types.PrefixCacheStats() if log_stats else None
        )
        # Compared by identity: "no cache hits" (the GC-friendly shared empty result).
        self.empty_kv_cache_blocks = KVCacheBlocks(
            tuple(() for _ in range(self.num_kv_cache_groups))
        )
        self._unitary = self.num_kv_cache_groups == 1

    # -- accounting ----------------------------------------------------------------------

    @property
    def usage(self) -> float:
        """The fraction of the non-null blocks in use."""
        return self.block_pool.get_usage()

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The stats gathered since the last call (None when log_stats is off)."""
        if not self.log_stats:
            return None
        stats = self.prefix_cache_stats
        self.prefix_cache_stats = host_types.PrefixCacheStats()
        return stats

    # -- lookup --------------------------------------------------------------------------

    def get_computed_blocks(self, request: RequestLike) -> tuple[KVCacheBlocks, int]:
        """The longest cached prefix of the request, at most ``num_tokens - 1`` tokens (the
        last token is always recomputed to get its logits), and its length in tokens."""
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return self.empty_kv_cache_blocks, 0
        max_cache_hit_length = request.num_tokens - 1
        computed_blocks, num_new_computed_tokens = self.coordinator.find_longest_cache_hit(
            request.block_hashes, max_cache_hit_length
        )
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.record(
                num_tokens=request.num_tokens,
                num_hits=num_new_computed_tokens,
                preempted=request.num_preemptions > 0,
            )
        return self.create_kv_cache_blocks(computed_blocks), num_new_computed_tokens

    # -- allocation ----------------------------------------------------------------------

    def allocate_slots(
        self,
        request: RequestLike,
        num_new_tokens: int | object,
        num_new_computed_tokens: int | object = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int | object = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int | object = 0,
    ) -> KVCacheBlocks | None:
        """Give the request slots for ``num_new_tokens`` more tokens (plus lookahead slots),
        after attaching the cache hits ``new_computed_blocks``; return the new blocks, or None
        (and change nothing) when the pool has too few free blocks.

        Layout of the request's tokens::

            | computed | new computed | new | lookahead |
                       |<------- needs slots -------->|
            |<----- cached when full ----->|
        """
        if type(num_new_tokens) is not int or num_new_tokens <= 0:
            raise InvalidAllocationError(
                f"num_new_tokens must be greater than 0, got {num_new_tokens!r}"
            )
        num_new_computed_tokens = _count("num_new_computed_tokens", num_new_computed_tokens)
        num_lookahead_tokens = _count("num_lookahead_tokens", num_lookahead_tokens)
        num_encoder_tokens = _count("num_encoder_tokens", num_encoder_tokens)
        coordinator = self.coordinator
        request_id = request.request_id
        empty = self.empty_kv_cache_blocks.blocks
        if new_computed_blocks is None:
            new_computed = empty
        else:
            new_computed = new_computed_blocks.blocks
            if len(new_computed) != self.num_kv_cache_groups:
                raise InvalidAllocationError(
                    f"new_computed_blocks has {len(new_computed)} groups, the manager "
                    f"{self.num_kv_cache_groups}"
                )
        has_hits = new_computed is not empty and any(new_computed)
        if has_hits:
            if not self.enable_caching:
                raise InvalidAllocationError(
                    f"request {request_id!r} brings cache hits but prefix caching is off"
                )
            if coordinator.has_blocks(request_id):
                raise InvalidAllocationError(
                    f"request {request_id!r} already holds blocks and cannot take cache hits"
                )
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_tokens_need_slot = min(
            num_computed_tokens + num_new_tokens + num_lookahead_tokens, self.max_model_len
        )
        num_tokens_to_cache = min(num_computed_tokens + num_new_tokens, request.num_tokens)
        caching_now = self.enable_caching and not delay_cache_blocks
        if caching_now and (
            len(request.block_hashes) < num_tokens_to_cache // self.hash_block_size
        ):
            raise InvalidAllocationError(
                f"request {request_id!r} has {len(request.block_hashes)} block hashes, too few "
                f"to cache {num_tokens_to_cache} tokens (was it built with a block_hasher?)"
            )

        # Stage 2 first: count, change nothing. The bound that takes every hit for a free
        # block settles most calls without reading a ref count.
        num_free = self.block_pool.get_num_free_blocks()
        if coordinator.get_max_num_blocks_to_allocate(
            request_id, num_tokens_need_slot, new_computed, num_encoder_tokens
        ) > num_free:
            num_blocks_to_allocate = coordinator.get_num_blocks_to_allocate(
                request_id, num_tokens_need_slot, new_computed, num_encoder_tokens
            )
            if num_blocks_to_allocate > num_free and num_blocks_to_allocate > num_free + (
                coordinator.num_blocks_freed_by_skip(request_id, request.num_computed_tokens)
            ):
                return None

        # Stage 1: blocks that slid out of the window go back to the pool.
        coordinator.remove_skipped_blocks(request_id, request.num_computed_tokens)
        # Stage 3: attach the cache hits.
        if new_computed is not empty:
            if self.enable_caching:
                self.block_pool.touch(new_computed)
            coordinator.save_new_computed_blocks(request_id, new_computed)
        # Stage 4: new blocks.
        new_blocks = coordinator.allocate_new_blocks(
            request_id, num_tokens_need_slot, num_encoder_tokens
        )
        # Stage 5: key the blocks that are full now (never lookahead/draft tokens).
        if caching_now:
            coordinator.cache_blocks(request, num_tokens_to_cache)
        return self.create_kv_cache_blocks(new_blocks)

    def free(self, request: RequestLike) -> None:
        """Release the request's blocks, each group's last block first."""
        request_id = request.request_id
        if self.strict_free and not self.coordinator.has_blocks(request_id):
            raise UnknownRequestError(f"the manager holds no blocks for request {request_id!r}")
        self.coordinator.free(request_id)

    def cache_blocks(self, request: RequestLike, num_computed_tokens: int) -> None:
        """Key the request's blocks that ``num_computed_tokens`` tokens fill."""
        if self.enable_caching:
            self.coordinator.cache_blocks(request, num_computed_tokens)

    # -- prefix cache --------------------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while any request holds blocks."""
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True

    def evict_blocks(self, block_ids: set[int]) -> None:
        self.block_pool.evict_blocks(block_ids)

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Per group, the leading blocks every running request shares."""
        return self.coordinator.get_num_common_prefix_blocks(running_request_id)

    def take_events(self) -> list[KVCacheEvent]:
        return self.block_pool.take_events()

    # -- views ---------------------------------------------------------------------------

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return self.create_kv_cache_blocks(self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return tuple(
            [block.block_id for block in group]
            for group in self.coordinator.get_blocks(request_id)
        )

    def create_kv_cache_blocks(
        self, blocks: tuple[Sequence[KVCacheBlock], ...]
    ) -> KVCacheBlocks:
        """``KVCacheBlocks(blocks)``, or the shared empty one when every group is empty."""
        if self._unitary:
            return KVCacheBlocks(blocks) if blocks[0] else self.empty_kv_cache_blocks
        return KVCacheBlocks(blocks) if any(blocks) else self.empty_kv_cache_blocks
