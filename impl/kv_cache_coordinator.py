"""Coordinators: one shared BlockPool and one single-type manager per KV-cache group.

vLLM 0.13's ``kv_cache_coordinator`` API (spec: spec/manager.py). The hybrid coordinator
generalises 0.13's "one full-attention type plus one other type" to any number of attention
types: the prefix-cache lookup runs each type in turn (full attention first) with the hit
length found so far as its limit, and repeats until a whole pass shortens nothing. With two
types this is exactly 0.13's two-step lookup.

Refused configs raise ``InvalidKVCacheConfig`` (a ``ValueError``) when the coordinator is built:
a group whose block size is not a multiple of ``hash_block_size``; prefix caching with a
cross-attention group (encoder-decoder models run without prefix caching); EAGLE with more
than one attention type; context parallelism with more than one attention type.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence

from kvspec.impl.block_pool import BlockPool
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
    InvalidKVCacheConfig,
    SingleTypeKVCacheManager,
    get_manager_for_kv_cache_spec,
    spec_manager_map,
)

BlockHashList = list[BlockHash] | BlockHashListWithBlockSize

__all__ = [
    "HybridKVCacheCoordinator",
    "KVCacheCoordinator",
    "KVCacheCoordinatorNoPrefixCache",
    "UnitaryKVCacheCoordinator",
    "get_kv_cache_coordinator",
]


def _require_positive_int(name: str, value: object) -> None:
    if type(value) is not int or value < 1:
        raise InvalidKVCacheConfig(f"{name} must be a positive int, got {value!r}")


class KVCacheCoordinator(ABC):
    """Drives one single-type manager per KV-cache group over one shared BlockPool."""

    def __init__(
        self,
        kv_cache_config: KVCacheConfigLike,
        max_model_len: int,
        use_eagle: bool,
        enable_caching: bool,
        enable_kv_cache_events: bool,
        dcp_world_size: int,
        pcp_world_size: int,
        hash_block_size: int,
        metrics_collector: KVCacheMetricsCollector | None = None,
    ) -> None:
        _require_positive_int("max_model_len", max_model_len)
        _require_positive_int("hash_block_size", hash_block_size)
        _require_positive_int("dcp_world_size", dcp_world_size)
        _require_positive_int("pcp_world_size", pcp_world_size)
        # The caller's config (vLLM's own, in vLLM) is kept as given; impl computes with its
        # own equal config.
        self.kv_cache_config = kv_cache_config
        config = as_kv_cache_config(kv_cache_config)
        self.max_model_len = max_model_len
        self.use_eagle = use_eagle
        self.enable_caching = enable_caching
        self.dcp_world_size = dcp_world_size
        self.pcp_world_size = pcp_world_size
        self.hash_block_size = hash_block_size
        self.block_pool = BlockPool(
            config.num_blocks, enable_caching, hash_block_size,
            enable_kv_cache_events, metrics_collector,
        )
        self.single_type_managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            get_manager_for_kv_cache_spec(
                group.kv_cache_spec,
                block_pool=self.block_pool,
                kv_cache_group_id=group_id,
                dcp_world_size=dcp_world_size,
                pcp_world_size=pcp_world_size,
            )
            for group_id, group in enumerate(kv_cache_config.kv_cache_groups)
        )

    # -- allocation ----------------------------------------------------------------------

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
        num_encoder_tokens: int,
    ) -> int:
        """New blocks all groups need together. A group that needs none (its count is 0 or
        negative, e.g. cross-attention after its encoder blocks) adds 0: its surplus is not
        free for the other groups (vLLM 0.13 sums the raw counts)."""
        total = 0
        for manager, computed in zip(self.single_type_managers, new_computed_blocks, strict=True):
            if type(manager) is CrossAttentionManager:
                wanted = manager.get_num_blocks_to_allocate(request_id, num_encoder_tokens, [])
            else:
                wanted = manager.get_num_blocks_to_allocate(request_id, num_tokens, computed)
            if wanted > 0:
                total += wanted
        return total

    def get_max_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
        num_encoder_tokens: int,
    ) -> int:
        """An upper bound of ``get_num_blocks_to_allocate`` that counts every cache hit as
        evictable, so it never reads a ref count: when it fits, the exact count fits too."""
        total = 0
        for manager, _computed in zip(self.single_type_managers, new_computed_blocks, strict=True):
            if type(manager) is CrossAttentionManager:
                wanted = manager.get_num_blocks_to_allocate(request_id, num_encoder_tokens, [])
            else:
                wanted = manager.get_num_blocks_to_allocate(request_id, num_tokens, ())
            if wanted > 0:
                total += wanted
        return total

    def num_blocks_freed_by_skip(self, request_id: str, num_computed_tokens: int) -> int:
        """Blocks ``remove_skipped_blocks`` would return to the free queue."""
        return sum(
            manager.num_blocks_freed_by_skip(request_id, num_computed_tokens)
            for manager in self.single_type_managers
        )

    def save_new_computed_blocks(
        self, request_id: str, new_computed_blocks: tuple[Sequence[KVCacheBlock], ...]
    ) -> None:
        for manager, computed in zip(self.single_type_managers, new_computed_blocks, strict=True):
            manager.save_new_computed_blocks(request_id, computed)

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_encoder_tokens: int = 0
    ) -> tuple[list[KVCacheBlock], ...]:
        return tuple(
            manager.allocate_new_blocks(
                request_id,
                num_encoder_tokens if type(manager) is CrossAttentionManager else num_tokens,
            )
            for manager in self.single_type_managers
        )

    def cache_blocks(self, request: RequestLike, num_computed_tokens: int) -> None:
        for manager in self.single_type_managers:
            manager.cache_blocks(request, num_computed_tokens)

    def free(self, request_id: str) -> None:
        for manager in self.single_type_managers:
            manager.free(request_id)

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        return [
            manager.get_num_common_prefix_blocks(running_request_id)
            for manager in self.single_type_managers
        ]

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for manager in self.single_type_managers:
            manager.remove_skipped_blocks(request_id, num_computed_tokens)

    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        return tuple(
            manager.req_to_blocks.get(request_id) or [] for manager in self.single_type_managers
        )

    def has_blocks(self, request_id: str) -> bool:
        """Whether any group holds a block list for the request."""
        return any(request_id in m.req_to_blocks for m in self.single_type_managers)

    @abstractmethod
    def find_longest_cache_hit(
        self, block_hashes: BlockHashList, max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """Per group, the blocks of the longest prefix-cache hit, and its length in tokens."""


class KVCacheCoordinatorNoPrefixCache(KVCacheCoordinator):
    """Prefix caching off: any groups, no lookups."""

    def __init__(
        self,
        kv_cache_config: KVCacheConfigLike,
        max_model_len: int,
        use_eagle: bool,
        enable_kv_cache_events: bool,
        dcp_world_size: int,
        pcp_world_size: int,
        hash_block_size: int,
        metrics_collector: KVCacheMetricsCollector | None = None,
    ) -> None:
        super().__init__(
            kv_cache_config, max_model_len, use_eagle, False, enable_kv_cache_events,
            dcp_world_size, pcp_world_size, hash_block_size, metrics_collector,
        )
        self.num_single_type_manager = len(self.single_type_managers)

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        return [0] * self.num_single_type_manager

    def find_longest_cache_hit(
        self, block_hashes: BlockHashList, max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        return tuple([] for _ in range(self.num_single_type_manager)), 0


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """One KV-cache group (one attention type): lookups go straight to its manager."""

    def __init__(
        self,
        kv_cache_config: KVCacheConfigLike,
        max_model_len: int,
        use_eagle: bool,
        enable_caching: bool,
        enable_kv_cache_events: bool,
        dcp_world_size: int,
        pcp_world_size: int,
        hash_block_size: int,
        metrics_collector: KVCacheMetricsCollector | None = None,
    ) -> None:
        config = as_kv_cache_config(kv_cache_config)
        groups = config.kv_cache_groups
        if len(groups) != 1:
            raise InvalidKVCacheConfig(
                f"UnitaryKVCacheCoordinator needs exactly 1 KV-cache group, got {len(groups)}"
            )
        spec = groups[0].kv_cache_spec
        block_size = spec.block_size * dcp_world_size * pcp_world_size
        if enable_caching and block_size != hash_block_size:
            raise InvalidKVCacheConfig(
                f"with one KV-cache group the block size {block_size} must equal "
                f"hash_block_size {hash_block_size}"
            )
        _check_caching_supported(config, enable_caching)
        if use_eagle and isinstance(spec, ChunkedLocalAttentionSpec):
            raise InvalidKVCacheConfig("chunked local attention does not support EAGLE")
        super().__init__(
            kv_cache_config, max_model_len, use_eagle, enable_caching, enable_kv_cache_events,
            dcp_world_size, pcp_world_size, hash_block_size, metrics_collector,
        )
        self.kv_cache_spec: KVCacheSpec = spec
        self.block_size = block_size
        self._manager = self.single_type_managers[0]
        self._manager_class = type(self._manager)
        self._group_ids = [0]

    # One group: the per-group loops of the base class, without the loop.

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
        num_encoder_tokens: int,
    ) -> int:
        wanted = self._manager.get_num_blocks_to_allocate(
            request_id, num_tokens, new_computed_blocks[0])
        return wanted if wanted > 0 else 0

    def get_max_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
        num_encoder_tokens: int,
    ) -> int:
        wanted = self._manager.get_num_blocks_to_allocate(request_id, num_tokens, ())
        return wanted if wanted > 0 else 0

    def num_blocks_freed_by_skip(self, request_id: str, num_computed_tokens: int) -> int:
        return self._manager.num_blocks_freed_by_skip(request_id, num_computed_tokens)

    def save_new_computed_blocks(
        self, request_id: str, new_computed_blocks: tuple[Sequence[KVCacheBlock], ...]
    ) -> None:
        self._manager.save_new_computed_blocks(request_id, new_computed_blocks[0])

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_encoder_tokens: int = 0
    ) -> tuple[list[KVCacheBlock], ...]:
        return (self._manager.allocate_new_blocks(request_id, num_tokens),)

    def cache_blocks(self, request: RequestLike, num_computed_tokens: int) -> None:
        self._manager.cache_blocks(request, num_computed_tokens)

    def free(self, request_id: str) -> None:
        self._manager.free(request_id)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        if self._manager.skips_blocks:
            self._manager.remove_skipped_blocks(request_id, num_computed_tokens)

    def has_blocks(self, request_id: str) -> bool:
        return request_id in self._manager.req_to_blocks

    def find_longest_cache_hit(
        self, block_hashes: BlockHashList, max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        hit = self._manager_class.find_longest_cache_hit(
            block_hashes, max_cache_hit_length, self._group_ids, self.block_pool,
            self.kv_cache_spec, self.use_eagle, self.block_size, self.dcp_world_size,
            self.pcp_world_size,
        )
        return hit, len(hit[0]) * self.block_size


class HybridKVCacheCoordinator(KVCacheCoordinator):
    """Several attention types. Groups with equal specs are looked up together (a hit must
    hit in all of them); the types are looked up in turn until their hit lengths agree."""

    def __init__(
        self,
        kv_cache_config: KVCacheConfigLike,
        max_model_len: int,
        use_eagle: bool,
        enable_caching: bool,
        enable_kv_cache_events: bool,
        dcp_world_size: int,
        pcp_world_size: int,
        hash_block_size: int,
        metrics_collector: KVCacheMetricsCollector | None = None,
    ) -> None:
        config = as_kv_cache_config(kv_cache_config)
        groups = config.kv_cache_groups
        if len(groups) < 2:
            raise InvalidKVCacheConfig(
                f"HybridKVCacheCoordinator needs at least 2 KV-cache groups, got {len(groups)}"
            )
        if dcp_world_size != 1 or pcp_world_size != 1:
            raise InvalidKVCacheConfig(
                "context parallelism (dcp/pcp > 1) needs a single KV-cache group"
            )
        if use_eagle:
            raise InvalidKVCacheConfig("EAGLE with several KV-cache groups is not supported")
        _check_caching_supported(config, enable_caching)
        for group_id, group in enumerate(groups):
            if group.kv_cache_spec.block_size % hash_block_size:
                raise InvalidKVCacheConfig(
                    f"block size {group.kv_cache_spec.block_size} of KV-cache group {group_id} "
                    f"is not a multiple of hash_block_size {hash_block_size}"
                )
        super().__init__(
            kv_cache_config, max_model_len, use_eagle, enable_caching, enable_kv_cache_events,
            dcp_world_size, pcp_world_size, hash_block_size, metrics_collector,
        )
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

    def find_longest_cache_hit(
        self, block_hashes: BlockHashList, max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        hit_length = max_cache_hit_length
        hits: list[tuple[list[KVCacheBlock], ...]] = [() for _ in self._lookups]
        converged = False
        while not converged:
            converged = True
            for index, (spec, group_ids, manager_class) in enumerate(self._lookups):
                found = manager_class.find_longest_cache_hit(
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


def get_kv_cache_coordinator(
    kv_cache_config: KVCacheConfigLike,
    max_model_len: int,
    use_eagle: bool,
    enable_caching: bool,
    enable_kv_cache_events: bool,
    dcp_world_size: int,
    pcp_world_size: int,
    hash_block_size: int,
    metrics_collector: KVCacheMetricsCollector | None = None,
) -> KVCacheCoordinator:
    """No prefix cache when caching is off; unitary for one group; hybrid otherwise."""
    if not enable_caching:
        return KVCacheCoordinatorNoPrefixCache(
            kv_cache_config, max_model_len, use_eagle, enable_kv_cache_events,
            dcp_world_size, pcp_world_size, hash_block_size, metrics_collector,
        )
    if len(kv_cache_config.kv_cache_groups) == 1:
        return UnitaryKVCacheCoordinator(
            kv_cache_config, max_model_len, use_eagle, enable_caching, enable_kv_cache_events,
            dcp_world_size, pcp_world_size, hash_block_size, metrics_collector,
        )
    return HybridKVCacheCoordinator(
        kv_cache_config, max_model_len, use_eagle, enable_caching, enable_kv_cache_events,
        dcp_world_size, pcp_world_size, hash_block_size, metrics_collector,
    )
