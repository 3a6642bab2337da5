"""The block pool, as an executable model of vLLM 0.13's vllm/v1/core/block_pool.py.

State is one immutable value, `PoolState`; every operation is a small pure function that
returns the new state and its outputs. Read each operation beside vLLM's `BlockPool` method
of the same name: the model says *what* happens, never how fast. Invariants live in
`spec.pool_invariants`.

Block 0 is the null block: it is never free, never keyed, and its ref count is not modelled.
A key is a `BlockHashWithGroupId`: the block hash followed by the 4-byte big-endian group id.

Events may be bounded (`new_pool(max_pending_events=...)`, off by default as in vLLM): after
an operation that emits events, when more than the bound are pending (emitted, not yet taken)
and at least twice as many as a snapshot of the cache would take, the pending events are
replaced by that snapshot: `Cleared`, then one `Stored` per keyed block in block id order
(`_bound_events`). A consumer that replays every event it takes still ends with exactly the
keyed blocks' hashes (`pool_invariants.events_replay_to_cached_keys`), and at most
max(bound, 2 x keyed blocks + 1) events are ever pending (`pending_events_within_bound`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from enum import Enum

from kvspec.spec import eviction as E
from kvspec.spec.eviction import Policy, PolicyName, Retention, TokenRangeRetention

BlockId = int
Key = bytes
NULL_BLOCK: BlockId = 0


class Profile(Enum):
    """Which vLLM release's observable behaviour the model follows.

    Each observable difference is a parameter (a property below) that the operations read;
    the operations themselves are shared.
    """

    V0_13 = "vllm-0.13"  # the release impl/ mirrors
    V0_33 = "vllm-0.33"

    @property
    def default_policy(self) -> Policy:
        """The release's eviction policy (`spec.eviction`): 0.13 reuses the least recently
        freed block; 0.33 first reuses blocks freed without a key (``lru-lifo-unhashed``)."""
        name = PolicyName.LRU if self is Profile.V0_13 else PolicyName.LRU_LIFO_UNHASHED
        return Policy(name)

    @property
    def stored_event_when_nothing_keyed(self) -> bool:
        """cache_full_blocks over a range of only null blocks still emits a Stored event,
        with no hashes (0.33 builds the event for every call that has a range to cache)."""
        return self is Profile.V0_33

    # vLLM 0.33's block_pool.py, each difference one parameter (the operations are shared):

    @property
    def touch_is_flat(self) -> bool:
        """``touch`` takes a flat sequence of blocks and skips the null block (0.33); 0.13's
        takes a tuple of per-group lists and raises the null block's (unmodelled) ref count.
        The blocks touched are the same (`touch`, `touch_groups`): the shape is the API's."""
        return self is Profile.V0_33

    @property
    def free_skips_null_block(self) -> bool:
        """``free_blocks`` skips the null block (0.33); 0.13 lowers its ref count, which is
        not maintained: the same observable state (ref[NULL_BLOCK] stays 0 in the model)."""
        return self is Profile.V0_33

    @property
    def multi_key_blocks(self) -> bool:
        """A block holds a primary key plus partial entries (``cache_partial_block``),
        promoted to a full key by ``cache_full_blocks``, re-pointed by
        ``move_block_hashes``; removing a block's keys removes all of them (0.33)."""
        return self is Profile.V0_33

    @property
    def reuse_watchers(self) -> bool:
        """``unpin_blocks(blocks, on_reuse)``: released blocks stay readable on the free
        queue until reused or reset, when their watcher fires (0.33)."""
        return self is Profile.V0_33

    @property
    def forwards_foreign_frees(self) -> bool:
        """``free_blocks`` hands a block owned by another pool (``KVCacheBlock.pool``) to
        that pool, one batch per owner (0.33)."""
        return self is Profile.V0_33

    @property
    def reports_reused_blocks(self) -> bool:
        """``emit_cached_block_events``: a Stored event for blocks reused from the prefix
        cache (``kv_cache_report_mode="full"``), and ``is_block_writable`` (0.33)."""
        return self is Profile.V0_33

    @property
    def refusal_frees_skipped_blocks(self) -> bool:
        """allocate_slots, short of free blocks, still frees the request's blocks that have
        left the attention window before it returns None (spec.manager.allocate_slots, stage
        1 before the refusal). Both releases run ``remove_skipped_blocks`` ahead of the
        capacity check (kv_cache_manager.py: 0.13's "We can do this even if we cannot
        schedule this request"; 0.33 frees on the processed-token basis, which equals
        ``num_computed_tokens`` without async steps in flight): those blocks are dead whether
        or not the allocation goes ahead. 0.33's admission gate (``full_sequence_must_fit``)
        refuses before that stage, freeing nothing; the manager model has 0.13's parameters
        and no such gate."""
        return self in (Profile.V0_13, Profile.V0_33)

    # vLLM 0.33's kv_cache_manager.py and kv_cache_coordinator.py (the manager model):

    @property
    def cascade_prefix_removed(self) -> bool:
        """``get_num_common_prefix_blocks`` answers 0 for every group: cascade attention was
        removed and the method kept for out-of-tree schedulers (0.33's kv_cache_manager.py)."""
        return self is Profile.V0_33

    @property
    def reports_uncached_shared_prefix(self) -> bool:
        """``get_computed_blocks`` also returns the shared-prefix boundary: where the longest
        single-type hit ends when a later type cut the reconciled hit shorter, else 0 (0.33's
        ``num_uncached_common_prefix_tokens``, kv_cache_coordinator.py)."""
        return self is Profile.V0_33

    @property
    def caches_to_scheduler_block(self) -> bool:
        """A hybrid model's ``cache_blocks`` first rounds the computed tokens down to the
        scheduler block (0.33's ``get_num_cacheable_tokens``): a group of smaller blocks keys
        only what a future hit, which is scheduler-block aligned, can use."""
        return self is Profile.V0_33

    @property
    def mamba_align_mode(self) -> bool:
        """A prefix-cached Mamba group runs in ``mamba_cache_mode="align"`` (0.33 refuses
        prefix caching in any other mode): its table is null-padded, it gains one state
        block per step, frees the state block two steps back, and refuses a hit on a key
        cached in the same step until ``new_step_starts``."""
        return self is Profile.V0_33

    # The offload tier (`spec.offload`): vLLM 0.13's vllm/v1/kv_offload/{lru,arc}_manager.py
    # against 0.33's cpu/manager.py and cpu/policies/{lru,arc}.py.

    @property
    def offload_recency_from_requests(self) -> bool:
        """The offload manager learns recency per request (0.33): loads and stores record
        the keys a request saw, and ``on_request_finished`` commits them (the LRU moves them
        to the most recent end; ARC promotes the keys the request reused to T2). 0.13 has
        no request context: only ``touch`` and insertion order move keys."""
        return self is Profile.V0_33

    @property
    def arc_adapts_on_store_miss(self) -> bool:
        """ARC moves its target T1 size on a ghost key offered for storing, once per
        request and key, before it evicts (0.33's ``on_store_miss``); 0.13 adapts on
        ``touch`` only (both do on ``touch``)."""
        return self is Profile.V0_33

    @property
    def failed_store_announced(self) -> bool:
        """A failed store emits a metadata-only removal (0.33), filtered when taken to the
        keys still absent; 0.13 drops the keys silently (they were never announced)."""
        return self is Profile.V0_33

    @property
    def offload_has_reset(self) -> bool:
        """``reset_cache`` clears the tier and starts a new generation (0.33 only)."""
        return self is Profile.V0_33


# --- Events (vllm/distributed/kv_events.py). Hashes are external: the low 64 bits, as ints. ---


@dataclass(frozen=True)
class Stored:
    hashes: tuple[int, ...]
    parent: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None


@dataclass(frozen=True)
class Removed:
    hashes: tuple[int, ...]


@dataclass(frozen=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


# --- Errors: every bad input is refused before anything changes. -------------------------------


class PoolError(Exception):
    """A call the pool must refuse."""


class OutOfPool(PoolError, LookupError):
    """A block id that is not in the pool."""


class NotInUse(PoolError, ValueError):
    """Freeing a block whose ref count is already 0."""


class NotEnoughFree(PoolError, ValueError):
    """Asking for more blocks than are free, or for a negative number."""


class AlreadyCached(PoolError, ValueError):
    """Keying a block that already has a key."""


class BadHash(PoolError, ValueError):
    """A block hash or group id that cannot form a key."""


class BadConfig(PoolError, ValueError):
    """A pool that cannot be built (a bound on pending events below 1)."""


class NotSupported(PoolError, ValueError):
    """A policy operation the pool's eviction policy does not have (a pin under ``lru``)."""


class NotCached(PoolError, LookupError):
    """A retention priority or a pin for a block without a key."""


class BadRetention(PoolError, ValueError):
    """A retention hint or priority that cannot be honoured (out of [0, 100], ...)."""


class ClockWentBack(PoolError, ValueError):
    """advance_clock to a time before the pool's."""


class PinRefused(PoolError, ValueError):
    """A pin beyond the cap, a block pinned twice, or evicting or freeing what a pin holds."""


class NotPinned(PoolError, LookupError):
    """Unpinning a block that is not pinned."""


class NullBlock(PoolError, ValueError):
    """An operation the null block cannot take part in (unpinning it, keying it)."""


class UnknownCommand(PoolError, ValueError):
    """A command that is none of the pool's (`PoolCommand`)."""


# --- State -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PoolState:
    num_blocks: int
    enable_caching: bool
    enable_events: bool
    profile: Profile
    ref: tuple[int, ...]  # per block; ref[NULL_BLOCK] stays 0
    free: tuple[BlockId, ...]  # the free order: head (next to reuse) first
    key_of: tuple[Key | None, ...]  # per block
    cached: tuple[tuple[Key, tuple[BlockId, ...]], ...]  # key -> blocks, first inserted first
    events: tuple[Event, ...] = ()  # every event emitted so far
    num_taken: int = 0  # how many of them take_events has handed out
    max_pending_events: int | None = None  # the bound on pending events; None: unbounded
    num_collapses: int = 0  # how often the pending events were replaced by a snapshot
    # Each group's block size, as the last Stored event of the group carried it: what a
    # snapshot's Stored events say (a group has one block size; the pool keeps no other).
    group_block_sizes: tuple[tuple[int, int], ...] = ()
    # The eviction policy (spec.eviction) and what it keeps: the time, the cached blocks'
    # retention priorities that are not the default, the pinned blocks (sorted).
    policy: Policy = Policy()  # noqa: RUF009 (frozen: one shared default is safe)
    now: int = 0
    retention: Retention = ()
    pinned: tuple[BlockId, ...] = ()
    # vLLM 0.33 (`Profile.multi_key_blocks`, `reuse_watchers`, ...); empty under 0.13.
    # A block's partial entries beside its primary key (``cached_block_hashes_by_block``),
    # in the order they were added: vLLM keeps them in a set, whose walk the model repeats.
    partial_keys: tuple[tuple[BlockId, tuple[Key, ...]], ...] = ()
    # The prefix length (tokens) a block's primary key covers (``block_hash_num_tokens``).
    key_tokens: tuple[tuple[BlockId, int], ...] = ()
    # Pending reuse watchers: block -> watcher ids, blocks in the order first watched (a
    # dict's order), and every firing so far: (watcher id, block).
    watchers: tuple[tuple[BlockId, tuple[int, ...]], ...] = ()
    fired: tuple[tuple[int, BlockId], ...] = ()
    next_watcher: int = 0
    # Blocks of a foreign owner that free_blocks handed to it, one batch per call.
    forwarded: tuple[tuple[BlockId, ...], ...] = ()
    # The indices (into events) of Stored events that report reused blocks
    # (emit_cached_block_events): a re-announcement, not a new copy.
    reported: tuple[int, ...] = ()


def new_pool(
    num_blocks: int,
    enable_caching: bool = True,
    enable_events: bool = False,
    profile: Profile = Profile.V0_13,
    max_pending_events: int | None = None,
    policy: Policy | None = None,
) -> PoolState:
    """A fresh pool: the null block taken, every other block free in id order. The eviction
    policy is the profile's unless given.

    pre: 1 <= num_blocks <= 64
    raises: PoolError
    post: __return__.free == tuple(range(1, num_blocks))
    """
    if num_blocks < 1:
        raise NotEnoughFree(f"a pool needs at least 1 block, got num_blocks={num_blocks}")
    if max_pending_events is not None and max_pending_events < 1:
        raise BadConfig(f"the bound on pending events must be >= 1, got {max_pending_events}")
    policy = profile.default_policy if policy is None else policy
    if not 0.0 <= policy.max_pinned_share <= 1.0:
        raise BadConfig(f"max_pinned_share must be in [0, 1], got {policy.max_pinned_share}")
    return PoolState(
        num_blocks, enable_caching, enable_events, profile,
        ref=(0,) * num_blocks, free=tuple(range(1, num_blocks)),
        key_of=(None,) * num_blocks, cached=(), max_pending_events=max_pending_events,
        policy=policy,
    )


def make_key(block_hash: bytes, group_id: int) -> Key:
    """The map key of a block hash in one KV-cache group (vllm/v1/core/kv_cache_utils.py).

    pre: 0 <= group_id < 2 ** 32
    raises: BadHash
    post: __return__[:-4] == block_hash
    post: int.from_bytes(__return__[-4:], "big") == group_id
    """
    if not isinstance(block_hash, bytes) or not block_hash:
        raise BadHash(f"a block hash must be non-empty bytes, got {block_hash!r}")
    if not 0 <= group_id < 2**32:
        raise BadHash(f"group id must be in [0, 2**32), got {group_id}")
    return block_hash + group_id.to_bytes(4, "big")


def external_hash(key: Key) -> int:
    """The hash an event carries for a key: its block hash's low 64 bits."""
    return int.from_bytes(key[:-4], "big") & (2**64 - 1)


# --- Small pure helpers ------------------------------------------------------------------------


def _set(values: tuple[int, ...], index: int, value: int) -> tuple[int, ...]:
    return values[:index] + (value,) + values[index + 1 :]


def _set_key(keys: tuple[Key | None, ...], index: int, key: Key | None) -> tuple[Key | None, ...]:
    return keys[:index] + (key,) + keys[index + 1 :]


def _blocks_under(state: PoolState, key: Key) -> tuple[BlockId, ...]:
    return dict(state.cached).get(key, ())


def _with_blocks_under(state: PoolState, key: Key, blocks: tuple[BlockId, ...]) -> PoolState:
    others = {k: v for k, v in state.cached if k != key}
    if blocks:
        others[key] = blocks
    return replace(state, cached=tuple(sorted(others.items())))


def _emit(state: PoolState, event: Event) -> PoolState:
    return replace(state, events=state.events + (event,)) if state.enable_events else state


def _bound_events(state: PoolState) -> PoolState:
    """Collapse the pending events into a snapshot of the cache when the bound says so.

    After an operation that emits: more than ``max_pending_events`` pending, and at least
    twice as many as the snapshot (so that collapsing halves them at least: a consumer that
    never takes events costs O(1) amortised per event, not a snapshot per event). The
    snapshot is `Cleared`, then one `Stored` per key (the blocks' primary keys in block id
    order, then vLLM 0.33's partial entries by block id, each block's in key order), carrying the
    key's hash, no parent, no token ids, the group's block size and no LoRA: the pool keeps
    no more about a cached block.
    """
    bound = state.max_pending_events
    pending = len(state.events) - state.num_taken
    if bound is None or pending <= bound:
        return state
    keyed = [(b, key) for b, key in enumerate(state.key_of) if key is not None] + [
        (b, key) for b, keys in state.partial_keys for key in sorted(keys)]
    if pending < 2 * (len(keyed) + 1):
        return state
    # A key's group always has a size: a key is set with its Stored event, which records it
    # (a full block's and a partial entry's alike; the 0 keeps this total over the arbitrary
    # states CrossHair tries).
    sizes = dict(state.group_block_sizes)
    snapshot: tuple[Event, ...] = (Cleared(),) + tuple(
        Stored((external_hash(key),), None, (), sizes.get(int.from_bytes(key[-4:], "big"), 0),
               None)
        for _, key in keyed)
    return replace(state, events=state.events[:state.num_taken] + snapshot,
                   num_collapses=state.num_collapses + 1,
                   reported=tuple(i for i in state.reported if i < state.num_taken))


def _check_ids(state: PoolState, blocks: Iterable[BlockId]) -> None:
    for block in blocks:
        if not (isinstance(block, int) and 0 <= block < state.num_blocks):
            raise OutOfPool(f"block {block!r} is not in this pool of {state.num_blocks} blocks")


def _uncache(state: PoolState, block: BlockId, emit: bool = True,
             ) -> tuple[PoolState, tuple[Key, ...]]:
    """Drop every key of a block, if it has any, from the block and from the map (vLLM's
    eviction, ``_remove_cached_block_hashes``): the primary key, then its partial entries
    in the order vLLM's set walks them, one Removed event per key (none when not ``emit``:
    move_block_hashes). The keys removed, in that order."""
    key = state.key_of[block]
    if key is None:
        return state, ()
    keys = (key,) + _walk_set(partials_of(state, block))
    for removed in keys:
        remaining = tuple(b for b in _blocks_under(state, removed) if b != block)
        state = _with_blocks_under(state, removed, remaining)
    # A retention priority is the cached content's: it goes with the key.
    state = replace(state, key_of=_set_key(state.key_of, block, None),
                    retention=tuple(e for e in state.retention if e[0] != block))
    if state.partial_keys or state.key_tokens:
        state = replace(state,
                        partial_keys=tuple(e for e in state.partial_keys if e[0] != block),
                        key_tokens=tuple(e for e in state.key_tokens if e[0] != block))
    if emit:
        for removed in keys:
            state = _emit(state, Removed((external_hash(removed),)))
    return state, keys


def _walk_set(keys: tuple[Key, ...]) -> tuple[Key, ...]:
    """The order in which a set built by adding keys one by one, in this order, is walked:
    vLLM keeps a block's partial entries in a set (``cached_block_hashes_by_block``) and
    removes (and re-points) them in its iteration order, which the model repeats (within one
    process it depends only on the keys and the order they were added)."""
    if len(keys) < 2:
        return keys
    walked: set[Key] = set()
    for key in keys:
        walked.add(key)
    return tuple(walked)


def partials_of(state: PoolState, block: BlockId) -> tuple[Key, ...]:
    for owner, keys in state.partial_keys:
        if owner == block:
            return keys
    return ()


def keys_of(state: PoolState, block: BlockId) -> tuple[Key, ...]:
    """Every key a block holds: its primary key, then its partial entries (0.33)."""
    key = state.key_of[block]
    return () if key is None else (key,) + partials_of(state, block)


def key_tokens_of(state: PoolState, block: BlockId) -> int | None:
    """The prefix length a block's primary key covers (None: no key, or a 0.13 key)."""
    return dict(state.key_tokens).get(block)


def _insert_key(state: PoolState, key: Key, block: BlockId, num_tokens: int | None,
                ) -> PoolState:
    """vLLM 0.33's ``_insert_block_hash``: a key the block already holds changes nothing;
    a block without a key takes it as its primary key (covering num_tokens), else as a
    partial entry; the map lists the block under the key, last."""
    if state.key_of[block] == key or block in _blocks_under(state, key):
        return state
    if state.key_of[block] is None:
        state = replace(state, key_of=_set_key(state.key_of, block, key))
        if num_tokens is not None:
            state = replace(state, key_tokens=tuple(sorted(
                tuple(e for e in state.key_tokens if e[0] != block) + ((block, num_tokens),))))
    else:
        others = tuple(e for e in state.partial_keys if e[0] != block)
        entry = (block, partials_of(state, block) + (key,))
        state = replace(state, partial_keys=tuple(sorted(others + (entry,))))
    return _with_blocks_under(state, key, _blocks_under(state, key) + (block,))


def _keyed(state: PoolState) -> frozenset[BlockId]:
    return frozenset(b for b, key in enumerate(state.key_of) if key is not None)


def eviction_order(state: PoolState) -> tuple[BlockId, ...]:
    """The free blocks in the order get_new_blocks takes them (the policy's choice)."""
    return E.eviction_order(state.policy, state.free, _keyed(state), state.retention)


# --- Operations --------------------------------------------------------------------------------


def get_new_blocks(state: PoolState, n: int) -> tuple[PoolState, tuple[BlockId, ...]]:
    """Take the first n blocks of the policy's eviction order (the free order's head, but
    under ``priority``), evict their keys, ref 0 -> 1.

    pre: len(state.ref) == len(state.key_of) == state.num_blocks
    pre: all(0 < b < state.num_blocks for b in state.free)
    pre: all(E.MIN_PRIORITY <= p <= E.MAX_PRIORITY for _, p, _ in state.retention)
    raises: PoolError
    post: __return__[1] == eviction_order(state)[:n]
    post: state.policy.has_priorities or __return__[1] == state.free[:n]
    post: all(__return__[0].ref[b] == 1 and __return__[0].key_of[b] is None for b in __return__[1])
    """
    if not 0 <= n <= len(state.free):
        raise NotEnoughFree(f"Cannot get {n} free blocks from the pool ({len(state.free)} free)")
    taken = eviction_order(state)[:n]
    state = replace(state, free=tuple(b for b in state.free if b not in taken))
    if state.watchers:  # a block still read by a watcher is handed out: tell it first
        state = _fire_watchers(state, taken)
    for block in taken:
        state = _uncache(state, block)[0]
        state = replace(state, ref=_set(state.ref, block, 1))
    return _bound_events(state), taken


def free_blocks(state: PoolState, blocks: Sequence[BlockId]) -> PoolState:
    """Ref - 1 for each block; the blocks that reach 0 join the free order (null skipped).

    Where they go is the policy's (`spec.eviction.place_freed`): ``lru`` (vllm-0.13)
    appends them all to the tail, in the order they reached 0 (callers pass a request's
    blocks reversed, so its chain tail is evicted first); ``lru-lifo-unhashed`` (vllm-0.33)
    puts the unkeyed ones at the head instead (kept in that order). A pinned block keeps the
    reference its pin holds: freeing that one is refused.

    pre: len(state.ref) == len(state.key_of) == state.num_blocks
    raises: PoolError
    post: len(__return__.free) >= len(state.free)
    """
    _check_ids(state, blocks)
    ref = state.ref
    zeroed: tuple[BlockId, ...] = ()
    for block in blocks:
        if block == NULL_BLOCK:
            continue
        if ref[block] == 0:
            raise NotInUse(f"block {block} is freed with ref count 0")
        if ref[block] == 1 and block in state.pinned:
            raise PinRefused(f"block {block} is held only by its pin: unpin it instead")
        ref = _set(ref, block, ref[block] - 1)
        if ref[block] == 0:
            zeroed += (block,)
    return _released(replace(state, ref=ref), zeroed)


def _released(state: PoolState, zeroed: tuple[BlockId, ...]) -> PoolState:
    """Blocks that just reached ref 0 join the free order where the policy puts them."""
    unkeyed = frozenset(b for b in zeroed if state.key_of[b] is None or not state.enable_caching)
    return replace(state, free=E.place_freed(state.policy, state.free, zeroed, unkeyed))


def touch(state: PoolState, blocks: Sequence[BlockId]) -> PoolState:
    """A cache hit: a free block leaves the free order; ref + 1 (null skipped).

    pre: len(state.ref) == len(state.key_of) == state.num_blocks
    raises: PoolError
    post: len(__return__.free) <= len(state.free)
    """
    _check_ids(state, blocks)
    for block in blocks:
        if block == NULL_BLOCK:
            continue
        free = tuple(b for b in state.free if b != block)
        state = replace(state, free=free, ref=_set(state.ref, block, state.ref[block] + 1))
    return state


def cache_full_blocks(
    state: PoolState,
    blocks: Sequence[BlockId],
    block_hashes: Sequence[bytes],
    num_cached: int,
    num_full: int,
    group_id: int,
    token_ids: Sequence[int] = (),
    block_size: int = 1,
    lora_id: int | None = None,
    retention: Sequence[TokenRangeRetention] = (),
) -> PoolState:
    """Key blocks[num_cached:num_full] with their chain hashes in one group (null skipped).

    Under ``priority``, each newly keyed block i takes the retention priority of the
    request's hint that covers it (`spec.eviction.block_retention`; block i holds tokens
    [i * block_size, (i + 1) * block_size)), expiring ``duration`` after now; a malformed
    hint is refused. Other policies do not read the hints.

    One Stored event covers the newly keyed blocks; its parent is the request's hash before
    them (even when that block is null). Nothing happens when num_cached >= num_full or when
    caching is off (the range and its blocks are still checked); a range of only null blocks
    emits an empty Stored event under vllm-0.33
    (`Profile.stored_event_when_nothing_keyed`) and nothing under vllm-0.13.

    pre: len(state.ref) == len(state.key_of) == state.num_blocks
    pre: 0 <= group_id < 2 ** 32
    raises: PoolError
    """
    if num_cached < 0 or num_full < 0:
        raise BadHash(f"cannot cache blocks [{num_cached}, {num_full}): a negative index")
    if num_cached >= num_full:
        return state
    if num_full > len(blocks):
        raise BadHash(f"cannot cache blocks [{num_cached}, {num_full}) of {len(blocks)} blocks")
    _check_ids(state, blocks[num_cached:num_full])
    if not state.enable_caching:  # the blocks are checked all the same: bad input is refused
        return state
    if num_full > len(block_hashes):
        raise BadHash(
            f"cannot cache blocks [{num_cached}, {num_full}) with {len(block_hashes)} hashes")
    new = [(b, make_key(h, group_id)) for b, h in
           zip(blocks[num_cached:num_full], block_hashes[num_cached:num_full], strict=True)
           if b != NULL_BLOCK]
    # The prefix length each new block's key covers (0.33 records it: promotion reads it).
    tokens = {b: (i + 1) * block_size for i, b in enumerate(blocks[:num_full])
              if i >= num_cached and b != NULL_BLOCK} if state.profile.multi_key_blocks else {}
    for block, _ in new:
        if state.key_of[block] is not None and not (
                tokens and promotable(state, block, tokens[block])):
            raise AlreadyCached(f"block {block} already has a key")
    if len({b for b, _ in new}) != len(new):
        raise AlreadyCached(f"a block appears twice in {[b for b, _ in new]}")
    if new and state.policy.has_priorities:
        for hint in retention:
            try:
                E.check_hint(hint)
            except ValueError as error:
                raise BadRetention(str(error)) from None
    if state.profile.multi_key_blocks:
        for block, key in new:
            # A partial entry's block becomes full: its keys go (one Removed each) and the
            # full key takes their place.
            state = _uncache(state, block)[0]
            state = _insert_key(state, key, block, tokens[block])
    else:
        for block, key in new:
            state = replace(state, key_of=_set_key(state.key_of, block, key))
            state = _with_blocks_under(state, key, _blocks_under(state, key) + (block,))
    if state.policy.has_priorities and retention:
        for index in range(num_cached, num_full):
            covering = E.block_retention(retention, index, block_size)
            if covering is not None and blocks[index] != NULL_BLOCK:
                state = _set_retention(state, blocks[index], covering.priority,
                                       covering.duration)
    if not new and not state.profile.stored_event_when_nothing_keyed:
        return state
    parent = make_key(block_hashes[num_cached - 1], group_id) if num_cached > 0 else None
    state = _emit(state, Stored(
        hashes=tuple(external_hash(k) for _, k in new),
        parent=None if parent is None else external_hash(parent),
        token_ids=tuple(token_ids), block_size=block_size, lora_id=lora_id,
    ))
    if state.enable_events:
        state = _record_block_size(state, group_id, block_size)
    return _bound_events(state)


def _record_block_size(state: PoolState, group_id: int, block_size: int) -> PoolState:
    """The group's block size from now on, as a snapshot's `Stored` gives it."""
    sizes = dict(state.group_block_sizes)
    sizes[group_id] = block_size
    return replace(state, group_block_sizes=tuple(sorted(sizes.items())))


def promotable(state: PoolState, block: BlockId, num_tokens: int) -> bool:
    """A keyed block whose key covers a shorter prefix than num_tokens may be keyed again
    (0.33: a partial entry promoted to a full key); never under 0.13."""
    covered = key_tokens_of(state, block) if state.profile.multi_key_blocks else None
    return covered is not None and covered < num_tokens


def get_cached_block(
    state: PoolState, block_hash: bytes, group_ids: Sequence[int]
) -> tuple[BlockId, ...] | None:
    """The first block keyed with block_hash in each group, or None if any group misses.

    pre: all(0 <= g < 2 ** 32 for g in group_ids)
    raises: BadHash
    post: __return__ is None or len(__return__) == len(group_ids)
    """
    found = []
    for group_id in group_ids:
        blocks = _blocks_under(state, make_key(block_hash, group_id))
        if not blocks:
            return None
        found.append(blocks[0])
    return tuple(found)


def evict_blocks(state: PoolState, block_ids: Iterable[BlockId]) -> PoolState:
    """Drop the keys of the given blocks; ref counts and free order stay.

    Keys go (and Removed events come) in the order block_ids iterates: vLLM takes a set
    and walks it, so for a set that is the set's own iteration order, not ascending ids.

    pre: len(state.ref) == len(state.key_of) == state.num_blocks
    raises: PoolError
    post: __return__.free == state.free and __return__.ref == state.ref
    """
    ids = list(dict.fromkeys(block_ids))
    _check_ids(state, ids)
    for block in ids:
        if block in state.pinned:
            raise PinRefused(f"block {block} is pinned: unpin it before evicting it")
    for block in ids:
        state = _uncache(state, block)[0]
    return _bound_events(state)


def reset_prefix_cache(state: PoolState) -> tuple[PoolState, bool]:
    """Forget every key, only when no block but the null block is in use; else change nothing.

    post: __return__[1] == (len(state.free) == state.num_blocks - 1)
    post: __return__[1] or __return__[0] == state
    """
    if len(state.free) != state.num_blocks - 1:
        return state, False
    state = replace(state, key_of=(None,) * state.num_blocks, cached=(), retention=(),
                    partial_keys=(), key_tokens=())
    if state.watchers:  # a reset ends every read of a released block
        state = _fire_watchers(state, tuple(b for b, _ in state.watchers))
    return _bound_events(_emit(state, Cleared())), True


# --- Policy operations (spec.eviction) ---------------------------------------------------------


def _require(state: PoolState, has: bool, what: str) -> None:
    if not has:
        raise NotSupported(f"the pool's eviction policy {state.policy.name.value!r} has no "
                           f"{what}")


def _set_retention(state: PoolState, block: BlockId, priority: int,
                   duration: int | None) -> PoolState:
    """Block's retention: the default priority forever is the absence of an entry."""
    others = tuple(e for e in state.retention if e[0] != block)
    if priority == E.DEFAULT_PRIORITY and duration is None:
        return replace(state, retention=others)
    expires = None if duration is None else state.now + duration
    return replace(state, retention=tuple(sorted(others + ((block, priority, expires),))))


def set_retention(state: PoolState, blocks: Sequence[BlockId], priority: int,
                  duration: int | None = None) -> PoolState:
    """Give cached blocks a retention priority (``priority`` policy), expiring ``duration``
    after now (None: until the block is evicted); null blocks skipped.

    pre: len(state.ref) == len(state.key_of) == state.num_blocks
    raises: PoolError
    post: all(E.effective_priority(__return__.retention, True, b) == priority for b in blocks if b)
    """
    _require(state, state.policy.has_priorities, "retention priorities")
    try:
        E.check_hint(TokenRangeRetention(0, None, priority, duration))
    except ValueError as error:
        raise BadRetention(str(error)) from None
    _check_ids(state, blocks)
    for block in blocks:
        if block != NULL_BLOCK and state.key_of[block] is None:
            raise NotCached(f"block {block} has no key: only a cached block has a retention "
                            f"priority")
    for block in blocks:
        if block != NULL_BLOCK:
            state = _set_retention(state, block, priority, duration)
    return state


def advance_clock(state: PoolState, now: int) -> PoolState:
    """Time moves to ``now``: every priority whose expiry has come reverts to the default.

    raises: PoolError
    post: __return__.now == now
    post: all(expires is None or expires > now for _, _, expires in __return__.retention)
    """
    if type(now) is not int or now < state.now:
        raise ClockWentBack(f"the clock is at {state.now}; it cannot go to {now!r}")
    return replace(state, now=now, retention=E.expire(state.retention, now))


def pin_blocks(state: PoolState, blocks: Sequence[BlockId]) -> PoolState:
    """Pin cached blocks (``pinned`` policy): each pin holds a reference, so a pinned block
    is never free, never evicted. Refused beyond the cap (`spec.eviction.pin_cap`).

    pre: 1 <= len(state.ref) == len(state.key_of) == state.num_blocks <= 2 ** 20
    pre: 0.0 <= state.policy.max_pinned_share <= 1.0
    raises: PoolError
    post: set(blocks) <= set(__return__.pinned)
    post: len(__return__.pinned) <= E.pin_cap(state.policy, state.num_blocks)
    """
    _require(state, state.policy.has_pins, "pins")
    _check_ids(state, blocks)
    if len(set(blocks)) != len(blocks):
        raise PinRefused(f"a block is listed twice in {list(blocks)}")
    for block in blocks:
        if block in state.pinned:
            raise PinRefused(f"block {block} is already pinned")
        if block == NULL_BLOCK or state.key_of[block] is None:
            raise NotCached(f"block {block} has no key: only a cached block can be pinned")
    cap = E.pin_cap(state.policy, state.num_blocks)
    if len(state.pinned) + len(blocks) > cap:
        raise PinRefused(f"pinning {len(blocks)} more blocks would pin "
                         f"{len(state.pinned) + len(blocks)}, over the cap of {cap}")
    state = touch(state, blocks)
    return replace(state, pinned=tuple(sorted(state.pinned + tuple(blocks))))


def unpin_blocks(state: PoolState, blocks: Sequence[BlockId]) -> PoolState:
    """Drop pins: each releases the reference it held (a block reaching ref 0 joins the
    free order as a freed block does).

    pre: len(state.ref) == len(state.key_of) == state.num_blocks
    raises: PoolError
    post: not set(blocks) & set(__return__.pinned)
    """
    _require(state, state.policy.has_pins, "pins")
    _check_ids(state, blocks)
    if len(set(blocks)) != len(blocks):
        raise PinRefused(f"a block is listed twice in {list(blocks)}")
    for block in blocks:
        if block not in state.pinned:
            raise NotPinned(f"block {block} is not pinned")
    state = replace(state, pinned=tuple(b for b in state.pinned if b not in blocks))
    return free_blocks(state, blocks)


def num_free(state: PoolState) -> int:
    """How many blocks are free (cached ones included)."""
    return len(state.free)


def usage(state: PoolState) -> float:
    """The fraction of the non-null blocks in use; 0 for a pool of only the null block.

    pre: len(state.free) < state.num_blocks
    post: 0.0 <= __return__ <= 1.0
    """
    if state.num_blocks == 1:
        return 0.0
    return 1.0 - len(state.free) / (state.num_blocks - 1)


def take_events(state: PoolState) -> tuple[PoolState, tuple[Event, ...]]:
    """Hand out the events emitted since the last call.

    post: __return__[0].num_taken == len(state.events)
    """
    return replace(state, num_taken=len(state.events)), state.events[state.num_taken :]


# --- vLLM 0.33's new operations (each behind its `Profile` parameter) -----------------------


def _require_profile(state: PoolState, has: bool, what: str) -> None:
    if not has:
        raise NotSupported(f"the {state.profile.value} pool has no {what}")


def touch_groups(state: PoolState, groups: Sequence[Sequence[BlockId]]) -> PoolState:
    """0.13's ``touch(tuple_of_group_lists)``: the blocks of every group, in order (the null
    block's ref count, which 0.13 raises, is not modelled). 0.33 takes the flat sequence
    (`touch`, `Profile.touch_is_flat`).

    pre: len(state.ref) == len(state.key_of) == state.num_blocks
    raises: PoolError
    post: __return__ == touch(state, [b for group in groups for b in group])
    """
    return touch(state, [b for group in groups for b in group])


def _fire_watchers(state: PoolState, blocks: Iterable[BlockId]) -> PoolState:
    """Every pending watcher of these blocks fires once (in the order registered) and is
    gone: the reader of a released block learns that its contents are no longer there."""
    pending = dict(state.watchers)
    fired = state.fired
    for block in blocks:
        fired += tuple((watcher, block) for watcher in pending.pop(block, ()))
    return replace(state, watchers=tuple(pending.items()), fired=fired)


def unpin_with_watcher(state: PoolState, blocks: Sequence[BlockId]) -> PoolState:
    """vLLM 0.33's ``unpin_blocks(blocks, on_reuse)``: release one reference to each block
    listed (a block listed twice: twice) while a reader still reads it. One watcher (the
    call's ``on_reuse``, numbered ``next_watcher``) is registered on each block; blocks that
    reach ref 0 join the free order's tail whatever their key (last-resort eviction
    candidates) and count as free. The watcher fires when get_new_blocks hands the block out
    or the prefix cache is reset. A block may have several pending watchers (several
    readers): each fires once (`pool_invariants.watchers_fire_at_most_once`).

    pre: len(state.ref) == len(state.key_of) == state.num_blocks
    raises: PoolError
    post: __return__.next_watcher == state.next_watcher + 1
    post: len(__return__.free) >= len(state.free)
    """
    _require_profile(state, state.profile.reuse_watchers, "unpin_blocks(blocks, on_reuse)")
    _check_ids(state, blocks)
    for position, block in enumerate(blocks):
        if block == NULL_BLOCK:
            raise NullBlock("the null block cannot be unpinned")
        if state.ref[block] <= blocks[:position].count(block):
            raise NotInUse(f"block {block} is unpinned with ref count "
                           f"{state.ref[block] - blocks[:position].count(block)}")
    watcher = state.next_watcher
    ref = state.ref
    released: tuple[BlockId, ...] = ()
    pending = dict(state.watchers)
    for block in blocks:
        ref = _set(ref, block, ref[block] - 1)
        if ref[block] == 0:
            released += (block,)
        if watcher not in pending.get(block, ()):
            pending[block] = pending.get(block, ()) + (watcher,)
    return replace(state, ref=ref, free=state.free + released, watchers=tuple(pending.items()),
                   next_watcher=watcher + 1)


def cache_partial_block(
    state: PoolState, block: BlockId, block_hashes: Sequence[bytes], num_tokens: int,
    group_id: int, block_size: int, hash_block_size: int, token_ids: Sequence[int] = (),
    lora_id: int | None = None, replace_existing: bool = False,
) -> tuple[PoolState, Key | None]:
    """vLLM 0.33's ``cache_partial_block``: make a block reachable from the prefix boundary
    at num_tokens (a multiple of hash_block_size) under the request's chain hash there.

    A block without a key takes it as its primary key; a block whose primary key covers a
    shorter prefix loses all its keys first (promotion); otherwise it becomes a partial
    entry beside the primary key. ``replace_existing`` (new contents) removes every key of
    the block first. Removed keys emit one Removed each; a key new to the block emits one
    Stored of the hash-block span ending at num_tokens. The output is the key (None for the
    null block). With caching off it is refused (0.33's callers only call it with caching
    on; the pool itself would key the block).

    pre: len(state.ref) == len(state.key_of) == state.num_blocks
    pre: 0 <= group_id < 2 ** 32
    raises: PoolError
    post: __return__[1] is None or __return__[1] in keys_of(__return__[0], block)
    """
    _require_profile(state, state.profile.multi_key_blocks, "cache_partial_block")
    _check_ids(state, (block,))
    if block == NULL_BLOCK:
        return state, None
    if not state.enable_caching:
        raise NotSupported("cache_partial_block with prefix caching off")
    if hash_block_size < 1 or block_size % hash_block_size:
        raise BadHash(f"block size {block_size} is not a multiple of the hash block size "
                      f"{hash_block_size}")
    if num_tokens <= 0 or num_tokens % hash_block_size or (
            num_tokens // hash_block_size > len(block_hashes)):
        raise BadHash(f"no partial entry at {num_tokens} tokens: not a positive multiple of "
                      f"{hash_block_size} within {len(block_hashes)} hashes")
    num_hash_blocks = num_tokens // hash_block_size
    key = make_key(block_hashes[num_hash_blocks - 1], group_id)
    already = state.key_of[block] == key or block in _blocks_under(state, key)
    covered = key_tokens_of(state, block)
    if replace_existing or (not already and covered is not None and covered < num_tokens):
        state = _uncache(state, block)[0]
        already = False
    state = _insert_key(state, key, block, num_tokens)
    if not already:
        start = num_tokens - hash_block_size
        parent = (external_hash(make_key(block_hashes[num_hash_blocks - 2], group_id))
                  if num_hash_blocks > 1 else None)
        state = _emit(state, Stored((external_hash(key),), parent, tuple(token_ids),
                                    num_tokens - start, lora_id))
        if state.enable_events:
            # The group's block size, for a snapshot's Stored of this key (`_bound_events`):
            # a group whose keys are all partial entries stored no full block to record it.
            state = _record_block_size(state, group_id, block_size)
    return _bound_events(state), key


def move_block_hashes(state: PoolState, src: BlockId, dst: BlockId) -> PoolState:
    """vLLM 0.33's ``move_block_hashes`` (copy-on-write): every key of src moves to dst,
    which must have none (the primary key first, keeping its prefix length; the partial
    entries after it, in the order vLLM's set walks them). The entries stay live: no events.

    pre: len(state.ref) == len(state.key_of) == state.num_blocks
    raises: PoolError
    post: __return__.events == state.events
    post: __return__.key_of[src] is None or src == dst
    """
    _require_profile(state, state.profile.multi_key_blocks, "move_block_hashes")
    _check_ids(state, (src, dst))
    if dst == NULL_BLOCK:
        raise NullBlock("the null block cannot take keys")
    if state.key_of[dst] is not None or partials_of(state, dst):
        raise AlreadyCached(f"block {dst} already has a key")
    num_tokens = key_tokens_of(state, src)
    state, keys = _uncache(state, src, emit=False)
    for index, key in enumerate(keys):
        state = _insert_key(state, key, dst, num_tokens if index == 0 else None)
    return state


def is_block_writable(state: PoolState, block: BlockId) -> bool:
    """vLLM 0.33's ``is_block_writable``: its sole owner may write a block that is not null,
    held once, and has no key (nobody else can reach it).

    pre: len(state.ref) == len(state.key_of) == state.num_blocks
    raises: PoolError
    post: __return__ == (block != 0 and state.ref[block] == 1 and state.key_of[block] is None)
    """
    _require_profile(state, state.profile.reports_reused_blocks, "is_block_writable")
    _check_ids(state, (block,))
    return block != NULL_BLOCK and state.ref[block] == 1 and state.key_of[block] is None


def emit_cached_block_events(
    state: PoolState, block_hashes: Sequence[bytes], num_cached: int, block_size: int,
    group_id: int, token_ids: Sequence[int] = (), lora_id: int | None = None,
) -> PoolState:
    """vLLM 0.33's ``emit_cached_block_events`` (``kv_cache_report_mode="full"``): one
    Stored event for a request's first num_cached blocks, reused from the prefix cache,
    with no parent; nothing else changes. The event re-announces cached copies (its index
    is kept in ``reported``): a consumer counting copies skips it.

    pre: 0 <= group_id < 2 ** 32
    raises: PoolError
    post: __return__.key_of == state.key_of and __return__.free == state.free
    """
    _require_profile(state, state.profile.reports_reused_blocks, "emit_cached_block_events")
    if not 0 <= num_cached <= len(block_hashes):
        raise BadHash(f"cannot report {num_cached} cached blocks of {len(block_hashes)} hashes")
    if not state.enable_events or num_cached == 0:
        return state
    hashes = tuple(external_hash(make_key(h, group_id)) for h in block_hashes[:num_cached])
    state = _emit(state, Stored(hashes, None, tuple(token_ids), block_size, lora_id))
    state = replace(state, reported=state.reported + (len(state.events) - 1,))
    return _bound_events(state)


def free_blocks_forwarding(state: PoolState, blocks: Sequence[BlockId],
                           foreign: Sequence[BlockId]) -> PoolState:
    """vLLM 0.33's ``free_blocks`` over the pool's own blocks and blocks another pool owns
    (``KVCacheBlock.pool``): the own ones are freed here (`free_blocks`), the foreign ones
    handed to their owner's ``free_blocks`` in one batch, in the order listed, after them.
    Nothing of this pool's state reads a foreign block.

    pre: len(state.ref) == len(state.key_of) == state.num_blocks
    raises: PoolError
    post: __return__.forwarded == state.forwarded + ((tuple(foreign),) if foreign else ())
    """
    _require_profile(state, state.profile.forwards_foreign_frees, "frees forwarded to a block's "
                     "owning pool")
    state = free_blocks(state, blocks)
    return replace(state, forwarded=state.forwarded + (tuple(foreign),)) if foreign else state


# --- Operations as data (conformance.lockstep) --------------------------------------------
# One frozen value per call of the pool's public API; `step` is the one semantics function the
# machines, the explorer, the CrossHair program contract and the audit's counterexamples share.


@dataclass(frozen=True)
class NewPool:
    """Build a pool (vLLM's constructor). ``profile`` is the spec's: a target ignores it."""

    num_blocks: int
    enable_caching: bool = True
    enable_events: bool = False
    max_pending_events: int | None = None
    profile: Profile = Profile.V0_13
    policy: Policy | None = None  # the profile's when None


@dataclass(frozen=True)
class GetNewBlocks:
    n: int


@dataclass(frozen=True)
class FreeBlocks:
    block_ids: tuple[BlockId, ...]


@dataclass(frozen=True)
class Touch:
    block_ids: tuple[BlockId, ...]


@dataclass(frozen=True)
class CacheFullBlocks:
    block_ids: tuple[BlockId, ...]
    block_hashes: tuple[bytes, ...]
    num_cached: int
    num_full: int
    group_id: int
    token_ids: tuple[int, ...]  # the tokens of blocks [num_cached, num_full)
    block_size: int
    lora_id: int | None = None
    retention: tuple[TokenRangeRetention, ...] = ()  # the request's hints


@dataclass(frozen=True)
class GetCachedBlock:
    block_hash: bytes
    group_ids: tuple[int, ...]


@dataclass(frozen=True)
class GetCachedPrefix:
    """kvspec's bulk lookup: get_cached_block in one group up to the first miss."""

    block_hashes: tuple[bytes, ...]
    group_id: int
    max_blocks: int


@dataclass(frozen=True)
class EvictBlocks:
    """Evict the keys of a set of blocks: both sides walk ``set(block_ids)``."""

    block_ids: tuple[BlockId, ...]


@dataclass(frozen=True)
class ResetPrefixCache:
    pass


@dataclass(frozen=True)
class TakeEvents:
    pass


@dataclass(frozen=True)
class GetNumFreeBlocks:
    pass


@dataclass(frozen=True)
class GetUsage:
    pass


@dataclass(frozen=True)
class SetRetention:
    block_ids: tuple[BlockId, ...]
    priority: int
    duration: int | None = None


@dataclass(frozen=True)
class AdvanceClock:
    now: int


@dataclass(frozen=True)
class PinBlocks:
    block_ids: tuple[BlockId, ...]


@dataclass(frozen=True)
class UnpinBlocks:
    block_ids: tuple[BlockId, ...]


# vLLM 0.33's operations (refused with NotSupported under vllm-0.13).


@dataclass(frozen=True)
class CachePartialBlock:
    """``cache_partial_block``: ``token_ids`` are the request's tokens of the hash block
    ending at num_tokens (the event's); the request's hashes are ``block_hashes``."""

    block_id: BlockId
    block_hashes: tuple[bytes, ...]
    num_tokens: int
    group_id: int
    block_size: int
    hash_block_size: int
    token_ids: tuple[int, ...] = ()
    lora_id: int | None = None
    replace_existing: bool = False


@dataclass(frozen=True)
class MoveBlockHashes:
    src: BlockId
    dst: BlockId


@dataclass(frozen=True)
class UnpinWithWatcher:
    """``unpin_blocks(blocks, on_reuse)``: the watcher is the call's, numbered in order."""

    block_ids: tuple[BlockId, ...]


@dataclass(frozen=True)
class IsBlockWritable:
    block_id: BlockId


@dataclass(frozen=True)
class EmitCachedBlockEvents:
    """``token_ids``: the request's first num_cached x block_size tokens."""

    block_hashes: tuple[bytes, ...]
    num_cached: int
    block_size: int
    group_id: int
    token_ids: tuple[int, ...] = ()
    lora_id: int | None = None


@dataclass(frozen=True)
class FreeWithForeign:
    """``free_blocks`` over this pool's blocks and, after them, blocks of a foreign owner
    (their ids in that pool)."""

    block_ids: tuple[BlockId, ...]
    foreign_ids: tuple[BlockId, ...]


PoolCommand = (NewPool | GetNewBlocks | FreeBlocks | Touch | CacheFullBlocks | GetCachedBlock
               | GetCachedPrefix | EvictBlocks | ResetPrefixCache | TakeEvents
               | GetNumFreeBlocks | GetUsage | SetRetention | AdvanceClock | PinBlocks
               | UnpinBlocks | CachePartialBlock | MoveBlockHashes | UnpinWithWatcher
               | IsBlockWritable | EmitCachedBlockEvents | FreeWithForeign)
V0_33_COMMANDS = (CachePartialBlock, MoveBlockHashes, UnpinWithWatcher, IsBlockWritable,
                  EmitCachedBlockEvents, FreeWithForeign)
POLICY_COMMANDS = (SetRetention, AdvanceClock, PinBlocks, UnpinBlocks)


def get_cached_prefix(state: PoolState, block_hashes: Sequence[bytes], group_id: int,
                      max_blocks: int) -> tuple[BlockId, ...]:
    """The blocks get_cached_block finds in one group, hash by hash, up to the first miss
    and at most max_blocks of them."""
    found: list[BlockId] = []
    for block_hash in block_hashes[:max(max_blocks, 0)]:
        hit = get_cached_block(state, block_hash, (group_id,))
        if hit is None:
            break
        found.append(hit[0])
    return tuple(found)


def step(state: PoolState | None, command: PoolCommand) -> tuple[PoolState, object]:
    """One command on the pool: the new state and the command's output (None for calls
    that return nothing). A refused command raises a `PoolError` and changes nothing."""
    if isinstance(command, NewPool):
        return new_pool(command.num_blocks, command.enable_caching, command.enable_events,
                        command.profile, command.max_pending_events, command.policy), None
    if state is None:
        raise BadConfig(f"{command} before the pool is built")
    if isinstance(command, GetNewBlocks):
        return get_new_blocks(state, command.n)
    if isinstance(command, FreeBlocks):
        return free_blocks(state, command.block_ids), None
    if isinstance(command, Touch):
        return touch(state, command.block_ids), None
    if isinstance(command, CacheFullBlocks):
        c = command
        return cache_full_blocks(state, c.block_ids, c.block_hashes, c.num_cached, c.num_full,
                                 c.group_id, c.token_ids, c.block_size, c.lora_id,
                                 c.retention), None
    if isinstance(command, GetCachedBlock):
        return state, get_cached_block(state, command.block_hash, command.group_ids)
    if isinstance(command, GetCachedPrefix):
        return state, get_cached_prefix(state, command.block_hashes, command.group_id,
                                        command.max_blocks)
    if isinstance(command, EvictBlocks):
        return evict_blocks(state, set(command.block_ids)), None
    if isinstance(command, ResetPrefixCache):
        return reset_prefix_cache(state)
    if isinstance(command, TakeEvents):
        return take_events(state)
    if isinstance(command, GetNumFreeBlocks):
        return state, num_free(state)
    if isinstance(command, SetRetention):
        return set_retention(state, command.block_ids, command.priority, command.duration), None
    if isinstance(command, AdvanceClock):
        return advance_clock(state, command.now), None
    if isinstance(command, PinBlocks):
        return pin_blocks(state, command.block_ids), None
    if isinstance(command, UnpinBlocks):
        return unpin_blocks(state, command.block_ids), None
    if isinstance(command, GetUsage):
        return state, usage(state)
    if isinstance(command, V0_33_COMMANDS):
        return _step_0_33(state, command)
    raise UnknownCommand(f"not a pool command: {command!r}")


def _step_0_33(state: PoolState, command: PoolCommand) -> tuple[PoolState, object]:
    """`step` for vLLM 0.33's operations."""
    if isinstance(command, CachePartialBlock):
        c = command
        return cache_partial_block(state, c.block_id, c.block_hashes, c.num_tokens, c.group_id,
                                   c.block_size, c.hash_block_size, c.token_ids, c.lora_id,
                                   c.replace_existing)
    if isinstance(command, MoveBlockHashes):
        return move_block_hashes(state, command.src, command.dst), None
    if isinstance(command, UnpinWithWatcher):
        return unpin_with_watcher(state, command.block_ids), None
    if isinstance(command, IsBlockWritable):
        return state, is_block_writable(state, command.block_id)
    if isinstance(command, EmitCachedBlockEvents):
        c2 = command
        return emit_cached_block_events(state, c2.block_hashes, c2.num_cached, c2.block_size,
                                        c2.group_id, c2.token_ids, c2.lora_id), None
    if isinstance(command, FreeWithForeign):
        return free_blocks_forwarding(state, command.block_ids, command.foreign_ids), None
    raise UnknownCommand(f"not a pool command: {command!r}")
