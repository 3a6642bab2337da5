"""The KV-cache manager, as an executable model (vLLM 0.13's vllm/v1/core/kv_cache_manager.py).

One immutable value, `ManagerState`, holds the pool model (`spec.pool`) and, per KV-cache
group, each request's block list and how many of its blocks are keyed. Every operation is a
pure function returning the new state and its outputs. The attention types' arithmetic lives
in `spec.attention_rules`; the invariants are named predicates at the end of this module.

What the model says, as vLLM 0.13's kv_cache_manager.py does it:

* A request's prefix-cache lookup (`get_computed_blocks`) is capped at ``num_tokens - 1``
  tokens (the last token is always recomputed for its logits). Groups with equal specs are
  looked up together: a block is a hit only when it hits in all of them. Each attention type
  has its own search rule, and with several types the lookup repeats over the types, each
  limited by the hit length found so far, until a whole pass shortens nothing.
* `allocate_slots` runs in five stages: free the blocks that slid out of the window, check
  capacity, attach the cache hits, allocate new blocks, key the blocks that are full now
  (never the lookahead or draft tokens). When the pool is short it returns None, and stage 1
  has still happened (`Profile.refusal_frees_skipped_blocks`, as vLLM 0.13 and 0.33 do it:
  blocks outside the window are dead whether or not the allocation goes ahead); nothing else
  changes (`refusal_frees_only_skipped_blocks`). A short pool is not a bad call.
* `free` releases each group's blocks in reverse order, so the tail of a chain is evicted
  before its head.
* Refusals (`BadAllocation`, nothing changes): besides counts out of range, a request whose
  ``num_computed_tokens`` is more than the tokens its blocks hold in some group (no token is
  computed without a slot; async scheduling counts tokens of steps in flight, so the count
  may pass ``num_tokens``, never the slots: beyond them stage 1 would free blocks the request
  still attends to), cache hits that are not the request's (each real block must be the one
  cached under the request's hash at its position, ``num_new_computed_tokens`` their length
  in every group, null blocks only before the real ones of types whose blocks slide out of
  the window), and a request longer than ``max_model_len``.

Under vLLM 0.33 (`Profile.mamba_align_mode`) a prefix-cached Mamba group runs in align mode:
its list has one entry per block of the main model's tokens (lookahead ignored), null but for
the running state and the state it was copied from; it gains at most one real block per
allocate_slots, frees the old state once computed past, and a hit on a key a Mamba group cached
since the last `NewStep` is refused as if the pool were short. A group's surplus never pays for
another group's blocks: 0.33 sums an align-mode Mamba group's negative count (a list longer than
rolled-back tokens need) into the total, passes the capacity check and then runs out of blocks
mid-allocation (a ValueError; tests/test_spec_mamba_align.py); the model refuses.

Deliberate differences from vLLM 0.13 (impl/ follows the model): a sink-attention group
holds its sink blocks as ordinary references taken at construction; configs 0.13 would reject
with an assertion or a late NotImplementedError (cross-attention with prefix caching) are
refused when built.
"""

from __future__ import annotations

import hashlib
import math
import pickle
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from enum import Enum

from kvspec.spec import attention_rules as rules, hashing as H, pool as P
from kvspec.spec.eviction import Policy, TokenRangeRetention
from kvspec.spec.pool import NULL_BLOCK, BlockId, PoolState

__all__ = [
    "AddRequest",
    "AllocateSlots",
    "AppendTokens",
    "BadAllocation",
    "BadConfig",
    "CacheBlocks",
    "DrainDeferredFrees",
    "EvictBlocks",
    "Free",
    "GetBlockIds",
    "GetComputedBlocks",
    "GetNumCommonPrefixBlocks",
    "GroupSpec",
    "Hashing",
    "Kind",
    "MambaAlign",
    "ManagerConfig",
    "ManagerError",
    "ManagerState",
    "NewManager",
    "NewStep",
    "PopBlocksForFree",
    "Request",
    "RequestView",
    "ResetPrefixCache",
    "Session",
    "SetComputedTokens",
    "TakeEvents",
    "UnknownRequest",
    "Usage",
    "align_blocks_to_allocate",
    "allocate_slots",
    "cache_blocks",
    "coarse_hashes",
    "drain_deferred_frees",
    "find_longest_cache_hit",
    "free",
    "get_blocks",
    "get_computed_blocks",
    "get_num_common_prefix_blocks",
    "group_hashes",
    "is_align_mamba",
    "mamba_holds_at_most_two_states",
    "new_manager",
    "new_step",
    "no_same_step_mamba_hit",
    "pop_blocks_for_free",
    "refusal_frees_only_skipped_blocks",
    "reset_prefix_cache",
    "same_step_mamba_hit",
    "shared_prefix_boundary",
    "step",
    "take_events",
    "usage",
    "violated",
]


# --- Errors ------------------------------------------------------------------------------------


class ManagerError(Exception):
    """A call the manager must refuse; nothing changes."""


class BadConfig(ManagerError, ValueError):
    """A configuration no manager can serve."""


class BadAllocation(ManagerError, ValueError):
    """allocate_slots arguments no allocation can have."""


class UnknownRequest(ManagerError, LookupError):
    """A request id the manager holds no blocks for (strict free only)."""


# --- Configuration -----------------------------------------------------------------------------


class Kind(Enum):
    """The attention type of a KV-cache group, i.e. which manager serves it."""

    FULL = "full"  # full attention and MLA
    SINK_FULL = "sink_full"
    SLIDING_WINDOW = "sliding_window"
    CHUNKED_LOCAL = "chunked_local"
    MAMBA = "mamba"
    CROSS = "cross"


FULL_KINDS = (Kind.FULL, Kind.SINK_FULL)


@dataclass(frozen=True)
class GroupSpec:
    """One KV-cache group's spec. Groups with equal GroupSpecs (``identity`` included: two
    groups of one kind whose layers differ, e.g. in head count, have different identities)
    share prefix-cache lookups."""

    kind: Kind
    block_size: int
    sliding_window: int = 0
    attention_chunk_size: int = 0
    num_speculative_blocks: int = 0
    sink_len: int = 0
    identity: str = ""


@dataclass(frozen=True)
class ManagerConfig:
    groups: tuple[GroupSpec, ...]
    num_blocks: int
    max_model_len: int
    hash_block_size: int
    enable_caching: bool = True
    use_eagle: bool = False
    enable_events: bool = False
    profile: P.Profile = P.Profile.V0_13
    policy: Policy | None = None  # the pool's eviction policy (spec.eviction); the profile's
    # vLLM 0.33: the scheduler's block (its chunk alignment; 0 = the lcm of the block sizes,
    # what 0.13 aligns hits to and what 0.33's scheduler passes for these layouts).
    scheduler_block_size: int = 0

    @property
    def alignment(self) -> int:
        """Tokens a hybrid hit (and, under 0.33, a hybrid ``cache_blocks``) is aligned to."""
        return self.scheduler_block_size or math.lcm(*(g.block_size for g in self.groups))


@dataclass(frozen=True)
class RequestView:
    """What the manager reads of a request. ``block_hashes`` are the chain hashes of its full
    blocks of ``hash_block_size`` tokens (extra keys: LoRA, multimodal, cache_salt included)."""

    request_id: str
    num_tokens: int
    num_computed_tokens: int
    block_hashes: tuple[bytes, ...]
    token_ids: tuple[int, ...] = ()
    lora_id: int | None = None
    skip_reading_prefix_cache: bool = False
    retention: tuple[TokenRangeRetention, ...] = ()  # hints a ``priority`` pool reads
    num_prompt_tokens: int = 0  # vLLM 0.33 keys the prompt's last hash boundary


# --- State -------------------------------------------------------------------------------------

Table = tuple[tuple[str, tuple[BlockId, ...]], ...]  # request id -> blocks, sorted by id
Counts = tuple[tuple[str, int], ...]  # request id -> keyed blocks, sorted by id
GroupBlocks = tuple[tuple[BlockId, ...], ...]  # per group


@dataclass(frozen=True)
class MambaAlign:
    """One request's state in an align-mode Mamba group (vLLM 0.33's MambaManager dicts,
    single_type_kv_cache_manager.py:1453-1460): the index of the state block allocated two
    steps back (``last_state_block_idx``), how many leading blocks the skip walk has passed
    (``_num_retired_blocks``) and whether it has been through ``allocate_new_blocks``
    (``_allocated_block_reqs``). The default is "no entry" in every dict."""

    last_state_idx: int | None = None
    retired: int = 0
    allocated: bool = False


MambaTable = tuple[tuple[str, MambaAlign], ...]  # request id -> its MambaAlign, sorted by id


@dataclass(frozen=True)
class ManagerState:
    config: ManagerConfig
    pool: PoolState
    tables: tuple[Table, ...]  # per group: every request holding a block list in it
    num_cached: tuple[Counts, ...]  # per group
    sink_blocks: GroupBlocks  # per group (empty but for sink attention)
    # vLLM 0.33's Mamba align mode (`Profile.mamba_align_mode`), empty otherwise: per group
    # (empty for groups not in align mode), each request's `MambaAlign` that differs from the
    # default, sorted by id; and the keys Mamba groups cached since the last NewStep, sorted.
    mamba: tuple[MambaTable, ...] = ()
    cached_this_step: tuple[P.Key, ...] = ()
    # vLLM 0.33's deferred frees: each batch of blocks `pop_blocks_for_free` handed to the
    # scheduler, in pop order, that it has not returned to the pool yet (they keep their
    # references until `drain_deferred_frees`).
    deferred: tuple[tuple[BlockId, ...], ...] = ()


def _lookup(pairs: Sequence[tuple[str, object]], key: str) -> object | None:
    for k, v in pairs:
        if k == key:
            return v
    return None


def _table_get(table: Table, request_id: str) -> tuple[BlockId, ...] | None:
    found = _lookup(table, request_id)
    return found  # type: ignore[return-value]


def _count_get(counts: Counts, request_id: str) -> int:
    found = _lookup(counts, request_id)
    return 0 if found is None else found  # type: ignore[return-value]


def _put(pairs: tuple[tuple[str, object], ...], key: str, value: object) -> tuple[
    tuple[str, object], ...
]:
    rest = {k: v for k, v in pairs if k != key}
    rest[key] = value
    return tuple(sorted(rest.items()))


def _drop(pairs: tuple[tuple[str, object], ...], key: str) -> tuple[tuple[str, object], ...]:
    return tuple((k, v) for k, v in pairs if k != key)


def is_align_mamba(config: ManagerConfig, group: GroupSpec) -> bool:
    """The group is a Mamba group in vLLM 0.33's align mode: 0.33 with prefix caching on
    (single_type_kv_cache_manager.py:1442-1444 requires align mode for caching; with caching
    off the mode stays "none" and 0.13's rules hold)."""
    return (group.kind is Kind.MAMBA and config.enable_caching
            and config.profile.mamba_align_mode)


def _mamba_get(state: ManagerState, group_id: int, request_id: str) -> MambaAlign:
    if group_id >= len(state.mamba):
        return MambaAlign()
    found = _lookup(state.mamba[group_id], request_id)
    return MambaAlign() if found is None else found  # type: ignore[return-value]


def _mamba_put(mamba: Sequence[MambaTable], num_groups: int, group_id: int,
               request_id: str, value: MambaAlign) -> tuple[MambaTable, ...]:
    """``mamba`` with the request's entry in the group set (dropped when it is the default)."""
    tables = list(mamba) or [() for _ in range(num_groups)]
    if value == MambaAlign():
        tables[group_id] = _drop(tables[group_id], request_id)  # type: ignore[assignment]
    else:
        tables[group_id] = _put(tables[group_id], request_id, value)  # type: ignore[assignment]
    return tuple(tables)


def new_manager(config: ManagerConfig) -> ManagerState:
    """A manager over a fresh pool; sink-attention groups take their sink blocks, in group
    order. Refuses configs no coordinator serves (see the module docstring)."""
    _check_config(config)
    pool = P.new_pool(config.num_blocks, config.enable_caching, config.enable_events,
                      config.profile, policy=config.policy)
    sinks: list[tuple[BlockId, ...]] = []
    for group in config.groups:
        taken: tuple[BlockId, ...] = ()
        if group.kind is Kind.SINK_FULL:
            if group.sink_len // group.block_size > P.num_free(pool):
                raise BadConfig(f"{group.sink_len // group.block_size} sink blocks do not fit")
            pool, taken = P.get_new_blocks(pool, group.sink_len // group.block_size)
        sinks.append(taken)
    empty_groups = tuple(() for _ in config.groups)
    return ManagerState(config, pool, empty_groups, empty_groups, tuple(sinks))


def _check_config(config: ManagerConfig) -> None:
    groups = config.groups
    if config.num_blocks < 1 or config.max_model_len < 1 or config.hash_block_size < 1:
        raise BadConfig(f"sizes must be positive: {config!r}")
    for group in groups:
        if group.block_size < 1:
            raise BadConfig(f"block size must be positive: {group!r}")
        if group.kind is Kind.SLIDING_WINDOW and group.sliding_window < 1:
            raise BadConfig(f"sliding window must be positive: {group!r}")
        if group.kind is Kind.CHUNKED_LOCAL and group.attention_chunk_size < 1:
            raise BadConfig(f"chunk size must be positive: {group!r}")
        if group.kind is Kind.SINK_FULL and (
            group.sink_len < 1 or group.sink_len % group.block_size
        ):
            raise BadConfig(f"sink_len must be a positive multiple of the block size: {group!r}")
    if not config.enable_caching:
        return
    if any(g.kind is Kind.CROSS for g in groups):
        raise BadConfig("cross-attention is never prefix-cached: turn caching off")
    for group in groups:
        # vLLM 0.33 align mode, modelled where its fine-grained hits, speculative blocks and
        # EAGLE checkpoints are off (single_type_kv_cache_manager.py:1500-1520, 1446-1452).
        if is_align_mamba(config, group) and (
                group.num_speculative_blocks or config.use_eagle
                or group.block_size != config.hash_block_size):
            raise BadConfig(f"Mamba align mode is modelled only with its block size equal to "
                            f"the hash block size, no speculative blocks and no EAGLE: {group!r}")
    if len(groups) == 1:
        if groups[0].block_size != config.hash_block_size:
            raise BadConfig(
                f"block size {groups[0].block_size} != hash block size {config.hash_block_size}"
            )
    else:
        if len(groups) == 0:
            raise BadConfig("a prefix-cached manager needs at least one KV-cache group")
        if config.use_eagle:
            raise BadConfig("EAGLE with several KV-cache groups is not supported")
        for group in groups:
            if group.block_size % config.hash_block_size:
                raise BadConfig(
                    f"block size {group.block_size} is not a multiple of hash block size "
                    f"{config.hash_block_size}"
                )
        alignment = math.lcm(*(g.block_size for g in groups))
        for group in groups:
            if group.kind is Kind.CHUNKED_LOCAL and group.block_size != alignment:
                raise BadConfig(f"chunked local block size {group.block_size} != {alignment}")
    if config.use_eagle and groups[0].kind in (Kind.CHUNKED_LOCAL,):
        raise BadConfig("chunked local attention does not support EAGLE")


# --- Lookup ------------------------------------------------------------------------------------


def coarse_hashes(
    block_hashes: Sequence[bytes], hash_block_size: int, block_size: int
) -> tuple[bytes, ...]:
    """Hashes of blocks ``block_size // hash_block_size`` times larger: the concatenation of
    the fine hashes each covers (vLLM 0.13).

    pre: hash_block_size > 0 and block_size % hash_block_size == 0 and block_size > 0
    post: len(__return__) == len(block_hashes) // (block_size // hash_block_size)
    """
    scale = block_size // hash_block_size
    if scale == 1:
        return tuple(block_hashes)
    return tuple(
        b"".join(block_hashes[i * scale : (i + 1) * scale])
        for i in range(len(block_hashes) // scale)
    )


def group_hashes(config: ManagerConfig, block_hashes: Sequence[bytes], block_size: int
                 ) -> tuple[bytes, ...]:
    """A request's hashes at a group's block size, as the profile's release makes them:
    0.13 concatenates the fine hashes a block covers (`coarse_hashes`); 0.33 takes the
    fine hash at the block's end, which already chains over the whole prefix
    (`spec.hashing.coarse_hashes_for`)."""
    scale = block_size // config.hash_block_size
    if config.profile is P.Profile.V0_13 or scale == 1:
        return coarse_hashes(block_hashes, config.hash_block_size, block_size)
    return H.coarse_hashes_for(config.profile, tuple(block_hashes), scale)


def _hit_pattern(pool: PoolState, hashes: Sequence[bytes], group_ids: Sequence[int]) -> tuple[
    bool, ...
]:
    return tuple(P.get_cached_block(pool, h, group_ids) is not None for h in hashes)


def _hit_blocks(
    pool: PoolState, hashes: Sequence[bytes], group_ids: Sequence[int], first: int, end: int
) -> GroupBlocks:
    rows = [P.get_cached_block(pool, hashes[i], group_ids) for i in range(first, end)]
    return tuple(
        (NULL_BLOCK,) * first + tuple(row[g] for row in rows)  # type: ignore[index]
        for g in range(len(group_ids))
    )


def _type_hit(
    state: ManagerState,
    group: GroupSpec,
    group_ids: Sequence[int],
    block_hashes: Sequence[bytes],
    max_length: int,
    alignment: int,
) -> GroupBlocks:
    """One attention type's hit within max_length tokens, per group of the type."""
    config = state.config
    bs = group.block_size
    hashes = group_hashes(config, block_hashes, bs)
    hits = _hit_pattern(state.pool, hashes, group_ids)
    max_length = min(max_length, len(hashes) * bs)
    eagle = config.use_eagle
    if group.kind in FULL_KINDS:
        end = rules.full_attention_hit_blocks(hits, max_length, bs, alignment, eagle)
        first = 0
    elif group.kind is Kind.SLIDING_WINDOW:
        first, end = rules.sliding_window_hit(
            hits, max_length, bs, group.sliding_window, alignment, eagle
        )
    elif group.kind is Kind.CHUNKED_LOCAL:
        first, end = rules.chunked_local_hit(hits, max_length, bs, group.attention_chunk_size)
    elif group.kind is Kind.MAMBA:
        end = rules.mamba_hit_blocks(hits, max_length, bs, alignment)
        first = max(end - 1, 0)
    else:
        raise BadConfig(f"{group.kind} is never prefix-cached")
    return _hit_blocks(state.pool, hashes, group_ids, first, end)


def attention_types(config: ManagerConfig) -> tuple[tuple[GroupSpec, tuple[int, ...]], ...]:
    """Distinct group specs with their group ids: full attention first, then group order."""
    order: dict[GroupSpec, list[int]] = {}
    for group_id, group in enumerate(config.groups):
        order.setdefault(group, []).append(group_id)
    types = [(spec, tuple(ids)) for spec, ids in order.items()]
    return tuple(sorted(types, key=lambda t: t[0].kind not in FULL_KINDS))


def find_longest_cache_hit(
    state: ManagerState, block_hashes: Sequence[bytes], max_cache_hit_length: int
) -> tuple[GroupBlocks, int]:
    """Per group, the blocks of the longest hit within max_cache_hit_length tokens, and its
    length. Caching off: nothing. One group: its rule, once, aligned to its block size. Several:
    every type's rule in turn, aligned to the lcm of the block sizes, limited by the length
    so far, until a whole pass shortens nothing."""
    config = state.config
    groups = config.groups
    if not config.enable_caching:
        return tuple(() for _ in groups), 0
    alignment = config.alignment
    if len(groups) == 1:
        # One group: its rule, once (EAGLE's dropped block must not be dropped again).
        hit = _type_hit(state, groups[0], (0,), block_hashes, max_cache_hit_length, alignment)
        return hit, len(hit[0]) * groups[0].block_size
    hit, length, _ = _hybrid_hit(state, block_hashes, max_cache_hit_length)
    return hit, length


def _hybrid_hit(state: ManagerState, block_hashes: Sequence[bytes], max_cache_hit_length: int
                ) -> tuple[GroupBlocks, int, int]:
    """Several groups: the reconciled hit, its length, and the first type's own first hit
    (the longest single-type hit: later types only shorten it)."""
    config = state.config
    length = max_cache_hit_length
    first_hit = -1
    found: dict[int, GroupBlocks] = {}
    while True:
        shortened = False
        for index, (spec, group_ids) in enumerate(attention_types(config)):
            found[index] = _type_hit(state, spec, group_ids, block_hashes, length,
                                     config.alignment)
            hit_length = len(found[index][0]) * spec.block_size
            if first_hit < 0:
                first_hit = hit_length
            if hit_length < length:
                length, shortened = hit_length, True
        if not shortened:
            break
    per_group: list[tuple[BlockId, ...]] = [() for _ in config.groups]
    for index, (_, group_ids) in enumerate(attention_types(config)):
        for group_id, blocks in zip(group_ids, found[index], strict=True):
            per_group[group_id] = blocks
    return tuple(per_group), length, max(first_hit, length)


def shared_prefix_boundary(state: ManagerState, request: RequestView) -> int:
    """vLLM 0.33's third output of ``get_computed_blocks``: where the longest single-type
    hit ends, when another type (a window, a Mamba state) cut the reconciled hit shorter;
    else 0. The scheduler pins that junction so sparse retention keeps it for the next
    request (kv_cache_manager.py ``shared_prefix_boundary``; kv_cache_coordinator.py
    ``num_uncached_common_prefix_tokens``). One group: always 0. Never at or below the
    lookup's own length: 0 or past it."""
    config = state.config
    if (len(config.groups) < 2 or not config.enable_caching
            or request.skip_reading_prefix_cache or not request.num_tokens):
        return 0
    _, length, longest = _hybrid_hit(state, request.block_hashes, request.num_tokens - 1)
    return longest if longest > length else 0


def _check_request(config: ManagerConfig, request: RequestView) -> None:
    if not 0 <= request.num_tokens <= config.max_model_len:
        raise BadAllocation(
            f"request {request.request_id!r} has {request.num_tokens} tokens, more than "
            f"max_model_len={config.max_model_len}")
    if request.num_computed_tokens < 0:
        raise BadAllocation(f"request {request.request_id!r}: negative num_computed_tokens")


def get_computed_blocks(state: ManagerState, request: RequestView) -> tuple[GroupBlocks, int]:
    """The longest cached prefix of the request, capped at num_tokens - 1 tokens."""
    config = state.config
    _check_request(config, request)
    if not config.enable_caching or request.skip_reading_prefix_cache or not request.num_tokens:
        return tuple(() for _ in config.groups), 0
    if len(request.block_hashes) < request.num_tokens // config.hash_block_size:
        raise BadAllocation(f"request {request.request_id!r} has too few block hashes")
    return find_longest_cache_hit(state, request.block_hashes, request.num_tokens - 1)


# --- One attention type's manager, called directly --------------------------------------------
# The coordinators call each single-type manager for every group of its type; these functions
# say what the manager's own public methods return when called directly (the attention layer,
# conformance/attention_manager_machine.py), so that a bug the coordinators mask is still seen.


def type_cache_hit(
    pool: PoolState,
    group: GroupSpec,
    group_ids: Sequence[int],
    block_hashes: Sequence[bytes],
    max_length: int,
    alignment_tokens: int,
    use_eagle: bool,
) -> GroupBlocks:
    """``find_longest_cache_hit`` of one attention type over ``group_ids``, for hashes of the
    type's own block size: per group id, null blocks where blocks slid out of the window, then
    the hit blocks. A block is a hit only where its hash is cached in *every* group, so every
    list has the same length (the common-length cut: never one group's longer run)."""
    bs = group.block_size
    hits = _hit_pattern(pool, block_hashes, group_ids)
    max_length = min(max_length, len(block_hashes) * bs)
    if group.kind in FULL_KINDS:
        first, end = 0, rules.full_attention_hit_blocks(hits, max_length, bs, alignment_tokens,
                                                        use_eagle)
    elif group.kind is Kind.SLIDING_WINDOW:
        first, end = rules.sliding_window_hit(hits, max_length, bs, group.sliding_window,
                                              alignment_tokens, use_eagle)
    elif group.kind is Kind.CHUNKED_LOCAL:
        first, end = rules.chunked_local_hit(hits, max_length, bs, group.attention_chunk_size)
    elif group.kind is Kind.MAMBA:
        end = rules.mamba_hit_blocks(hits, max_length, bs, alignment_tokens)
        first = max(end - 1, 0)
    else:
        raise BadConfig(f"{group.kind} is never prefix-cached")
    return _hit_blocks(pool, block_hashes, group_ids, first, end)


def same_length_in_every_group(hit: GroupBlocks) -> bool:
    """A direct lookup's lists all have one length (the hit length is read off the first)."""
    return len({len(blocks) for blocks in hit}) <= 1


def skipped_tokens(group: GroupSpec, num_computed_tokens: int,
                   mamba_keeps_blocks: bool = False) -> int:
    """Leading tokens of a request no future token of ``group`` attends to (<= 0: none).
    The model skips every Mamba token but the last; vLLM 0.13.0's Mamba manager skips none
    (``mamba_keeps_blocks``; docs/findings.md M1, a gap the manager model has yet to decide)."""
    if group.kind is Kind.MAMBA and mamba_keeps_blocks:
        return 0
    return _skipped_tokens(group, num_computed_tokens)


def skipped_blocks_to_free(
    blocks: Sequence[BlockId], group: GroupSpec, num_computed_tokens: int,
    mamba_keeps_blocks: bool = False,
) -> tuple[int, ...]:
    """Indices of the blocks ``remove_skipped_blocks`` frees, highest first: the leading
    blocks made only of skipped tokens, walked down from the last of them and stopping at the
    first null block (everything before it was nulled by an earlier call)."""
    count = min(rules.skipped_blocks(
        skipped_tokens(group, num_computed_tokens, mamba_keeps_blocks), group.block_size),
        len(blocks))
    indices: list[int] = []
    for i in range(count - 1, -1, -1):
        if blocks[i] == NULL_BLOCK:
            break
        indices.append(i)
    return tuple(indices)


def type_blocks_to_allocate(
    pool: PoolState, group: GroupSpec, num_tokens: int, held: Sequence[BlockId],
    hits: Sequence[BlockId],
) -> int:
    """``get_num_blocks_to_allocate`` of one manager: the blocks beyond those held and the
    hits for ``num_tokens`` tokens (Mamba: plus its speculative blocks), plus one for every
    hit now free (may be negative)."""
    evictable = sum(1 for b in hits if b != NULL_BLOCK and pool.ref[b] == 0)
    return rules.num_blocks_to_allocate(_slot_tokens(group, num_tokens, 0), group.block_size,
                                        len(hits), len(held), evictable)


def type_common_prefix_blocks(
    pool: PoolState, group: GroupSpec, blocks: Sequence[BlockId], num_requests: int
) -> int:
    """``get_num_common_prefix_blocks`` of one manager: full attention counts the leading
    blocks every one of the ``num_requests`` requests holding blocks shares; others 0."""
    if group.kind not in FULL_KINDS:
        return 0
    count = 0
    for block in blocks:
        if pool.ref[block] != num_requests:
            break
        count += 1
    return count


# --- Allocation --------------------------------------------------------------------------------


def _skipped_tokens(group: GroupSpec, num_computed_tokens: int) -> int:
    if group.kind is Kind.SLIDING_WINDOW:
        return rules.sliding_window_skipped_tokens(num_computed_tokens, group.sliding_window)
    if group.kind is Kind.CHUNKED_LOCAL:
        return rules.chunked_local_skipped_tokens(num_computed_tokens,
                                                  group.attention_chunk_size)
    if group.kind is Kind.MAMBA:
        return rules.mamba_skipped_tokens(num_computed_tokens)
    return 0


def _skipped_indices(blocks: Sequence[BlockId], group: GroupSpec, num_computed: int) -> list[int]:
    """Indices of blocks that slid out of the window, highest first, down to the first null."""
    count = min(rules.skipped_blocks(_skipped_tokens(group, num_computed), group.block_size),
                len(blocks))
    indices = []
    for i in range(count - 1, -1, -1):
        if blocks[i] == NULL_BLOCK:
            break
        indices.append(i)
    return indices


def _align_skip_plan(blocks: Sequence[BlockId], group: GroupSpec, num_computed: int,
                     mamba: MambaAlign) -> tuple[list[int], int | None, MambaAlign]:
    """An align-mode Mamba group's ``remove_skipped_blocks`` (vLLM 0.33): the indices the
    skip walk frees (highest first), the state block freed after them (or None), and the
    request's new `MambaAlign`.

    Why: the walk over the leading blocks made only of skipped tokens (all but the last,
    single_type_kv_cache_manager.py:2027-2031 and 705-719) passes null blocks instead of
    stopping at the first one, because prefill leaves null gaps between the states (1587-1592),
    and starts at ``_num_retired_blocks`` (1583), which it then raises to the walk's end
    (1594). Then the state block allocated two steps back is freed once it lies below the
    last computed token's block (1617-1635)."""
    bs = group.block_size
    last = min(rules.skipped_blocks(rules.mamba_skipped_tokens(num_computed), bs), len(blocks))
    first = mamba.retired
    walked: list[int] = []
    if first < last:
        walked = [i for i in range(last - 1, first - 1, -1) if blocks[i] != NULL_BLOCK]
        mamba = replace(mamba, retired=last)
    state_index = mamba.last_state_idx
    if (state_index is None or state_index >= rules.cdiv(num_computed, bs) - 1
            or state_index in walked or blocks[state_index] == NULL_BLOCK):
        state_index = None
    return walked, state_index, mamba


def _free_skipped(state: ManagerState, request_id: str, num_computed_tokens: int
                  ) -> ManagerState:
    """allocate_slots' stage 1: in every group, the request's blocks that slid out of the
    window become null blocks, and the pool frees them (highest index first). An align-mode
    Mamba group frees its walk in one call, then the old state block in another (vLLM 0.33,
    `_align_skip_plan`)."""
    pool = state.pool
    tables = list(state.tables)
    mamba = state.mamba
    config = state.config
    for g, group in enumerate(config.groups):
        current = _table_get(tables[g], request_id)
        if current is None:
            continue
        batches: list[list[int]]
        if is_align_mamba(config, group):
            walked, state_index, entry = _align_skip_plan(
                current, group, num_computed_tokens, _mamba_get(state, g, request_id))
            mamba = _mamba_put(mamba, len(config.groups), g, request_id, entry)
            batches = [walked, [] if state_index is None else [state_index]]
        else:
            batches = [_skipped_indices(current, group, num_computed_tokens)]
        nulled = list(current)
        for skipped in batches:
            if skipped:
                pool = P.free_blocks(pool, [current[i] for i in skipped])
                for i in skipped:
                    nulled[i] = NULL_BLOCK
        if tuple(nulled) != current:
            tables[g] = _put(tables[g], request_id, tuple(nulled))  # type: ignore[assignment]
    return replace(state, pool=pool, tables=tuple(tables), mamba=mamba)


def _skip_frees(state: ManagerState, request_id: str, group_id: int,
                blocks: Sequence[BlockId], num_computed: int) -> list[BlockId]:
    """The blocks of one group stage 1 hands back to the pool."""
    group = state.config.groups[group_id]
    if is_align_mamba(state.config, group):
        walked, state_index, _ = _align_skip_plan(
            blocks, group, num_computed, _mamba_get(state, group_id, request_id))
        return [blocks[i] for i in walked] + ([] if state_index is None
                                              else [blocks[state_index]])
    return [blocks[i] for i in _skipped_indices(blocks, group, num_computed)]


def _slot_tokens(group: GroupSpec, num_tokens: int, num_encoder_tokens: int) -> int:
    if group.kind is Kind.CROSS:
        return num_encoder_tokens
    if group.kind is Kind.MAMBA:
        return num_tokens + group.block_size * group.num_speculative_blocks
    return num_tokens


def _check_slots(state: ManagerState, request_id: str, num_tokens: int) -> None:
    """No token counted as computed without a slot in every group holding decoder tokens."""
    for g, group in enumerate(state.config.groups):
        if group.kind is Kind.CROSS:
            continue
        held = len(_table_get(state.tables[g], request_id) or ()) * group.block_size
        if num_tokens > held:
            raise BadAllocation(
                f"{num_tokens} computed tokens, but request {request_id!r} holds {held} slots "
                f"in group {g}")


def _check_hits(state: ManagerState, request: RequestView, hits: GroupBlocks,
                num_hit_tokens: int) -> None:
    """Hits are the request's: per group num_hit_tokens tokens of blocks, leading null blocks
    only where blocks slide out of the window, each real block the first cached under the
    request's hash at its position, and the last token left to compute."""
    config = state.config
    if num_hit_tokens >= request.num_tokens:
        raise BadAllocation(f"hits of {num_hit_tokens} tokens leave no token to compute")
    for g, (group, blocks) in enumerate(zip(config.groups, hits, strict=True)):
        if len(blocks) * group.block_size != num_hit_tokens:
            raise BadAllocation(f"{len(blocks)} hit blocks in group {g} for {num_hit_tokens}")
        num_null = blocks.count(NULL_BLOCK) if group.kind not in (*FULL_KINDS, Kind.CROSS) else 0
        if NULL_BLOCK in blocks[num_null:]:
            raise BadAllocation(f"a null block among the real hits of group {g}")
        hashes = group_hashes(config, request.block_hashes, group.block_size)
        if len(hashes) < len(blocks):
            raise BadAllocation(f"hits in group {g} beyond the request's hashes")
        for i in range(num_null, len(blocks)):
            cached = P.get_cached_block(state.pool, hashes[i], (g,))
            if cached is None or cached[0] != blocks[i]:
                raise BadAllocation(f"block {blocks[i]} is not the request's hit {i} in group {g}")


def same_step_mamba_hit(state: ManagerState, hits: GroupBlocks) -> bool:
    """A hit whose last block, in some align-mode Mamba group, carries a key cached since the
    last NewStep (vLLM 0.33 compares the block's primary key, ``block_hash``, with the
    manager's ``cached_blocks_this_step``, single_type_kv_cache_manager.py:1714-1716)."""
    config = state.config
    for group, blocks in zip(config.groups, hits, strict=False):
        if is_align_mamba(config, group) and blocks:
            key = state.pool.key_of[blocks[-1]]
            if key is not None and key in state.cached_this_step:
                return True
    return False


def align_blocks_to_allocate(group: GroupSpec, num_tokens_main: int, num_hits: int,
                             num_held: int) -> int:
    """An align-mode Mamba group's ``get_num_blocks_to_allocate`` before its evictable hits
    (vLLM 0.33, single_type_kv_cache_manager.py:1736-1794, with no partial hit, checkpoint
    or speculative block): the table grows to one entry per block of the main model's tokens,
    hits and null entries included, but only one of them is a real new block (the running
    state), so a positive count is capped at 1; a negative one (tokens rolled back below the
    table) stays.

    pre: group.block_size > 0 and num_tokens_main >= 0 and num_hits >= 0 and num_held >= 0
    post: __return__ <= 1
    """
    count = rules.cdiv(num_tokens_main, group.block_size) - num_hits - num_held
    return min(count, 1) if count > 0 else count


def _align_allocate(pool: PoolState, group: GroupSpec, blocks: tuple[BlockId, ...],
                    num_tokens_main: int, entry: MambaAlign
                    ) -> tuple[PoolState, tuple[BlockId, ...], tuple[BlockId, ...], MambaAlign]:
    """An align-mode Mamba group's ``allocate_new_blocks`` (vLLM 0.33,
    single_type_kv_cache_manager.py:1811-1923): the pool, the table, what allocate_slots
    returns for the group, and the request's new `MambaAlign`.

    Why: the table holds one entry per block of the main model's tokens, but only the
    running state needs a real block; so when the table is long enough nothing is taken
    (1830-1836); otherwise the last entry (the previous state, or the hit) is recorded as the
    state to free later (1839-1849), null entries pad the table to one short of its length
    (1851-1859) and one new block ends it (1874-1877). vLLM returns the table's new tail,
    ``req_blocks[prev_block_len:]``: the null padding and the new block (1878, 1920-1922)."""
    required = rules.cdiv(num_tokens_main, group.block_size)
    if required <= len(blocks):
        return pool, blocks, (), replace(entry, allocated=True)
    if blocks:
        entry = replace(entry, last_state_idx=len(blocks) - 1)
    padding = (NULL_BLOCK,) * max(required - 1 - len(blocks), 0)
    pool, taken = P.get_new_blocks(pool, required - len(blocks) - len(padding))
    return pool, blocks + padding + taken, padding + taken, replace(entry, allocated=True)


def allocate_slots(
    state: ManagerState,
    request: RequestView,
    num_new_tokens: int,
    num_new_computed_tokens: int = 0,
    new_computed_blocks: GroupBlocks | None = None,
    num_lookahead_tokens: int = 0,
    delay_cache_blocks: bool = False,
    num_encoder_tokens: int = 0,
) -> tuple[ManagerState, GroupBlocks | None]:
    """Slots for num_new_tokens more tokens (and the lookahead ones) after attaching the hits
    new_computed_blocks; the new blocks per group, or None with the state unchanged."""
    config = state.config
    groups = config.groups
    rid = request.request_id
    max_len = config.max_model_len
    if not 0 < num_new_tokens <= max_len:
        raise BadAllocation(f"num_new_tokens must be in [1, {max_len}], got {num_new_tokens}")
    if min(num_new_computed_tokens, num_lookahead_tokens, num_encoder_tokens) < 0 or max(
            num_new_computed_tokens, num_lookahead_tokens) > max_len:
        raise BadAllocation(f"token counts must be in [0, {max_len}]")
    if num_encoder_tokens and all(g.kind is not Kind.CROSS for g in groups):
        raise BadAllocation("encoder tokens for a model without cross-attention")
    _check_request(config, request)
    _check_slots(state, rid, request.num_computed_tokens)
    hits = new_computed_blocks if new_computed_blocks is not None else tuple(() for _ in groups)
    if len(hits) != len(groups):
        raise BadAllocation(f"{len(hits)} groups of hits for {len(groups)} groups")
    held = [_table_get(state.tables[g], rid) for g in range(len(groups))]
    if any(hits):
        if not config.enable_caching:
            raise BadAllocation("cache hits with prefix caching off")
        if any(h is not None for h in held):
            raise BadAllocation(f"request {rid!r} already holds blocks")
        _check_hits(state, request, hits, num_new_computed_tokens)
    elif num_new_computed_tokens:
        raise BadAllocation(f"{num_new_computed_tokens} hit tokens without hit blocks")
    num_computed = request.num_computed_tokens + num_new_computed_tokens
    need = min(num_computed + num_new_tokens + num_lookahead_tokens, config.max_model_len)
    to_cache = min(num_computed + num_new_tokens, request.num_tokens)
    caching_now = config.enable_caching and not delay_cache_blocks
    if caching_now and len(request.block_hashes) < to_cache // config.hash_block_size:
        raise BadAllocation(f"request {rid!r} has too few block hashes")

    # Stage 2, counted before anything changes: what the pool will have once stage 1 has
    # freed the out-of-window blocks (those no other request holds).
    pool = state.pool
    wanted = 0
    freed_by_skip = 0
    # vLLM 0.33's align-mode Mamba sizes its table by the main model's tokens only: draft
    # models have no Mamba layers, and lookahead slots would break the block alignment
    # (single_type_kv_cache_manager.py:1729-1735; kv_cache_manager.py:546, uncapped).
    num_main = min(num_computed, max_len) + num_new_tokens
    for g, group in enumerate(groups):
        blocks = held[g] or ()
        group_hits = () if group.kind is Kind.CROSS else hits[g]
        evictable = sum(1 for b in group_hits if b != NULL_BLOCK and pool.ref[b] == 0)
        if is_align_mamba(config, group):
            if same_step_mamba_hit(state, hits):
                # Why: a state cached this step is written by this step's forward pass, so a
                # hit on it must wait; 0.33 asks for more blocks than the pool has (num_gpu_blocks
                # + 1, single_type_kv_cache_manager.py:1714-1724): a refusal for lack of room.
                wanted += config.num_blocks + 1
                continue
            count = align_blocks_to_allocate(group, num_main, len(group_hits), len(blocks))
        else:
            count = rules.num_blocks_to_allocate(
                _slot_tokens(group, need, num_encoder_tokens), group.block_size,
                len(group_hits), len(blocks), 0)
        # A group's surplus (a negative count) is no use to the others (vLLM 0.33's
        # coordinator sums align-mode Mamba's count unclamped, kv_cache_coordinator.py:236-262:
        # a difference, see the module docstring).
        wanted += max(0, count + evictable)
        freed_by_skip += sum(1 for b in _skip_frees(state, rid, g, blocks,
                                                    request.num_computed_tokens)
                             if pool.ref[b] == 1)
    if wanted > P.num_free(pool) + freed_by_skip:
        # Too few free blocks: not a bad call, so the profile decides whether stage 1 runs.
        if not config.profile.refusal_frees_skipped_blocks:
            return state, None
        return _free_skipped(state, rid, request.num_computed_tokens), None

    # Stage 1: out-of-window blocks become null blocks and go back to the pool.
    state = _free_skipped(state, rid, request.num_computed_tokens)
    pool = state.pool
    held = [_table_get(state.tables[g], rid) for g in range(len(groups))]
    tables = list(state.tables)
    counts = list(state.num_cached)
    # Stage 3: attach the hits (a new request only).
    if any(hits):
        pool = P.touch(pool, [b for group_hits in hits for b in group_hits])
    for g in range(len(groups)):
        if held[g] is None and hits[g]:
            held[g] = tuple(hits[g])
            counts[g] = _put(counts[g], rid, len(hits[g]))  # type: ignore[assignment]
    # Stage 4: new blocks, group by group.
    new_blocks: list[tuple[BlockId, ...]] = []
    mamba = state.mamba
    for g, group in enumerate(groups):
        blocks = held[g] or ()
        if is_align_mamba(config, group):
            entry = _mamba_get(state, g, rid)
            pool, blocks, taken, entry = _align_allocate(pool, group, blocks, num_main, entry)
            mamba = _mamba_put(mamba, len(groups), g, rid, entry)
            held[g] = blocks
        else:
            missing = rules.blocks_needed(_slot_tokens(group, need, num_encoder_tokens),
                                          group.block_size) - len(blocks)
            taken = ()
            if missing > 0:
                pool, taken = P.get_new_blocks(pool, missing)
            held[g] = blocks + taken
        new_blocks.append(taken)
        tables[g] = _put(tables[g], rid, held[g])  # type: ignore[assignment]
    state = replace(state, pool=pool, tables=tuple(tables), num_cached=tuple(counts),
                    mamba=mamba)
    # Stage 5: key the blocks the computed tokens fill.
    if caching_now:
        state = cache_blocks(state, request, to_cache)
    return state, tuple(new_blocks)


def _keys_prompt_tail(config: ManagerConfig, group: GroupSpec) -> bool:
    """vLLM 0.33's full attention over blocks larger than the hash block also keys the block
    where the prompt's last hash boundary falls (single_type_kv_cache_manager.py:854-897)."""
    return (group.kind in FULL_KINDS and config.profile.multi_key_blocks
            and group.block_size != config.hash_block_size)


def _cache_prompt_tail(pool: PoolState, config: ManagerConfig, group_id: int,
                       request: RequestView, num_tokens: int, blocks: Sequence[BlockId]
                       ) -> PoolState:
    """The partial entry at the prompt's last hash boundary, made after the full keys of
    the call: a resent prompt matches at most ``num_prompt_tokens - 1`` tokens (all of
    them under EAGLE, which drops a unit after), so that boundary is where a sibling
    resumes. Made after the call's full keys, so it sits beside them. Nothing when it lies
    on a block edge (the full key serves it), past the tokens cached, or past the blocks
    held."""
    hash_bs = config.hash_block_size
    limit = request.num_prompt_tokens - (0 if config.use_eagle else 1)
    boundary = min(limit // hash_bs, len(request.block_hashes)) * hash_bs
    bs = config.groups[group_id].block_size
    if (boundary <= 0 or boundary > num_tokens or boundary % bs == 0
            or boundary // bs >= len(blocks)):
        return pool
    pool, _ = P.cache_partial_block(
        pool, blocks[boundary // bs], request.block_hashes, boundary, group_id, bs, hash_bs,
        token_ids=request.token_ids[boundary - hash_bs:boundary], lora_id=request.lora_id)
    return pool


def cache_blocks(state: ManagerState, request: RequestView, num_tokens: int) -> ManagerState:
    """Key every group's blocks that num_tokens tokens fill and that are not keyed yet.

    Under `Profile.caches_to_scheduler_block` a hybrid model first rounds num_tokens down to
    the scheduler block, for every group (vLLM 0.33's HybridKVCacheCoordinator
    ``get_num_cacheable_tokens``, kv_cache_coordinator.py:777-804: hits are aligned to it, so
    a block past it serves none). An align-mode Mamba group records the keys it gives its
    non-null blocks in ``cached_this_step`` (single_type_kv_cache_manager.py:2000-2010); its
    prompt-boundary partial entry (``_cache_partial_tail_block``, 2038-2135) adds nothing when
    the hash block is the Mamba block: the boundary block was just keyed with that very
    prefix, or is null (2112-2117), and a boundary on a block edge records no partial hit
    (2124)."""
    config = state.config
    if num_tokens < 0:
        raise BadAllocation(f"cache_blocks of {num_tokens} tokens")
    _check_slots(state, request.request_id, num_tokens)
    if not config.enable_caching:
        return state
    if len(request.block_hashes) < num_tokens // config.hash_block_size:
        raise BadAllocation(f"request {request.request_id!r} has too few block hashes")
    if len(config.groups) > 1 and config.profile.caches_to_scheduler_block:
        num_tokens = num_tokens // config.alignment * config.alignment
    pool = state.pool
    counts = list(state.num_cached)
    rid = request.request_id
    recorded = set(state.cached_this_step)
    for g, group in enumerate(config.groups):
        blocks = _table_get(state.tables[g], rid) or ()
        num_full = num_tokens // group.block_size
        num_cached = _count_get(counts[g], rid)
        if num_cached >= num_full:
            if _keys_prompt_tail(config, group):
                pool = _cache_prompt_tail(pool, config, g, request, num_tokens, blocks)
            continue
        if group.kind is Kind.CROSS:
            raise BadConfig("cross-attention is never prefix-cached")
        bs = group.block_size
        pool = P.cache_full_blocks(
            pool, blocks, group_hashes(config, request.block_hashes, bs),
            num_cached, num_full, g,
            token_ids=request.token_ids[num_cached * bs : num_full * bs], block_size=bs,
            lora_id=request.lora_id, retention=request.retention,
        )
        if is_align_mamba(config, group):
            recorded.update(key for b in blocks[num_cached:num_full] if b != NULL_BLOCK
                            for key in [pool.key_of[b]] if key is not None)
        counts[g] = _put(counts[g], rid, num_full)  # type: ignore[assignment]
        if _keys_prompt_tail(config, group):
            pool = _cache_prompt_tail(pool, config, g, request, num_tokens, blocks)
    return replace(state, pool=pool, num_cached=tuple(counts),
                   cached_this_step=tuple(sorted(recorded)))


def free(state: ManagerState, request_id: str, strict: bool = False) -> ManagerState:
    """Release the request's blocks: group by group, each list last block first (null
    blocks skipped); an align-mode Mamba group forgets the request's `MambaAlign` too (vLLM
    0.33's ``pop_blocks_for_free``, single_type_kv_cache_manager.py:1952-1969 and 571-601)."""
    if strict and all(_table_get(t, request_id) is None for t in state.tables):
        raise UnknownRequest(f"no blocks held for request {request_id!r}")
    pool = state.pool
    for table in state.tables:
        blocks = _table_get(table, request_id)
        if blocks:
            pool = P.free_blocks(pool, tuple(reversed(blocks)))
    return replace(_forget(state, request_id), pool=pool)


def _forget(state: ManagerState, request_id: str) -> ManagerState:
    """The request's bookkeeping gone from every group (its blocks not released)."""
    return replace(
        state,
        tables=tuple(_drop(t, request_id) for t in state.tables),  # type: ignore[misc]
        num_cached=tuple(_drop(c, request_id) for c in state.num_cached),  # type: ignore[misc]
        mamba=tuple(_drop(m, request_id) for m in state.mamba),  # type: ignore[misc]
    )


def pop_blocks_for_free(state: ManagerState, request_id: str
                        ) -> tuple[ManagerState, tuple[BlockId, ...]]:
    """vLLM 0.33's deferred free, first half: the request's bookkeeping goes, and its blocks
    (each group's list without its leading null blocks, the groups concatenated in order)
    go to the caller, still referenced, to be released after the step that may write them
    (kv_cache_coordinator.py:414-431, `trim_null_head` in kv_cache_utils.py:247-250; the
    scheduler's ``_free_request_blocks``, sched/scheduler.py:3084-3093)."""
    popped: list[BlockId] = []
    for table in state.tables:
        blocks = _table_get(table, request_id) or ()
        first = next((i for i, b in enumerate(blocks) if b != NULL_BLOCK), len(blocks))
        popped.extend(blocks[first:])
    state = _forget(state, request_id)
    if popped:  # the scheduler defers only a non-empty batch
        state = replace(state, deferred=state.deferred + (tuple(popped),))
    return state, tuple(popped)


def drain_deferred_frees(state: ManagerState) -> ManagerState:
    """The deferred free's second half, once the fences have passed: every batch, in pop
    order, goes back to the pool reversed ("so that the tail blocks are evicted first",
    sched/scheduler.py:3109-3119). Across groups this order differs from `free`'s
    (docs/findings.md B14): the last group's tail is released first."""
    pool = state.pool
    for batch in state.deferred:
        pool = P.free_blocks(pool, tuple(reversed(batch)))
    return replace(state, pool=pool, deferred=())


def new_step(state: ManagerState) -> ManagerState:
    """A scheduler step starts: the keys cached in the last one may serve Mamba hits now
    (vLLM 0.33's ``new_step_starts``, kv_cache_manager.py:929, clearing each Mamba manager's
    ``cached_blocks_this_step``, single_type_kv_cache_manager.py:2035-2036)."""
    return replace(state, cached_this_step=())


# --- Queries -----------------------------------------------------------------------------------


def get_blocks(state: ManagerState, request_id: str) -> GroupBlocks:
    return tuple(_table_get(t, request_id) or () for t in state.tables)


def get_num_common_prefix_blocks(state: ManagerState, request_id: str) -> tuple[int, ...]:
    """Per group: full attention counts the leading blocks of the request whose ref count is
    the number of requests holding blocks in the group; other types (and caching off) 0.
    vLLM 0.33 removed cascade attention: 0 everywhere (`Profile.cascade_prefix_removed`)."""
    if not state.config.enable_caching or state.config.profile.cascade_prefix_removed:
        return tuple(0 for _ in state.config.groups)
    result = []
    for group, table in zip(state.config.groups, state.tables, strict=True):
        count = 0
        if group.kind in FULL_KINDS:
            for block in _table_get(table, request_id) or ():
                if state.pool.ref[block] != len(table):
                    break
                count += 1
        result.append(count)
    return tuple(result)


def usage(state: ManagerState) -> float:
    return P.usage(state.pool)


def reset_prefix_cache(state: ManagerState) -> tuple[ManagerState, bool]:
    pool, done = P.reset_prefix_cache(state.pool)
    return replace(state, pool=pool), done


def take_events(state: ManagerState) -> tuple[ManagerState, tuple[P.Event, ...]]:
    pool, events = P.take_events(state.pool)
    return replace(state, pool=pool), events


# --- Invariants --------------------------------------------------------------------------------


def ref_counts_are_references(state: ManagerState) -> bool:
    """Every non-null block's ref count is the number of request lists (and sink
    reservations, pins, and batches popped for a deferred free) holding it."""
    counts = [0] * state.config.num_blocks
    for block in state.pool.pinned:
        counts[block] += 1
    for table in state.tables:
        for _, blocks in table:
            for block in blocks:
                counts[block] += 1
    for sinks in state.sink_blocks:
        for block in sinks:
            counts[block] += 1
    for batch in state.deferred:
        for block in batch:
            counts[block] += 1
    return all(state.pool.ref[b] == counts[b] for b in range(1, state.config.num_blocks))


def no_block_twice_in_a_list(state: ManagerState) -> bool:
    """A request's list in one group never holds a real block twice."""
    return all(
        len(real) == len(set(real))
        for table in state.tables
        for _, blocks in table
        for real in [[b for b in blocks if b != NULL_BLOCK]]
    )


def blocks_keyed_in_their_group(state: ManagerState) -> bool:
    """A keyed block held by a request of group g carries g's id in its key."""
    for g, table in enumerate(state.tables):
        for _, blocks in table:
            for block in blocks:
                key = state.pool.key_of[block]
                if key is not None and int.from_bytes(key[-4:], "big") != g:
                    return False
    return True


def cached_prefix_is_keyed(state: ManagerState) -> bool:
    """The first num_cached blocks of every list are keyed (or null) and no more than the list."""
    for table, counts in zip(state.tables, state.num_cached, strict=True):
        for rid, num_cached in counts:
            blocks = _table_get(table, rid)
            if blocks is None or num_cached > len(blocks):
                return False
            if any(b != NULL_BLOCK and state.pool.key_of[b] is None for b in blocks[:num_cached]):
                return False
    return True


def null_blocks_only_where_skipped(state: ManagerState) -> bool:
    """Full, sink and cross-attention lists hold no null block; the others hold null blocks
    only before their real ones. An align-mode Mamba list pads with null blocks between its
    states (vLLM 0.33, single_type_kv_cache_manager.py:1851-1859): nulls anywhere before its
    last entry, which is the running state and always real."""
    config = state.config
    for group, table in zip(config.groups, state.tables, strict=True):
        for _, blocks in table:
            if is_align_mamba(config, group):
                if blocks and blocks[-1] == NULL_BLOCK:
                    return False
            elif group.kind in (*FULL_KINDS, Kind.CROSS):
                if NULL_BLOCK in blocks:
                    return False
            else:
                real = [i for i, b in enumerate(blocks) if b != NULL_BLOCK]
                if real and NULL_BLOCK in blocks[real[0]:]:
                    return False
    return True


def mamba_holds_at_most_two_states(state: ManagerState) -> bool:
    """An align-mode Mamba list holds at most two real blocks: the running state and the
    one it was copied from, freed at the next allocation once computed past (vLLM 0.33,
    single_type_kv_cache_manager.py:1617-1635; no speculative blocks modelled). Holds as long
    as a request's computed tokens never go back (a rollback lets a long chunk add a third)."""
    config = state.config
    for group, table in zip(config.groups, state.tables, strict=True):
        if is_align_mamba(config, group):
            for _, blocks in table:
                if sum(1 for b in blocks if b != NULL_BLOCK) > 2:
                    return False
    return True


def mamba_state_is_known(state: ManagerState) -> bool:
    """Align-mode bookkeeping only for align-mode Mamba groups and requests holding a list
    there; a recorded state index points into the list; nothing cached this step unless
    some group is in align mode."""
    config = state.config
    align = [is_align_mamba(config, g) for g in config.groups]
    if not any(align) and (state.cached_this_step or any(state.mamba)):
        return False
    for g, entries in enumerate(state.mamba):
        for rid, entry in entries:
            blocks = _table_get(state.tables[g], rid)
            if not align[g] or blocks is None:
                return False
            if entry.last_state_idx is not None and not 0 <= entry.last_state_idx < len(blocks):
                return False
    return True


def no_same_step_mamba_hit(before: ManagerState, hits: GroupBlocks | None,
                           result: GroupBlocks | None) -> bool:
    """Rule check for one allocate_slots call from state ``before`` with hits ``hits``: a
    hit on an align-mode Mamba key cached since the last NewStep is refused (``result`` is
    None; vLLM 0.33, single_type_kv_cache_manager.py:1714-1724)."""
    return hits is None or not same_step_mamba_hit(before, hits) or result is None


def no_caching_no_keys(state: ManagerState) -> bool:
    """With caching off nothing is keyed and nothing counted as keyed."""
    if state.config.enable_caching:
        return True
    return all(k is None for k in state.pool.key_of) and all(
        n == 0 for counts in state.num_cached for _, n in counts
    )


def request_blocks_match_hashes(state: ManagerState, requests: Mapping[str, RequestView]) -> bool:
    """Every keyed block in the cached prefix of a request's list is keyed with that
    request's chain hash at its position (in its group)."""
    config = state.config
    for g, (group, table) in enumerate(zip(config.groups, state.tables, strict=True)):
        counts = state.num_cached[g]
        for rid, blocks in table:
            request = requests.get(rid)
            if request is None:
                continue
            hashes = group_hashes(config, request.block_hashes,
                                   group.block_size)
            for i in range(_count_get(counts, rid)):
                block = blocks[i]
                if block == NULL_BLOCK:
                    continue
                if i >= len(hashes) or state.pool.key_of[block] != P.make_key(hashes[i], g):
                    return False
    return True


def blocks_cover_computed_tokens(
    state: ManagerState, requests: Mapping[str, RequestView]
) -> bool:
    """Per group, a request's list holds a slot for every token it has computed, and never
    more blocks than max_model_len (plus Mamba's speculative blocks) needs."""
    config = state.config
    for group, table in zip(config.groups, state.tables, strict=True):
        if group.kind is Kind.CROSS:
            continue
        limit = rules.blocks_needed(_slot_tokens(group, config.max_model_len, 0),
                                    group.block_size)
        for rid, blocks in table:
            request = requests.get(rid)
            if request is None:
                continue
            needed = rules.blocks_needed(request.num_computed_tokens, group.block_size)
            if not needed <= len(blocks) <= limit:
                return False
    return True


def released(state: ManagerState, request_id: str) -> bool:
    """Nothing of the request is left: no list and no keyed-count entry in any group."""
    return all(_table_get(t, request_id) is None for t in state.tables) and all(
        _lookup(c, request_id) is None for c in state.num_cached
    ) and all(_lookup(m, request_id) is None for m in state.mamba)


def hit_is_valid(
    state: ManagerState, request: RequestView, hit: GroupBlocks, num_hit_tokens: int
) -> bool:
    """A lookup result: below num_tokens, the same length in every group, and each real
    block keyed with the request's hash at its position."""
    config = state.config
    if num_hit_tokens != 0 and num_hit_tokens >= request.num_tokens:
        return False
    for g, (group, blocks) in enumerate(zip(config.groups, hit, strict=True)):
        if blocks and len(blocks) * group.block_size != num_hit_tokens:
            return False
        hashes = group_hashes(config, request.block_hashes, group.block_size)
        for i, block in enumerate(blocks):
            if block != NULL_BLOCK and state.pool.key_of[block] != P.make_key(hashes[i], g):
                return False
    return True


def refusal_frees_only_skipped_blocks(
    before: ManagerState, after: ManagerState, request: RequestView
) -> bool:
    """After allocate_slots returned None for lack of free blocks: the request's blocks
    that left the window are null blocks back in the pool (stage 1), under a profile whose
    refusal frees them (`Profile.refusal_frees_skipped_blocks`), and nothing else changed:
    no other table, keyed count, ref count, key or free-queue position."""
    expected = before
    if before.config.profile.refusal_frees_skipped_blocks:
        expected = _free_skipped(before, request.request_id, request.num_computed_tokens)
    return (after.tables == expected.tables and after.num_cached == expected.num_cached
            and after.pool.ref == expected.pool.ref and after.pool.free == expected.pool.free
            and after.pool.key_of == expected.pool.key_of and after.mamba == expected.mamba
            and after.cached_this_step == expected.cached_this_step)


INVARIANTS = (
    ref_counts_are_references,
    no_block_twice_in_a_list,
    blocks_keyed_in_their_group,
    cached_prefix_is_keyed,
    null_blocks_only_where_skipped,
    no_caching_no_keys,
    mamba_holds_at_most_two_states,
    mamba_state_is_known,
)


def violated(state: ManagerState, requests: Mapping[str, RequestView] | None = None) -> list[str]:
    """Names of the manager (and pool) invariants the state breaks."""
    from kvspec.spec import pool_invariants

    names = [inv.__name__ for inv in INVARIANTS if not inv(state)]
    if requests is not None:
        for check in (request_blocks_match_hashes, blocks_cover_computed_tokens):
            if not check(state, requests):
                names.append(check.__name__)
    names.extend(f"pool.{name}" for name in pool_invariants.violated(state.pool))
    return names



# --- Requests and their block hashes (spec.hashing) --------------------------------------------
# The manager reads a request's block hashes; a request computes them itself (its block hasher)
# as its tokens arrive. The spec computes them too, from the request's tokens, LoRA adapter and
# cache salt, so that a target's hashing is checked rather than trusted.


def sha256_pickle(value: object) -> bytes:
    """vLLM's ``sha256``: SHA-256 of the value pickled with the highest protocol."""
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


HASH_FUNCTIONS = {"sha256": sha256_pickle}


def lora_name(lora_id: int) -> str:
    """The command vocabulary's LoRA adapter ``lora_id``: named ``lora-<id>``..."""
    return f"lora-{lora_id}"


def lora_path(lora_id: int) -> str:
    """... at path ``/lora/<id>``."""
    return f"/lora/{lora_id}"


@dataclass(frozen=True)
class Hashing:
    """How a target hashes requests' blocks: the hash function (by vLLM's name), the seed of
    every chain (``PYTHONHASHSEED`` when ``init_none_hash`` ran: ``NONE_HASH`` is the hash of
    the seed string) and how extra keys are written (vLLM 0.13: untagged; impl's default and
    vLLM 0.33: tagged)."""

    key_format: H.KeyFormat = H.KeyFormat.TAGGED
    hash_seed: str = "0"
    hash_name: str = "sha256"

    @property
    def hash_fn(self) -> H.HashFunction:
        return HASH_FUNCTIONS[self.hash_name]

    @property
    def none_hash(self) -> bytes:
        return self.hash_fn(self.hash_seed)


@dataclass(frozen=True)
class Request:
    """A request as a scheduler holds it: its tokens, how many are computed, its tenant, and
    the hashes of its full blocks of ``hash_block_size`` tokens."""

    request_id: str
    prompt: tuple[int, ...]
    output: tuple[int, ...] = ()
    num_computed_tokens: int = 0
    lora: int | None = None
    salt: str | None = None
    block_hashes: tuple[bytes, ...] = ()
    retention: tuple[TokenRangeRetention, ...] = ()

    @property
    def token_ids(self) -> tuple[int, ...]:
        return self.prompt + self.output

    def view(self) -> RequestView:
        return RequestView(self.request_id, len(self.token_ids), self.num_computed_tokens,
                           self.block_hashes, self.token_ids, self.lora,
                           retention=self.retention, num_prompt_tokens=len(self.prompt))


def extend_block_hashes(hashing: Hashing, block_size: int, request: Request) -> Request:
    """The request with the hashes of its full blocks not hashed yet appended (a request
    block hasher's call: extra keys LoRA and salt, chained onto the last hash)."""
    tokens = request.token_ids
    done = len(request.block_hashes)
    if (done + 1) * block_size > len(tokens):
        return request
    lora = request.lora
    extras = H.new_blocks_extra_keys(
        len(tokens), block_size, done, None if lora is None else lora_name(lora), (), (), (),
        request.salt, None, hashing.key_format, "" if lora is None else lora_path(lora))
    new = H.chain_hashes(hashing.hash_fn, hashing.none_hash,
                         tokens[done * block_size:(done + len(extras)) * block_size],
                         block_size, extras, request.block_hashes[-1] if done else None)
    return replace(request, block_hashes=request.block_hashes + new)


# --- Operations as data (conformance.lockstep) --------------------------------------------
# One frozen value per call a scheduler makes: on the manager (vLLM 0.13's KVCacheManager API)
# and on its requests (creating one, appending tokens, setting num_computed_tokens). `step` runs
# one on a `Session`: the manager state with the requests and each request's last lookup.


@dataclass(frozen=True)
class NewManager:
    """Build a manager. ``layout`` names the target's KV-cache config (a target builds it
    from the name; the spec reads ``config``); ``hashing`` is how the target hashes."""

    config: ManagerConfig
    hashing: Hashing = Hashing()
    layout: str = ""


@dataclass(frozen=True)
class AddRequest:
    """A new request (its block hasher hashes the prompt's full blocks)."""

    request_id: str
    prompt: tuple[int, ...]
    lora: int | None = None
    salt: str | None = None
    retention: tuple[TokenRangeRetention, ...] = ()  # kvspec's request hints


@dataclass(frozen=True)
class AppendTokens:
    """Tokens generated for the request (its block hasher hashes the blocks they fill)."""

    request_id: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class SetComputedTokens:
    """The scheduler sets ``request.num_computed_tokens``."""

    request_id: str
    num_tokens: int


@dataclass(frozen=True)
class GetComputedBlocks:
    """Look up the request's cached prefix; the result is kept as its hits."""

    request_id: str


@dataclass(frozen=True)
class AllocateSlots:
    """``allocate_slots``; ``with_hits`` passes the last lookup result of request
    ``hits_of`` (the request itself when empty) as ``new_computed_blocks``."""

    request_id: str
    num_new_tokens: int
    num_new_computed_tokens: int = 0
    with_hits: bool = False
    num_lookahead_tokens: int = 0
    delay_cache_blocks: bool = False
    num_encoder_tokens: int = 0
    hits_of: str = ""


@dataclass(frozen=True)
class Free:
    request_id: str


@dataclass(frozen=True)
class CacheBlocks:
    request_id: str
    num_tokens: int


@dataclass(frozen=True)
class EvictBlocks:
    """Evict the keys of a set of blocks (a KV connector's call)."""

    block_ids: tuple[BlockId, ...]


@dataclass(frozen=True)
class GetNumCommonPrefixBlocks:
    request_id: str


@dataclass(frozen=True)
class GetBlockIds:
    request_id: str


@dataclass(frozen=True)
class ResetPrefixCache:
    pass


@dataclass(frozen=True)
class TakeEvents:
    pass


@dataclass(frozen=True)
class NewStep:
    """A scheduler step starts (vLLM 0.33's ``KVCacheManager.new_step_starts``; a no-op for
    every state but the align-mode Mamba keys cached in the last step)."""


@dataclass(frozen=True)
class PopBlocksForFree:
    """Finish a request whose blocks an in-flight step may still write (vLLM 0.33's
    ``KVCacheManager.pop_blocks_for_free``): its blocks go to the scheduler, deferred."""

    request_id: str


@dataclass(frozen=True)
class DrainDeferredFrees:
    """The fences have passed: the scheduler returns every deferred batch to the pool."""


@dataclass(frozen=True)
class Usage:
    pass


# The pool's policy commands (P.SetRetention, P.AdvanceClock, P.PinBlocks, P.UnpinBlocks) are
# the manager's too: the manager passes them to its pool.
ManagerCommand = (NewManager | AddRequest | AppendTokens | SetComputedTokens | GetComputedBlocks
                  | AllocateSlots | Free | CacheBlocks | EvictBlocks | GetNumCommonPrefixBlocks
                  | GetBlockIds | ResetPrefixCache | TakeEvents | Usage | NewStep
                  | PopBlocksForFree | DrainDeferredFrees | P.SetRetention
                  | P.AdvanceClock | P.PinBlocks | P.UnpinBlocks)

Requests = tuple[tuple[str, Request], ...]  # sorted by id
Lookups = tuple[tuple[str, GroupBlocks], ...]  # request id -> its last lookup's blocks


@dataclass(frozen=True)
class Session:
    """The manager and what its scheduler holds: the requests (every one ever added, for the
    hash check) and each request's last lookup result."""

    manager: ManagerState
    hashing: Hashing
    requests: Requests = ()
    hits: Lookups = ()

    def request(self, request_id: str) -> Request:
        found = _lookup(self.requests, request_id)
        if found is None:
            raise UnknownRequest(f"no request {request_id!r}")
        return found  # type: ignore[return-value]

    def request_views(self) -> dict[str, RequestView]:
        return {rid: request.view() for rid, request in self.requests}

    def last_lookup(self, request_id: str) -> GroupBlocks | None:
        """The request's last ``get_computed_blocks`` blocks, or None before any lookup."""
        return _lookup(self.hits, request_id)  # type: ignore[return-value]


def _with_request(session: Session, request: Request) -> Session:
    return replace(session, requests=_put(session.requests, request.request_id,  # type: ignore[arg-type]
                                          request))


def step(session: Session | None, command: ManagerCommand) -> tuple[Session, object]:
    """One command: the new session and the command's output (None for calls that return
    nothing; block lists as ids per group). A refused command raises a `ManagerError` (or a
    pool error) and changes nothing."""
    if isinstance(command, NewManager):
        return Session(new_manager(command.config), command.hashing), None
    if session is None:
        raise BadConfig(f"{command} before the manager is built")
    state = session.manager
    bs = state.config.hash_block_size
    c = command
    if isinstance(c, AddRequest):
        request = Request(c.request_id, tuple(c.prompt), lora=c.lora, salt=c.salt,
                          retention=tuple(c.retention))
        session = replace(session, hits=_drop(session.hits, c.request_id))  # type: ignore[arg-type]
        return _with_request(session, extend_block_hashes(session.hashing, bs, request)), None
    if isinstance(c, AppendTokens):
        request = session.request(c.request_id)
        request = replace(request, output=request.output + tuple(c.token_ids))
        return _with_request(session, extend_block_hashes(session.hashing, bs, request)), None
    if isinstance(c, SetComputedTokens):
        request = replace(session.request(c.request_id), num_computed_tokens=c.num_tokens)
        return _with_request(session, request), None
    if isinstance(c, GetComputedBlocks):
        view = session.request(c.request_id).view()
        found_hits, num_hit = get_computed_blocks(state, view)
        lookups = _put(session.hits, c.request_id, found_hits)
        session = replace(session, hits=lookups)  # type: ignore[arg-type]
        if state.config.profile.reports_uncached_shared_prefix:
            return session, (found_hits, num_hit, shared_prefix_boundary(state, view))
        return session, (found_hits, num_hit)
    if isinstance(c, AllocateSlots):
        view = session.request(c.request_id).view()
        hits: GroupBlocks | None = None
        if c.with_hits:
            found = _lookup(session.hits, c.hits_of or c.request_id)
            if found is None:
                raise UnknownRequest(f"no lookup result for request "
                                     f"{c.hits_of or c.request_id!r}")
            hits = found  # type: ignore[assignment]
        state, new = allocate_slots(state, view, c.num_new_tokens, c.num_new_computed_tokens,
                                    hits, c.num_lookahead_tokens, c.delay_cache_blocks,
                                    c.num_encoder_tokens)
        return replace(session, manager=state), new
    if isinstance(c, Free):
        return replace(session, manager=free(state, c.request_id)), None
    if isinstance(c, CacheBlocks):
        state = cache_blocks(state, session.request(c.request_id).view(), c.num_tokens)
        return replace(session, manager=state), None
    if isinstance(c, EvictBlocks):
        pool = P.evict_blocks(state.pool, set(c.block_ids))
        return replace(session, manager=replace(state, pool=pool)), None
    if isinstance(c, GetNumCommonPrefixBlocks):
        return session, get_num_common_prefix_blocks(state, c.request_id)
    if isinstance(c, GetBlockIds):
        return session, get_blocks(state, c.request_id)
    if isinstance(c, ResetPrefixCache):
        state, done = reset_prefix_cache(state)
        return replace(session, manager=state), done
    if isinstance(c, TakeEvents):
        state, events = take_events(state)
        return replace(session, manager=state), events
    if isinstance(c, Usage):
        return session, usage(state)
    if isinstance(c, NewStep):
        return replace(session, manager=new_step(state)), None
    if isinstance(c, PopBlocksForFree):
        state, popped = pop_blocks_for_free(state, c.request_id)
        return replace(session, manager=state), popped
    if isinstance(c, DrainDeferredFrees):
        return replace(session, manager=drain_deferred_frees(state)), None
    if isinstance(c, P.POLICY_COMMANDS):
        pool, _ = P.step(state.pool, c)
        return replace(session, manager=replace(state, pool=pool)), None
    raise BadConfig(f"not a manager command: {command!r}")
