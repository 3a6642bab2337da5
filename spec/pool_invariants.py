"""The block pool's invariants: one named predicate per property of vLLM's BlockPool.

Each predicate takes a `PoolState` and returns True when the property holds. `ALL` lists them
for the conformance machine, which checks every one after every step; `violated(state)`
names the ones that fail.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from kvspec.spec import eviction as E
from kvspec.spec.pool import NULL_BLOCK, BlockId, Cleared, PoolState, Removed, Stored, external_hash


def free_iff_unreferenced(state: PoolState) -> bool:
    """A non-null block is in the free order exactly when its ref count is 0.

    pre: len(state.ref) == state.num_blocks
    """
    free = set(state.free)
    return all((b in free) == (state.ref[b] == 0) for b in range(1, state.num_blocks))


def free_order_has_no_duplicates(state: PoolState) -> bool:
    """No block appears twice in the free order."""
    return len(set(state.free)) == len(state.free)


def free_order_within_pool(state: PoolState) -> bool:
    """Every block in the free order is a real, non-null block of the pool."""
    return all(1 <= b < state.num_blocks for b in state.free)


def ref_counts_nonnegative(state: PoolState) -> bool:
    """No ref count is negative, and the null block's stays 0 (it is not modelled)."""
    return all(r >= 0 for r in state.ref) and state.ref[NULL_BLOCK] == 0


def null_block_never_free_never_keyed(state: PoolState) -> bool:
    """The null block is never in the free order, never has a key (primary or partial),
    never sits in the map, and is never watched (0.33 refuses to unpin it)."""
    in_map = any(NULL_BLOCK in blocks for _, blocks in state.cached)
    return (NULL_BLOCK not in state.free and state.key_of[NULL_BLOCK] is None and not in_map
            and all(b != NULL_BLOCK for b, _ in state.partial_keys)
            and all(b != NULL_BLOCK for b, _ in state.watchers))


def key_map_agrees_with_block_keys(state: PoolState) -> bool:
    """Every block under key k in the map has key k (its primary key or, under 0.33, one of
    its partial entries), and every key of a block lists the block under it."""
    listed = [(key, b) for key, blocks in state.cached for b in blocks]
    keyed = [(key, b) for b, key in enumerate(state.key_of) if key is not None] + [
        (key, b) for b, keys in state.partial_keys for key in keys]
    return len(listed) == len(set(listed)) and set(listed) == set(keyed)


def no_empty_key_entries(state: PoolState) -> bool:
    """The map holds no key without blocks, and no key twice."""
    keys = [key for key, _ in state.cached]
    return all(blocks for _, blocks in state.cached) and len(keys) == len(set(keys))


def keys_only_when_caching(state: PoolState) -> bool:
    """With prefix caching off, no block ever gets a key."""
    return state.enable_caching or all(key is None for key in state.key_of)


def events_replay_to_cached_keys(state: PoolState) -> bool:
    """Replaying the emitted events onto an empty multiset gives the keyed blocks' hashes.

    Stored adds one per newly keyed block, Removed takes one away, Cleared empties it. With
    events off nothing is emitted and there is nothing to check. With a bound on pending
    events it holds all the same: a collapse replaces the pending events by a snapshot that
    starts with Cleared, so the events already taken and the snapshot replay to the cache.
    """
    if not state.enable_events:
        return not state.events
    replayed: Counter[int] = Counter()
    reports = frozenset(state.reported)
    for index, event in enumerate(state.events):
        if isinstance(event, Stored):
            if index in reports:  # a reused block re-announced: no new copy
                continue
            replayed.update(event.hashes)
        elif isinstance(event, Removed):
            replayed.subtract(event.hashes)
        elif isinstance(event, Cleared):
            replayed.clear()
    return +replayed == _copies(state) and all(n >= 0 for n in replayed.values())


def _copies(state: PoolState) -> Counter[int]:
    """Each physical copy's hash: one per key of each block (primary and partial)."""
    copies = Counter(external_hash(key) for key in state.key_of if key is not None)
    copies.update(external_hash(key) for _, keys in state.partial_keys for key in keys)
    return copies


def pending_events_within_bound(state: PoolState) -> bool:
    """With a bound on pending events, no more are pending than the bound or than twice a
    snapshot of the cache, less one (a collapse happens at twice the snapshot): at most
    max(bound, 2 x keyed blocks + 1). Without a bound, nothing to check."""
    bound = state.max_pending_events
    if bound is None:
        return True
    keyed = sum(1 for key in state.key_of if key is not None) + sum(
        len(keys) for _, keys in state.partial_keys)
    return len(state.events) - state.num_taken <= max(bound, 2 * keyed + 1)


# --- The eviction policies' invariants (spec.eviction) ----------------------------------------


def pinned_blocks_stay_cached(state: PoolState) -> bool:
    """A pinned block is never evicted: it keeps its key and a reference (so it is never
    free, and get_new_blocks cannot take it)."""
    return all(state.key_of[b] is not None and state.ref[b] >= 1 and b not in state.free
               for b in state.pinned)


def no_expired_priority(state: PoolState) -> bool:
    """An expired priority is never used: every retention entry the pool holds is live at
    its clock (an expired one has reverted to the default)."""
    return all(expires is None or expires > state.now for _, _, expires in state.retention)


def priorities_only_on_cached_blocks(state: PoolState) -> bool:
    """Retention priorities are in range, one per block, on cached blocks only, and only
    under a policy that has them."""
    blocks = [b for b, _, _ in state.retention]
    return ((state.policy.has_priorities or not blocks)
            and len(set(blocks)) == len(blocks)
            and all(0 < b < state.num_blocks and state.key_of[b] is not None
                    and E.MIN_PRIORITY <= priority <= E.MAX_PRIORITY
                    for b, priority, _ in state.retention))


def evicted_lowest_priority_first(before: PoolState, taken: tuple[BlockId, ...]) -> bool:
    """No block is evicted while a free block of lower priority exists: get_new_blocks takes
    its blocks one at a time from ``before``, and each is worth no more than any free block
    still left at that moment (``priority`` only; a free block without a key is worth
    least)."""
    if not before.policy.has_priorities:
        return True
    keyed = frozenset(b for b, key in enumerate(before.key_of) if key is not None)

    def worth(block: BlockId) -> int:
        return E.effective_priority(before.retention, block in keyed, block)

    left = list(before.free)
    for block in taken:
        if block not in left or any(worth(other) < worth(block) for other in left):
            return False
        left.remove(block)
    return True


def allocated_blocks_are_fresh(state: PoolState, allocated: tuple[BlockId, ...]) -> bool:
    """Blocks just returned by get_new_blocks have ref count 1, no key and no retention
    priority (the evicted content's priority went with its key)."""
    prioritised = {b for b, _, _ in state.retention}
    partial = {b for b, _ in state.partial_keys}
    return all(state.ref[b] == 1 and state.key_of[b] is None and b not in prioritised
               and b not in partial for b in allocated)


# --- vLLM 0.33's pool (spec.pool's Profile.V0_33 operations) --------------------------------


def partial_key_never_outlives_its_block(state: PoolState) -> bool:
    """A partial entry lives only beside its block's primary key: a block with partial
    entries has a primary key, holds no entry twice nor its primary key among them, and the
    map lists it under each. A reused or reset block has none left, so no map entry points
    at a block whose contents were replaced."""
    cached = dict(state.cached)
    blocks = [b for b, _ in state.partial_keys]
    return len(set(blocks)) == len(blocks) and all(
        keys and state.key_of[b] is not None and state.key_of[b] not in keys
        and len(set(keys)) == len(keys) and all(b in cached.get(key, ()) for key in keys)
        for b, keys in state.partial_keys)


def watchers_fire_at_most_once(state: PoolState) -> bool:
    """Every reuse watcher fires at most once per block it watches, and a watcher that has
    fired for a block is no longer pending on it; pending watchers are on real blocks."""
    pending = {(w, b) for b, ids in state.watchers for w in ids}
    return (len(set(state.fired)) == len(state.fired) and not pending & set(state.fired)
            and all(0 < b < state.num_blocks and ids for b, ids in state.watchers))


def event_log_has_one_store_one_remove_per_copy(state: PoolState) -> bool:
    """vLLM's event contract: each physical copy of a hash (a key of a block) is announced
    by one store and withdrawn by one remove. Walking the log (reports of reused blocks
    skipped, Cleared starting afresh), no remove comes without a live store of its hash,
    and the live stores at the end are exactly the copies the pool holds."""
    if not state.enable_events:
        return not state.events
    live: Counter[int] = Counter()
    reports = frozenset(state.reported)
    for index, event in enumerate(state.events):
        if isinstance(event, Cleared):
            live.clear()
        elif isinstance(event, Stored) and index not in reports:
            live.update(event.hashes)
        elif isinstance(event, Removed):
            for removed in event.hashes:
                if live[removed] <= 0:
                    return False
                live[removed] -= 1
    return +live == _copies(state)


def watched_blocks_fire_when_handed_out(before: PoolState, taken: tuple[BlockId, ...],
                                        after: PoolState) -> bool:
    """A block with a pending watcher is never handed out silently: every watcher pending
    on a block get_new_blocks took has fired for it, and none is pending on it after."""
    pending = dict(before.watchers)
    fired = set(after.fired)
    left = {b for b, _ in after.watchers}
    return all((w, b) in fired for b in taken for w in pending.get(b, ())) and not (
        left & set(taken))


Invariant = Callable[[PoolState], bool]

ALL: tuple[Invariant, ...] = (
    free_iff_unreferenced,
    free_order_has_no_duplicates,
    free_order_within_pool,
    ref_counts_nonnegative,
    null_block_never_free_never_keyed,
    key_map_agrees_with_block_keys,
    no_empty_key_entries,
    keys_only_when_caching,
    events_replay_to_cached_keys,
    pending_events_within_bound,
    pinned_blocks_stay_cached,
    no_expired_priority,
    priorities_only_on_cached_blocks,
)
# vLLM 0.33's: checked by the vllm-0.33 machine only (the 0.13 states have none of it).
V0_33: tuple[Invariant, ...] = (
    partial_key_never_outlives_its_block,
    watchers_fire_at_most_once,
    event_log_has_one_store_one_remove_per_copy,
)
# The eviction policies' state invariants (the manager machine checks them on its pool too).
# The cap on pins is no state invariant of a target: a pin over it is a call the spec refuses
# (spec.pool.pin_blocks, whose contract CrossHair checks), compared call by call.
POLICY: tuple[Invariant, ...] = ALL[-3:]


def violated(state: PoolState) -> list[str]:
    """The names of the invariants that do not hold in state."""
    checked = ALL + V0_33 if state.profile.value == "vllm-0.33" else ALL
    return [inv.__name__ for inv in checked if not inv(state)]
