"""KVCacheManager: what a scheduler calls (vLLM 0.13's API; spec: spec/manager.py).

``allocate_slots`` runs vLLM 0.13's five stages (free skipped blocks, capacity check,
attach cache hits, allocate new blocks, cache newly full blocks): every input is checked
before anything changes, so a refused call (a bad argument) leaves the manager, its
coordinator and the pool exactly as they were. Having checked, it runs the coordinator's
``..._unchecked`` operations, which check nothing again (docs/architecture.md, "Checked
once"). A ``None`` (not enough free blocks) is not a bad call: as in vLLM 0.13 and 0.33, the
request's blocks that have left the attention window are freed all the same (they are dead
whether or not the allocation goes ahead), and nothing else changes (spec:
``Profile.refusal_frees_skipped_blocks``, docs/findings.md D7).

What is checked before anything changes, beyond types and ranges (``InvalidAllocationError``,
an ``InvalidManagerArgument``, naming the value):

* ``request.num_computed_tokens`` no more than the tokens the request's blocks hold in every
  group: no token is computed without a slot. It may exceed ``num_tokens`` (async scheduling
  counts the placeholder tokens of steps in flight), never the slots; beyond them, stage 1
  would free blocks the request still attends to.
* cache hits (``new_computed_blocks``) are what ``get_computed_blocks`` gave for this request:
  per group ``num_new_computed_tokens`` tokens of blocks, each real one the block the pool has
  cached under the request's hash at its position (``KVCacheCoordinator.check_hits``);
* what stage 5 reads to key blocks: enough block hashes, of bytes, and with KV events on,
  token ids and a LoRA a ``BlockStored`` event can carry (``KVCacheCoordinator.check_keys``);
* ``request.num_tokens`` at most ``max_model_len`` (vLLM finishes a request there), so the
  tokens stage 5 keys never outrun the slots stage 4 gives.

``free`` of a request the manager holds no blocks for is a no-op, as in vLLM, whose scheduler
frees every finished request, including ones that never got blocks; build the manager with
``strict_free=True`` to have it raise ``UnknownRequestError`` instead.

``max_pending_kv_events=N`` (kvspec's, keyword only, off by default as in vLLM) bounds the KV
events the block pool keeps for ``take_events``: past N they collapse into a snapshot that
replays to the same cached set (impl/block_pool.py, docs/bounded-events.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any, NoReturn, Protocol, SupportsIndex

from mypy_extensions import mypyc_attr

from kvspec.impl import host_types
from kvspec.impl.checks import (
    MAX_NUM_TOKENS,
    Flag,
    Text,
    as_int,
    block_hashes_of,
    check_count,
    check_flag,
    request_id_of,
)
from kvspec.impl.errors import (
    InvalidAllocationError as InvalidAllocationError,
    InvalidKVCacheConfig as InvalidKVCacheConfig,
    InvalidManagerArgument as InvalidManagerArgument,
    KVCacheManagerError as KVCacheManagerError,
    PrefixCachingNotSupported as PrefixCachingNotSupported,
    UnknownRequestError as UnknownRequestError,
    UnsupportedKVCacheSpec as UnsupportedKVCacheSpec,
)
from kvspec.impl.eviction import EvictionPolicy
from kvspec.impl.hashing import BlockHash
from kvspec.impl.kv_cache_coordinator import (
    KVCacheCoordinator,
    KVCacheSettings,
    check_settings,
    coordinator_for,
)
from kvspec.impl.kv_cache_interface import KVCacheConfigLike, as_kv_cache_config
from kvspec.impl.kv_cache_metrics import KVCacheMetricsCollector
from kvspec.impl.kv_cache_utils import KVCacheBlock
from kvspec.impl.kv_events import KVCacheEvent
from kvspec.impl.request import Request as Request, RequestLike
from kvspec.impl.stats import PrefixCacheStats as PrefixCacheStats

__all__ = [
    "InvalidAllocationError",
    "InvalidKVCacheConfig",
    "InvalidManagerArgument",
    "KVCacheBlocks",
    "KVCacheManager",
    "KVCacheManagerError",
    "PrefixCacheStats",
    "PrefixCachingNotSupported",
    "Request",
    "UnknownRequestError",
    "UnsupportedKVCacheSpec",
]


class BlocksLike(Protocol):
    """What ``allocate_slots`` and ``KVCacheBlocks.__add__`` take as blocks: a
    ``KVCacheBlocks`` (checked in the method's check block; mypyc, which would refuse anything
    else with a bare ``TypeError`` at the call, does not check a Protocol)."""

    @property
    def blocks(self) -> tuple[Sequence[KVCacheBlock], ...]: ...


def _check_groups(blocks: object, what: str) -> tuple[Sequence[KVCacheBlock], ...]:
    """``blocks`` if it is a tuple of per-group lists (or tuples)."""
    if type(blocks) is not tuple:
        raise InvalidManagerArgument(
            f"{what} must be a tuple of one block list per KV-cache group, got {blocks!r}")
    for group in blocks:
        if type(group) is not list and type(group) is not tuple:
            raise InvalidManagerArgument(
                f"each group of {what} must be a list of KVCacheBlock, got {group!r}")
    return blocks


def _block_ids(group: Sequence[object]) -> list[int]:
    """The ids of a group's blocks (read untyped: a stranger gets a typed refusal, also where
    the compiled build would check each element's type)."""
    if not set(map(type, group)) <= {KVCacheBlock}:
        stranger = next(b for b in group if type(b) is not KVCacheBlock)
        raise InvalidManagerArgument(f"KVCacheBlocks holds {stranger!r}, not a block")
    blocks: Sequence[Any] = group
    return [block.block_id for block in blocks]


@dataclass(init=False)
class KVCacheBlocks:
    """The blocks of one request, per KV-cache group: ``blocks[group][i]``."""

    blocks: tuple[Sequence[KVCacheBlock], ...]

    def __init__(self, blocks: Sequence[Sequence[KVCacheBlock]]) -> None:
        """``blocks``: a tuple of one list (or tuple) of blocks per KV-cache group."""
        self.blocks = _check_groups(blocks, "KVCacheBlocks")

    def __add__(self, other: BlocksLike) -> KVCacheBlocks:
        if not isinstance(other, KVCacheBlocks):
            raise InvalidManagerArgument(f"cannot add {other!r} to KVCacheBlocks")
        if len(other.blocks) != len(self.blocks):
            raise InvalidManagerArgument(
                f"cannot add KVCacheBlocks of {len(other.blocks)} groups to KVCacheBlocks of "
                f"{len(self.blocks)} groups")
        return KVCacheBlocks(
            tuple(list(chain(a, b)) for a, b in zip(self.blocks, other.blocks, strict=True))
        )

    def get_block_ids(self, allow_none: Flag = False) -> tuple[list[int], ...] | None:
        """Per group, the block ids; with ``allow_none``, None when every group is empty."""
        none_if_empty = check_flag("allow_none", allow_none)
        if none_if_empty and all(len(group) == 0 for group in self.blocks):
            return None
        return tuple(_block_ids(group) for group in self.blocks)

    def get_unhashed_block_ids(self) -> list[int]:
        """Ids of the blocks without a prefix-cache key (one group only)."""
        if len(self.blocks) != 1:
            raise InvalidAllocationError(
                f"get_unhashed_block_ids needs exactly one KV-cache group, got {len(self.blocks)}"
            )
        group: Sequence[Any] = self.blocks[0]
        ids = _block_ids(group)
        return [block_id for block_id, block in zip(ids, group, strict=True)
                if block.block_hash is None]

    def new_empty(self) -> KVCacheBlocks:
        return KVCacheBlocks(tuple(() for _ in self.blocks))


def _allocation_counts(
    max_model_len: int, num_new_tokens: object, num_new_computed_tokens: object,
    num_lookahead_tokens: object, num_encoder_tokens: object, delay_cache_blocks: object,
) -> tuple[int, int, int, int, bool]:
    """The allocate_slots arguments that failed the one-line test for plain ints, as plain
    ints (impl's integer rule: numpy integers too), or their refusal."""
    new = as_int(num_new_tokens)
    if new is None or not 0 < new <= max_model_len:
        raise InvalidAllocationError(
            f"num_new_tokens must be greater than 0 and at most max_model_len="
            f"{max_model_len}, got {num_new_tokens!r}")
    hits = check_count("num_new_computed_tokens", num_new_computed_tokens, max_model_len,
                       error=InvalidAllocationError)
    lookahead = check_count("num_lookahead_tokens", num_lookahead_tokens, max_model_len,
                            error=InvalidAllocationError)
    encoder = check_count("num_encoder_tokens", num_encoder_tokens, MAX_NUM_TOKENS,
                          error=InvalidAllocationError)
    delay = check_flag("delay_cache_blocks", delay_cache_blocks, InvalidAllocationError)
    return new, hits, lookahead, encoder, delay


def _refuse_request(request: object, max_model_len: int, error: type[InvalidManagerArgument],
                    also: str) -> NoReturn:
    """The refusal of a request whose fields failed the one-line test: an id that is not a
    str, ``num_tokens`` not in [0, max_model_len] (vLLM finishes a request there; its own
    tests allocate for an empty prompt), or the
    field ``also`` (``num_computed_tokens``, an int >= 0, or ``skip_reading_prefix_cache``,
    a bool)."""
    request_id = getattr(request, "request_id", None)
    if type(request_id) is not str:
        raise error(
            f"{request!r} is not a request: its request_id must be a str, got {request_id!r}")
    num_tokens = getattr(request, "num_tokens", None)
    if type(num_tokens) is not int or not 0 <= num_tokens <= max_model_len:
        raise error(f"num_tokens of {request!r} must be an int in [0, max_model_len="
                    f"{max_model_len}], got {num_tokens!r}")
    value = getattr(request, also, None)
    if also == "num_computed_tokens" and (type(value) is not int or value < 0):
        raise error(f"request {request_id!r}: num_computed_tokens must be an int >= 0, "
                    f"got {value!r}")
    if also == "skip_reading_prefix_cache" and type(value) is not bool:
        raise error(f"request {request_id!r}: skip_reading_prefix_cache must be a bool, "
                    f"got {value!r}")
    raise AssertionError("unreachable: a field failed the test above")


@mypyc_attr(allow_interpreted_subclasses=True)
class KVCacheManager:
    """Allocates, looks up and frees the KV-cache blocks of requests."""

    def __init__(
        self,
        kv_cache_config: KVCacheConfigLike,
        max_model_len: SupportsIndex,
        hash_block_size: SupportsIndex,
        enable_caching: Flag = True,
        use_eagle: Flag = False,
        log_stats: Flag = False,
        enable_kv_cache_events: Flag = False,
        dcp_world_size: SupportsIndex = 1,
        pcp_world_size: SupportsIndex = 1,
        metrics_collector: KVCacheMetricsCollector | None = None,
        *,
        strict_free: Flag = False,
        max_pending_kv_events: SupportsIndex | None = None,
        eviction_policy: EvictionPolicy | None = None,
    ) -> None:
        # Checks: the manager's own flags, then the stack's settings, once (the coordinator
        # checks the config against them when it is built).
        stats_on = check_flag("log_stats", log_stats, InvalidKVCacheConfig)
        strict = check_flag("strict_free", strict_free, InvalidKVCacheConfig)
        settings = check_settings(max_model_len, use_eagle, enable_caching,
                                  enable_kv_cache_events, dcp_world_size, pcp_world_size,
                                  hash_block_size, metrics_collector, max_pending_kv_events,
                                  eviction_policy)
        self.log_stats: bool = stats_on
        self.strict_free: bool = strict
        self.settings: KVCacheSettings = settings
        self.coordinator: KVCacheCoordinator = coordinator_for(kv_cache_config, settings)
        self.max_model_len: int = settings.max_model_len
        self.enable_caching: bool = settings.enable_caching
        self.use_eagle: bool = settings.use_eagle
        self.hash_block_size: int = settings.hash_block_size
        self.kv_cache_config = kv_cache_config
        self.num_kv_cache_groups = len(as_kv_cache_config(kv_cache_config).kv_cache_groups)
        self.block_pool = self.coordinator.block_pool
        self.prefix_cache_stats: PrefixCacheStats | None = (
            host_types.PrefixCacheStats() if stats_on else None
        )
        # Compared by identity: "no cache hits" (the GC-friendly shared empty result).
        self.empty_kv_cache_blocks = KVCacheBlocks(
            tuple(() for _ in range(self.num_kv_cache_groups))
        )
        self._unitary = self.num_kv_cache_groups == 1
        # The calls that may have evicted cached blocks so far (allocations, evict_blocks,
        # resets), and the last lookup that found hits: (its result, the result's groups, a
        # copy of them, the request id, its hash list, the hit length, the count of such
        # calls then). Hits that are that very result, unchanged, with no eviction since,
        # need not be looked up again (``_checked_hits``).
        self._evicting_calls = 0
        self._last_lookup: tuple[
            KVCacheBlocks, tuple[Sequence[KVCacheBlock], ...],
            tuple[list[KVCacheBlock], ...], str, list[BlockHash], int, int,
        ] | None = None

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
        last token is always recomputed to get its logits), and its length in tokens.

        The lookup refuses a block hash that is not bytes when it reaches it; one after the
        first miss is not read (as a loop of ``BlockPool.get_cached_block`` would not)."""
        max_model_len = self.max_model_len
        fields: Any = request  # read duck-typed: vLLM's Request, impl's, or a stranger
        try:
            request_id = fields.request_id
            num_tokens = fields.num_tokens
            skip = fields.skip_reading_prefix_cache
        except AttributeError:
            _refuse_request(request, max_model_len, InvalidManagerArgument,
                            "skip_reading_prefix_cache")
        if (type(request_id) is not str or type(num_tokens) is not int
                or not 0 <= num_tokens <= max_model_len or type(skip) is not bool):
            _refuse_request(request, max_model_len, InvalidManagerArgument,
                            "skip_reading_prefix_cache")
        if not self.enable_caching or skip or not num_tokens:
            return self.empty_kv_cache_blocks, 0
        block_hashes: Any = getattr(fields, "block_hashes", None)
        if type(block_hashes) is not list:
            block_hashes_of(request)  # refuses it, naming it
        if len(block_hashes) < num_tokens // self.hash_block_size:
            raise InvalidManagerArgument(
                f"request {request_id!r} has {len(block_hashes)} block hashes for "
                f"{num_tokens} tokens (was it built with a block_hasher?)")
        stats = self.prefix_cache_stats
        preempted = False
        if stats is not None:
            num_preemptions = getattr(request, "num_preemptions", None)
            if type(num_preemptions) is not int or num_preemptions < 0:
                raise InvalidManagerArgument(
                    f"request {request_id!r}: num_preemptions must be an int >= 0, "
                    f"got {num_preemptions!r}")
            preempted = num_preemptions > 0
        computed_blocks, num_new_computed_tokens = (
            self.coordinator.find_longest_cache_hit_unchecked(block_hashes, num_tokens - 1))
        if stats is not None:
            stats.record(num_tokens=num_tokens, num_hits=num_new_computed_tokens,
                         preempted=preempted)
        result = self._blocks_result(computed_blocks)
        if num_new_computed_tokens:
            self._last_lookup = (result, result.blocks, tuple(map(list, result.blocks)),
                                 request_id, block_hashes, num_new_computed_tokens,
                                 self._evicting_calls)
        return result, num_new_computed_tokens

    # -- allocation ----------------------------------------------------------------------

    def allocate_slots(
        self,
        request: RequestLike,
        num_new_tokens: SupportsIndex,
        num_new_computed_tokens: SupportsIndex = 0,
        new_computed_blocks: BlocksLike | None = None,
        num_lookahead_tokens: SupportsIndex = 0,
        delay_cache_blocks: Flag = False,
        num_encoder_tokens: SupportsIndex = 0,
    ) -> KVCacheBlocks | None:
        """Give the request slots for ``num_new_tokens`` more tokens (plus lookahead slots),
        after attaching the cache hits ``new_computed_blocks``; return the new blocks, or None
        when the pool has too few free blocks (having freed only the request's blocks that
        left the attention window, as vLLM does).

        Layout of the request's tokens::

            | computed | new computed | new | lookahead |
                       |<------- needs slots -------->|   (at most max_model_len in all)
            |<----- cached when full ----->|
        """
        # -- checks: every argument, the request and its hits; nothing changes before the
        # capacity count below. One test per argument on the path every call takes (plain
        # ints in range); _allocation_counts converts numpy integers, or refuses, naming.
        max_model_len = self.max_model_len
        if (type(num_new_tokens) is int and 0 < num_new_tokens <= max_model_len
                and type(num_new_computed_tokens) is int
                and 0 <= num_new_computed_tokens <= max_model_len
                and type(num_lookahead_tokens) is int
                and 0 <= num_lookahead_tokens <= max_model_len
                and type(num_encoder_tokens) is int
                and 0 <= num_encoder_tokens <= MAX_NUM_TOKENS
                and type(delay_cache_blocks) is bool):
            num_new = num_new_tokens
            num_hit_tokens = num_new_computed_tokens
            num_lookahead = num_lookahead_tokens
            num_encoder = num_encoder_tokens
            delay = delay_cache_blocks
        else:
            num_new, num_hit_tokens, num_lookahead, num_encoder, delay = _allocation_counts(
                max_model_len, num_new_tokens, num_new_computed_tokens, num_lookahead_tokens,
                num_encoder_tokens, delay_cache_blocks)
        coordinator = self.coordinator
        if num_encoder and not coordinator.has_cross_attention:
            raise InvalidAllocationError(
                f"num_encoder_tokens={num_encoder} for a model without cross-attention")
        fields: Any = request  # read duck-typed: vLLM's Request, impl's, or a stranger
        try:
            request_id = fields.request_id
            num_tokens = fields.num_tokens
            num_computed = fields.num_computed_tokens
        except AttributeError:
            _refuse_request(request, max_model_len, InvalidAllocationError,
                            "num_computed_tokens")
        if (type(request_id) is not str or type(num_tokens) is not int
                or not 0 <= num_tokens <= max_model_len
                or type(num_computed) is not int or num_computed < 0):
            _refuse_request(request, max_model_len, InvalidAllocationError,
                            "num_computed_tokens")
        if num_computed:  # 0 computed tokens need no slot
            coordinator.check_computed_tokens(request_id, "num_computed_tokens", num_computed,
                                              InvalidAllocationError)
        empty = self.empty_kv_cache_blocks.blocks
        if new_computed_blocks is None or new_computed_blocks is self.empty_kv_cache_blocks:
            new_computed = empty
        else:
            new_computed = self._checked_hits(request, request_id, num_tokens,
                                            new_computed_blocks, num_hit_tokens)
        if num_hit_tokens and (new_computed is empty or not any(new_computed)):
            raise InvalidAllocationError(
                f"num_new_computed_tokens={num_hit_tokens} counts cache hits, but request "
                f"{request_id!r} brings none")
        num_computed_tokens = num_computed + num_hit_tokens
        num_tokens_need_slot = min(
            num_computed_tokens + num_new + num_lookahead, max_model_len
        )
        num_tokens_to_cache = min(num_computed_tokens + num_new, num_tokens)
        caching_now = self.enable_caching and not delay
        if caching_now:
            coordinator.check_keys(request, request_id, num_tokens_to_cache, num_hit_tokens,
                                   InvalidAllocationError)

        # -- the call. Stage 2 first: count, counting in the blocks stage 1 will free. The
        # bound that takes every hit for a free block settles most calls without reading a
        # ref count.
        num_free = self.block_pool.get_num_free_blocks()
        if coordinator.get_max_num_blocks_to_allocate_unchecked(
            request_id, num_tokens_need_slot, new_computed, num_encoder
        ) > num_free:
            num_blocks_to_allocate = coordinator.get_num_blocks_to_allocate_unchecked(
                request_id, num_tokens_need_slot, new_computed, num_encoder
            )
            if num_blocks_to_allocate > num_free and num_blocks_to_allocate > num_free + (
                coordinator.num_blocks_freed_by_skip_unchecked(request_id, num_computed)
            ):
                # Too few free blocks (not a bad call): stage 1 still runs, as in vLLM 0.13
                # and 0.33, since the blocks out of the window are dead either way
                # (spec: Profile.refusal_frees_skipped_blocks). Freeing evicts nothing.
                coordinator.remove_skipped_blocks_unchecked(request_id, num_computed)
                return None

        # Stage 1: blocks that slid out of the window go back to the pool.
        self._evicting_calls += 1
        coordinator.remove_skipped_blocks_unchecked(request_id, num_computed)
        # Stage 3: attach the cache hits.
        if new_computed is not empty:
            if self.enable_caching:
                self.block_pool.touch(new_computed)
            coordinator.save_new_computed_blocks_unchecked(request_id, new_computed)
        # Stage 4: new blocks.
        new_blocks = coordinator.allocate_new_blocks_unchecked(
            request_id, num_tokens_need_slot, num_encoder
        )
        # Stage 5: key the blocks that are full now (never lookahead/draft tokens).
        if caching_now:
            coordinator.cache_blocks_unchecked(request, num_tokens_to_cache)
        return self._blocks_result(new_blocks)

    def _checked_hits(
        self, request: object, request_id: str, num_tokens: int, new_computed_blocks: object,
        num_hit_tokens: int,
    ) -> tuple[Sequence[KVCacheBlock], ...]:
        """``new_computed_blocks.blocks`` if they are this request's cache hits (see the
        module docstring); per-group lists, all empty, are no hits.

        Hits that are the very result of the last ``get_computed_blocks``, for this request,
        unchanged, with no call since that may have evicted a cached block (the scheduler's
        lookup-then-allocate), were this request's cache hits then and still are: they are
        not looked up again. A caller that evicts through the pool itself in between is not
        seen; the manager's own calls are."""
        groups = getattr(new_computed_blocks, "blocks", None)
        last = self._last_lookup
        if (last is not None and last[0] is new_computed_blocks and last[1] is groups
                and last[3] == request_id and last[5] == num_hit_tokens < num_tokens
                and last[6] == self._evicting_calls
                and getattr(request, "block_hashes", None) is last[4] and last[2] == groups
                and not self.coordinator.has_blocks(request_id)):
            return groups
        if type(groups) is not tuple:
            raise InvalidAllocationError(
                f"new_computed_blocks must be KVCacheBlocks, got {new_computed_blocks!r}")
        if len(groups) != self.num_kv_cache_groups:
            raise InvalidAllocationError(
                f"new_computed_blocks has {len(groups)} groups, the manager "
                f"{self.num_kv_cache_groups}"
            )
        for group in groups:
            if type(group) is not list and type(group) is not tuple:
                raise InvalidAllocationError(
                    f"each group of new_computed_blocks must be a list of blocks, "
                    f"got {group!r}")
        if not any(groups):
            return groups
        if not self.enable_caching:
            raise InvalidAllocationError(
                f"request {request_id!r} brings cache hits but prefix caching is off"
            )
        if self.coordinator.has_blocks(request_id):
            raise InvalidAllocationError(
                f"request {request_id!r} already holds blocks and cannot take cache hits"
            )
        if num_hit_tokens >= num_tokens:
            raise InvalidAllocationError(
                f"num_new_computed_tokens={num_hit_tokens}: cache hits must leave at least the "
                f"last of the {num_tokens} tokens of request {request_id!r} to compute")
        self.coordinator.check_hits(block_hashes_of(request, InvalidAllocationError), groups,
                                    num_hit_tokens, InvalidAllocationError)
        return groups

    def free(self, request: RequestLike) -> None:
        """Release the request's blocks, each group's last block first."""
        request_id: Any = getattr(request, "request_id", None)
        if type(request_id) is not str:
            request_id_of(request)  # refuses it, naming it
        if self.strict_free and not self.coordinator.has_blocks(request_id):
            raise UnknownRequestError(f"the manager holds no blocks for request {request_id!r}")
        self.coordinator.free(request_id)

    def cache_blocks(self, request: RequestLike, num_computed_tokens: SupportsIndex) -> None:
        """Key the request's blocks that ``num_computed_tokens`` tokens fill (checked as the
        coordinator's ``cache_blocks`` checks, also with prefix caching off)."""
        count = self.coordinator.check_cacheable(request, num_computed_tokens,
                                                 self.max_model_len)
        if self.enable_caching:
            self.coordinator.cache_blocks_unchecked(request, count)

    # -- prefix cache --------------------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while any request holds blocks."""
        self._evicting_calls += 1
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        self._evicting_calls += 1
        self.block_pool.evict_blocks(block_ids)

    # -- eviction policy (impl/eviction.py): the pool's, by block id ---------------------

    def advance_clock(self, now: SupportsIndex) -> None:
        """The policies' time moves to ``now``: expired retention priorities revert."""
        self.block_pool.advance_clock(now)

    def set_retention(self, block_ids: Iterable[int], priority: SupportsIndex,
                      duration: SupportsIndex | None = None) -> None:
        """Retention priority of cached blocks (``priority`` policy)."""
        self.block_pool.set_retention(block_ids, priority, duration)

    def pin_blocks(self, block_ids: Iterable[int]) -> None:
        """Pin cached blocks (``pinned`` policy): never evicted while pinned."""
        self.block_pool.pin_blocks(block_ids)

    def unpin_blocks(self, block_ids: Iterable[int]) -> None:
        self.block_pool.unpin_blocks(block_ids)

    def get_num_common_prefix_blocks(self, running_request_id: Text) -> list[int]:
        """Per group, the leading blocks every running request shares (0s for an id that
        holds no blocks)."""
        return self.coordinator.get_num_common_prefix_blocks(running_request_id)

    def take_events(self) -> list[KVCacheEvent]:
        return self.block_pool.take_events()

    # -- views ---------------------------------------------------------------------------

    def get_blocks(self, request_id: Text) -> KVCacheBlocks:
        return self._blocks_result(self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: Text) -> tuple[list[int], ...]:
        return tuple(
            [block.block_id for block in group] for group in self.coordinator.get_blocks(request_id)
        )

    def create_kv_cache_blocks(
        self, blocks: Sequence[Sequence[KVCacheBlock]]
    ) -> KVCacheBlocks:
        """``KVCacheBlocks(blocks)``, or the shared empty one when every group is empty."""
        groups = _check_groups(blocks, "blocks")
        if len(groups) != self.num_kv_cache_groups:
            raise InvalidManagerArgument(
                f"blocks has {len(groups)} groups, the manager {self.num_kv_cache_groups}")
        return self._blocks_result(groups)

    def _blocks_result(self, blocks: tuple[Sequence[KVCacheBlock], ...]) -> KVCacheBlocks:
        if self._unitary:
            return KVCacheBlocks(blocks) if blocks[0] else self.empty_kv_cache_blocks
        return KVCacheBlocks(blocks) if any(blocks) else self.empty_kv_cache_blocks
