"""The offload tier, as an executable model of vLLM's offloading manager.

vLLM offloads KV blocks to a second tier (CPU memory) through an ``OffloadingManager``:
0.13's ``LRUOffloadingManager`` and ``ARCOffloadingManager`` (vllm/v1/kv_offload/
{abstract,lru_manager,arc_manager}.py), 0.33's ``CPUOffloadingManager`` with a plug-in cache
policy (vllm/v1/kv_offload/cpu/manager.py, cpu/policies/{lru,arc}.py). The manager decides
what is stored, what may be loaded back and what is evicted; the connector moves the data.

**A key's life.** Each resident key has a ref count (the same encoding in both releases):

    absent --PrepareStore--> pending (-1) --CompleteStore--> ready (0) --PrepareLoad--> n > 0
       ^                        |  failure                     ^    |            |  CompleteLoad
       |________________________|                              |    |____________|
       |_____________ evicted by a later PrepareStore (ready, unpinned, not offered) ___|

A store is all or nothing: it evicts exactly the keys it needs room for, only ready,
unpinned keys, never a key the same call offers (vLLM #35846), or it returns None and
evicts nothing (vLLM #37874). A load pins ready keys only; an unpin never goes below zero.
Every bad call is refused with a typed error naming the value, and changes nothing.

**Recency** is the eviction policy's (`policy` of `NewOffload`): ``lru`` keeps one list,
``t1``, least recent first; ``arc`` keeps vLLM's ARC lists (T1 seen once, T2 seen again, the
ghosts B1 and B2, the target T1 size ``target``), which is not the textbook's ARC: a ghost
hit only moves the target, the key comes back into T1 (arc_manager.py, cpu/policies/arc.py).

**Events** announce the ready keys to a router: a store's completion announces its keys, an
eviction removes them. Replaying every event gives exactly the ready set
(`events_replay_to_ready`); `reset` (0.33) removes every ready key, which vLLM 0.33 does not
announce.

The two releases differ in parameters of this one model (`spec.pool.Profile`): where
recency comes from (``touch`` in 0.13; each request's accesses, committed when it finishes,
in 0.33), when ARC adapts its target, how a failed store is announced, and the reset.
vLLM 0.13's bugs that 0.33 fixed (#35846, #37874, #55461, the ARC ``touch`` of a pending key)
are not parameters: the audit reports them against the one contract.

Keys are small ints here; an adapter maps them to vLLM's bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from kvspec.spec.pool import Profile

Key = int
Req = str

POLICIES = ("lru", "arc")

PENDING = -1  # the ref count of a key whose store has not completed


# --- Refusals: every bad call raises one of these, before anything changes. ----------------------


class OffloadError(Exception):
    """A call the offload manager must refuse; the manager is unchanged."""


class UnknownOffloadKey(OffloadError, KeyError):
    """A load or completion names a key the tier does not hold (vLLM: KeyError)."""

    def __str__(self) -> str:  # KeyError would show the message quoted
        return str(self.args[0]) if self.args else ""


class StoreNotComplete(OffloadError, ValueError):
    """``prepare_load`` of a key whose store is still pending: its data are not written."""


class NotPinned(OffloadError, ValueError):
    """``complete_load`` of a key no load pins: the unpin would go below zero."""


class StoreNotPending(OffloadError, ValueError):
    """``complete_store`` of a key that is already ready: a second completion."""


class DuplicateOffloadKey(OffloadError, ValueError):
    """A key listed twice in one load, unpin, store or completion."""


class BadOffloadConfig(OffloadError, ValueError):
    """A tier that cannot be built: a capacity below 1, an unknown policy."""


# --- State ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OffloadEvent:
    """vLLM's ``OffloadingEvent``: keys stored (``removed=False``) or removed. A failed
    store's removal is ``metadata_only`` (0.33): its keys were never announced."""

    keys: tuple[Key, ...]
    removed: bool
    metadata_only: bool = False


@dataclass(frozen=True)
class RequestAccess:
    """What one request did to the tier (0.33's ``_RequestCacheAccess``): the keys it saw in
    first-seen order, those it inserted, those it reused (ready keys it loaded or offered
    that it had not inserted itself), the store misses ARC has learned from, and whether it
    has finished."""

    seen: tuple[Key, ...] = ()
    inserted: frozenset[Key] = frozenset()
    reused: frozenset[Key] = frozenset()
    store_missed: frozenset[Key] = frozenset()
    finished: bool = False


@dataclass(frozen=True)
class OffloadState:
    capacity: int  # how many keys the tier holds (vLLM's CPU blocks)
    policy: str  # "lru" or "arc"
    profile: Profile
    refs: tuple[tuple[Key, int], ...] = ()  # resident keys, by key: -1 pending, n >= 0 ready
    t1: tuple[Key, ...] = ()  # LRU: every resident key; ARC: T1. Least recent first.
    t2: tuple[Key, ...] = ()  # ARC: keys seen again
    b1: tuple[Key, ...] = ()  # ARC: ghosts evicted from T1 (keys only, no data)
    b2: tuple[Key, ...] = ()  # ARC: ghosts evicted from T2
    target: float = 0.0  # ARC: the target T1 size, vLLM's float arithmetic (int() truncates)
    events: tuple[OffloadEvent, ...] = ()  # emitted, not yet taken
    announced: frozenset[Key] = frozenset()  # what a consumer of every taken event holds
    requests: tuple[tuple[Req, RequestAccess], ...] = ()  # 0.33: by request, this generation
    generation: int = 0  # resets so far (0.33)
    ref: dict[Key, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ref", dict(self.refs))


def ready_keys(state: OffloadState) -> frozenset[Key]:
    return frozenset(k for k, r in state.refs if r >= 0)


def evictable(state: OffloadState, protected: Iterable[Key] = ()) -> tuple[Key, ...]:
    """The keys eviction may take, in the policy's list order: ready, unpinned, not offered."""
    shielded = frozenset(protected)
    return tuple(k for k in state.t1 + state.t2 if state.ref[k] == 0 and k not in shielded)


def _set_refs(state: OffloadState, ref: dict[Key, int]) -> OffloadState:
    return replace(state, refs=tuple(sorted(ref.items())))


def _request(state: OffloadState, req: Req) -> RequestAccess:
    return dict(state.requests).get(req, RequestAccess())


def _set_request(state: OffloadState, req: Req, access: RequestAccess) -> OffloadState:
    requests = dict(state.requests)
    requests[req] = access
    return replace(state, requests=tuple(sorted(requests.items())))


def _without(keys: tuple[Key, ...], gone: Iterable[Key]) -> tuple[Key, ...]:
    dropped = frozenset(gone)
    return tuple(k for k in keys if k not in dropped)


def _to_end(keys: tuple[Key, ...], key: Key) -> tuple[Key, ...]:
    """Move (or add) ``key`` to the most recent end."""
    return _without(keys, (key,)) + (key,)


# --- Commands: one per call of vLLM's OffloadingManager API --------------------------------------


@dataclass(frozen=True)
class NewOffload:
    """A manager of ``capacity`` keys with eviction ``policy`` (0.13: a backend of that many
    blocks; 0.33: ``CPUOffloadingManager(num_chunks=capacity, cache_policy=policy)``)."""

    capacity: int
    policy: str = "lru"
    profile: Profile = Profile.V0_13


@dataclass(frozen=True)
class Lookup:
    """How many leading keys are ready (0.13's ``lookup``; 0.33's per-key HIT until the
    first MISS or HIT_PENDING)."""

    keys: tuple[Key, ...]


@dataclass(frozen=True)
class PrepareLoad:
    req: Req
    keys: tuple[Key, ...]


@dataclass(frozen=True)
class Touch:
    req: Req
    keys: tuple[Key, ...]


@dataclass(frozen=True)
class CompleteLoad:
    req: Req
    keys: tuple[Key, ...]


@dataclass(frozen=True)
class PrepareStore:
    """Output: ``(keys to store, keys evicted)``, or None when there is no room."""

    req: Req
    keys: tuple[Key, ...]


@dataclass(frozen=True)
class CompleteStore:
    """A store's completion. ``generation``: the generation the connector issued the store
    in; a completion from before a reset is late and changes nothing (0.33's connector drops
    it, offloading/scheduler.py ``_stale_job_threshold``)."""

    req: Req
    keys: tuple[Key, ...]
    success: bool = True
    generation: int | None = None


@dataclass(frozen=True)
class RequestFinished:
    """0.33's ``on_request_finished``: commit the request's accesses to the policy."""

    req: Req


@dataclass(frozen=True)
class Reset:
    """0.33's ``reset_cache``: drop every key, start a new generation."""


@dataclass(frozen=True)
class TakeEvents:
    pass


Command = (NewOffload | Lookup | PrepareLoad | Touch | CompleteLoad | PrepareStore
           | CompleteStore | RequestFinished | Reset | TakeEvents)


# --- Checks shared by the calls ------------------------------------------------------------------


def _check_unlisted(keys: tuple[Key, ...]) -> None:
    for position, key in enumerate(keys):
        if key in keys[:position]:
            raise DuplicateOffloadKey(f"key {key!r} is listed twice in {list(keys)}")


def _check_known(state: OffloadState, keys: tuple[Key, ...]) -> None:
    for key in keys:
        if key not in state.ref:
            raise UnknownOffloadKey(f"key {key!r} is not in the offload tier")


# --- The policy: which keys go, and how recency moves --------------------------------------------


def victims(state: OffloadState, n: int, protected: frozenset[Key]) -> tuple[Key, ...] | None:
    """The ``n`` keys a store evicts, in eviction order, or None when fewer are evictable.

    LRU: the least recent evictable keys. ARC (cpu/policies/arc.py ``evict``): per victim,
    from T1 while T1 is at least its target (``int`` of the float target), else from T2,
    else from T1 (vLLM #55461: 0.13 gave up instead). T1's size counts down as T1 gives.

    pre: refs_well_formed(state) and lists_hold_the_resident_keys(state)
    pre: n >= 0 and target_within_capacity(state)
    post: __return__ is None or len(__return__) == n
    """
    if state.policy == "lru":
        candidates = evictable(state, protected)
        return candidates[:n] if len(candidates) >= n else None
    from_t1 = [k for k in state.t1 if state.ref[k] == 0 and k not in protected]
    from_t2 = [k for k in state.t2 if state.ref[k] == 0 and k not in protected]
    t1_size, chosen = len(state.t1), []
    for _ in range(n):
        if t1_size >= int(state.target) and from_t1:
            chosen.append(from_t1.pop(0))
            t1_size -= 1
        elif from_t2:
            chosen.append(from_t2.pop(0))
        elif from_t1:
            chosen.append(from_t1.pop(0))
            t1_size -= 1
        else:
            return None
    return tuple(chosen)


def _evict_arc(state: OffloadState, gone: tuple[Key, ...]) -> OffloadState:
    b1, b2 = state.b1, state.b2
    for key in gone:
        if key in state.t1:
            b1 = _to_end(b1, key)
        else:
            b2 = _to_end(b2, key)
    ref = {k: r for k, r in state.ref.items() if k not in gone}
    trimmed = replace(state, t1=_without(state.t1, gone), t2=_without(state.t2, gone),
                      b1=b1[max(0, len(b1) - state.capacity):],
                      b2=b2[max(0, len(b2) - state.capacity):])
    return _set_refs(trimmed, ref)


def _adapt_to_ghost(state: OffloadState, key: Key) -> OffloadState:
    """An ARC ghost seen again moves the target: toward T1 for a B1 ghost, toward T2 for a
    B2 ghost, by the other ghost list's size over its own, at least 1 (float, as vLLM)."""
    if key in state.b1:
        delta = max(1, len(state.b2) / len(state.b1))
        return replace(state, target=min(state.target + delta, state.capacity),
                       b1=_to_end(state.b1, key))
    if key in state.b2:
        delta = max(1, len(state.b1) / len(state.b2))
        return replace(state, target=max(state.target - delta, 0), b2=_to_end(state.b2, key))
    return state


def _touch_one(state: OffloadState, key: Key) -> OffloadState:
    if state.policy == "lru":
        return replace(state, t1=_to_end(state.t1, key)) if key in state.ref else state
    if key in state.t1:
        if state.ref[key] == PENDING:
            # Just prepared for storing, not seen twice: stays in T1, most recent
            # (0.33's arc.py; 0.13's touch lost the key here).
            return replace(state, t1=_to_end(state.t1, key))
        return replace(state, t1=_without(state.t1, (key,)), t2=state.t2 + (key,))
    if key in state.t2:
        return replace(state, t2=_to_end(state.t2, key))
    return _adapt_to_ghost(state, key)


def _commit_request(state: OffloadState, access: RequestAccess) -> OffloadState:
    """0.33's ``on_request_finished``, the request's keys last to first (so its first key
    ends most recent). LRU: each resident key to the most recent end. ARC: a key the
    request only inserted keeps its list (a store is not a second sighting); a key it reused
    is seen again: T1 to T2, or to T2's most recent end."""
    insertion_only = access.inserted - access.reused
    for key in reversed(access.seen):
        if state.policy == "lru":
            state = _touch_one(state, key)
        elif key in insertion_only:
            if key in state.t1:
                state = replace(state, t1=_to_end(state.t1, key))
            elif key in state.t2:
                state = replace(state, t2=_to_end(state.t2, key))
        elif key in access.reused and key in state.t1:
            # A key evicted and stored again since the request reused it is a new copy, not
            # seen twice: it stays in T1, as ``touch`` keeps a pending key (vLLM 0.33
            # promotes it, pending or not: docs/findings.md O10).
            state = _touch_one(state, key)
        elif key in access.reused and key in state.t2:
            state = replace(state, t2=_to_end(state.t2, key))
    return state


def _record_access(state: OffloadState, req: Req, keys: Iterable[Key],
                   reused: Iterable[Key] = ()) -> OffloadState:
    """0.33: a request's loads and store offers are recorded for ``RequestFinished``. A
    key the request inserted itself is not reused when it reads it back."""
    if not state.profile.offload_recency_from_requests:
        return state
    access = _request(state, req)
    seen = access.seen + tuple(k for k in dict.fromkeys(keys) if k not in access.seen)
    new_reuse = frozenset(reused) - access.inserted
    return _set_request(state, req, replace(access, seen=seen, reused=access.reused | new_reuse))


# --- Operations: small pure functions ------------------------------------------------------------


def new_offload(capacity: int, policy: str, profile: Profile) -> OffloadState:
    """An empty tier.

    pre: 1 <= capacity <= 4
    raises: OffloadError
    post: not __return__.refs
    """
    if type(capacity) is not int or capacity < 1:
        raise BadOffloadConfig(f"an offload tier holds at least 1 key, got {capacity!r}")
    if policy not in POLICIES:
        raise BadOffloadConfig(f"unknown offload policy {policy!r}: use {' or '.join(POLICIES)}")
    return OffloadState(capacity, policy, profile)


def lookup(state: OffloadState, keys: tuple[Key, ...]) -> int:
    """The number of leading keys that are ready; a missing or pending key ends the hit.

    post: 0 <= __return__ <= len(keys)
    """
    count = 0
    for key in keys:
        if state.ref.get(key, PENDING) < 0:
            break
        count += 1
    return count


def prepare_load(state: OffloadState, req: Req, keys: tuple[Key, ...]) -> OffloadState:
    """Pin ready keys for a load: each key's ref count goes up by one. Recency does not move.

    pre: refs_well_formed(state) and lists_hold_the_resident_keys(state)
    raises: OffloadError
    post: all(__return__.ref[k] == state.ref[k] + 1 for k in keys)
    """
    _check_unlisted(keys)
    _check_known(state, keys)
    for key in keys:
        if state.ref[key] == PENDING:
            raise StoreNotComplete(f"key {key!r} cannot be loaded: its store is pending")
    ref = dict(state.ref)
    for key in keys:
        ref[key] += 1
    return _record_access(_set_refs(state, ref), req, keys, reused=keys)


def touch(state: OffloadState, keys: tuple[Key, ...]) -> OffloadState:
    """Mark keys used, last to first, so that the first key ends most recent. Unknown keys
    are ignored (ARC learns from its ghosts).

    pre: refs_well_formed(state) and lists_hold_the_resident_keys(state)
    post: __return__.refs == state.refs
    """
    for key in reversed(keys):
        state = _touch_one(state, key)
    return state


def complete_load(state: OffloadState, keys: tuple[Key, ...]) -> OffloadState:
    """Unpin: each key's ref count goes down by one, never below zero.

    pre: refs_well_formed(state) and lists_hold_the_resident_keys(state)
    raises: OffloadError
    post: all(__return__.ref[k] == state.ref[k] - 1 for k in keys)
    """
    _check_unlisted(keys)
    _check_known(state, keys)
    for key in keys:
        if state.ref[key] <= 0:
            raise NotPinned(f"key {key!r} is not pinned by a load (ref count "
                            f"{state.ref[key]})")
    ref = dict(state.ref)
    for key in keys:
        ref[key] -= 1
    return _set_refs(state, ref)


def prepare_store(state: OffloadState, req: Req, keys: tuple[Key, ...]
                  ) -> tuple[OffloadState, tuple[tuple[Key, ...], tuple[Key, ...]] | None]:
    """Make room for the keys not yet held and hold them as pending, or return None and hold
    nothing new. Keys already held (pending or ready) are not stored again.

    pre: refs_well_formed(state) and lists_hold_the_resident_keys(state)
    pre: target_within_capacity(state)
    raises: OffloadError
    post: __return__[1] is None or set(__return__[1][1]).isdisjoint(keys)
    """
    _check_unlisted(keys)
    to_store = tuple(k for k in keys if k not in state.ref)
    ready_offered = tuple(k for k in keys if state.ref.get(k, PENDING) >= 0)
    if state.policy == "arc" and state.profile.arc_adapts_on_store_miss:
        # 0.33 learns from the ghosts before insertion drops them; once per request and key,
        # and even when the store then fails for want of room.
        access = _request(state, req)
        misses = tuple(k for k in to_store if k not in access.store_missed)
        for key in reversed(misses):
            state = _adapt_to_ghost(state, key)
        state = _set_request(state, req, replace(
            access, store_missed=access.store_missed | frozenset(misses)))
    state = _record_access(state, req, (k for k in keys if k in to_store or k in ready_offered),
                           reused=ready_offered)
    if not to_store:
        return state, ((), ())
    need = len(to_store) - (state.capacity - len(state.refs))
    gone: tuple[Key, ...] = ()
    if need > 0:
        chosen = victims(state, need, frozenset(keys))
        if chosen is None:
            return state, None
        gone = chosen
        state = _evict_arc(state, gone) if state.policy == "arc" else _set_refs(
            replace(state, t1=_without(state.t1, gone)),
            {k: r for k, r in state.ref.items() if k not in gone})
        state = replace(state, events=state.events + (OffloadEvent(gone, removed=True),))
    ref = dict(state.ref)
    ref.update((k, PENDING) for k in to_store)
    state = _set_refs(replace(state, t1=state.t1 + to_store, b1=_without(state.b1, to_store),
                              b2=_without(state.b2, to_store)), ref)
    if state.profile.offload_recency_from_requests:
        access = _request(state, req)
        state = _set_request(state, req, replace(access, inserted=access.inserted
                                                 | frozenset(to_store)))
    return state, (to_store, gone)


def _late(state: OffloadState, generation: int | None) -> bool:
    """A completion of a transfer issued before the last reset."""
    return generation is not None and generation < state.generation


def complete_store(state: OffloadState, keys: tuple[Key, ...], success: bool,
                   generation: int | None = None) -> OffloadState:
    """A store's end: success makes its keys ready and announces them; a failure drops them
    (0.33 announces the drop as metadata only). A completion from an earlier generation
    (issued before a reset) changes nothing.

    pre: refs_well_formed(state) and lists_hold_the_resident_keys(state)
    raises: OffloadError
    post: _late(state, generation) or all((__return__.ref.get(k) == 0) == success for k in keys)
    """
    if _late(state, generation):
        return state
    _check_unlisted(keys)
    _check_known(state, keys)
    for key in keys:
        if state.ref[key] != PENDING:
            raise StoreNotPending(f"key {key!r} has no pending store to complete (ref count "
                                  f"{state.ref[key]})")
    ref = dict(state.ref)
    if success:
        ref.update((k, 0) for k in keys)
        return replace(_set_refs(state, ref),
                       events=state.events + ((OffloadEvent(keys, removed=False),) if keys
                                              else ()))
    for key in keys:
        del ref[key]
    state = _set_refs(replace(state, t1=_without(state.t1, keys), t2=_without(state.t2, keys)),
                      ref)
    if state.profile.failed_store_announced and keys:
        state = replace(state, events=state.events + (
            OffloadEvent(keys, removed=True, metadata_only=True),))
    return state


def request_finished(state: OffloadState, req: Req) -> OffloadState:
    """0.33: commit a request's accesses, once; a request the tier has not seen (this
    generation) or that has finished changes nothing."""
    access = dict(state.requests).get(req)
    if access is None or access.finished or not state.profile.offload_recency_from_requests:
        return state
    return _set_request(_commit_request(state, access), req, replace(access, finished=True))


def reset(state: OffloadState) -> OffloadState:
    """0.33: drop every key, forget every request, start a new generation. The ready keys
    are announced removed (vLLM 0.33 announces nothing: docs/findings.md).

    pre: refs_well_formed(state) and lists_hold_the_resident_keys(state)
    post: not __return__.refs and __return__.generation == state.generation + 1
    """
    ready = tuple(k for k in state.t1 + state.t2 if state.ref[k] >= 0)
    cleared = OffloadState(state.capacity, state.policy, state.profile,
                           events=state.events + ((OffloadEvent(ready, removed=True),)
                                                  if ready else ()),
                           announced=state.announced, generation=state.generation + 1)
    return cleared


def _replay(held: frozenset[Key], events: Iterable[OffloadEvent]) -> frozenset[Key]:
    """A consumer's view after these events: stores add, removals drop; a metadata-only
    removal names keys that were never announced."""
    for item in events:
        if not item.removed:
            held = held | frozenset(item.keys)
        elif not item.metadata_only:
            held = held - frozenset(item.keys)
    return held


def take_events(state: OffloadState) -> tuple[OffloadState, tuple[OffloadEvent, ...]]:
    """The events emitted since the last take, oldest first. 0.33 filters a metadata-only
    removal to the keys still absent (a retried store may hold one again) and drops it if
    none is left.

    post: not __return__[0].events
    """
    taken = []
    for item in state.events:
        if item.metadata_only:
            keys = tuple(k for k in item.keys if k not in state.ref)
            if not keys:
                continue
            item = replace(item, keys=keys)
        taken.append(item)
    return replace(state, events=(), announced=_replay(state.announced, taken)), tuple(taken)


def step(state: OffloadState | None, command: Command) -> tuple[OffloadState, object]:
    """One command on the tier: the new state and the command's output in the spec's terms.
    A program starts with `NewOffload`; a refused call raises an `OffloadError` and changes
    nothing."""
    if isinstance(command, NewOffload):
        return new_offload(command.capacity, command.policy, command.profile), None
    if state is None:
        raise TypeError(f"an offload program starts with NewOffload, not {command!r}")
    if isinstance(command, Lookup):
        return state, lookup(state, command.keys)
    if isinstance(command, PrepareLoad):
        return prepare_load(state, command.req, command.keys), None
    if isinstance(command, Touch):
        return touch(state, command.keys), None
    if isinstance(command, CompleteLoad):
        return complete_load(state, command.keys), None
    if isinstance(command, PrepareStore):
        return prepare_store(state, command.req, command.keys)
    if isinstance(command, CompleteStore):
        return complete_store(state, command.keys, command.success, command.generation), None
    if isinstance(command, RequestFinished):
        return request_finished(state, command.req), None
    if isinstance(command, Reset):
        return reset(state), None
    if isinstance(command, TakeEvents):
        return take_events(state)
    raise TypeError(f"not an offload command: {command!r}")


# --- What a target shows, and back ---------------------------------------------------------------


@dataclass(frozen=True)
class OffloadView:
    """A target's state in the spec's terms: each list with its keys' ref counts, least
    recent first (LRU: everything in ``t1``), the ARC ghosts and target, and the events
    emitted and not yet taken."""

    t1: tuple[tuple[Key, int], ...]
    t2: tuple[tuple[Key, int], ...] = ()
    b1: tuple[Key, ...] = ()
    b2: tuple[Key, ...] = ()
    target: float = 0.0
    events: tuple[OffloadEvent, ...] = ()


def view_of(state: OffloadState) -> OffloadView:
    return OffloadView(tuple((k, state.ref[k]) for k in state.t1),
                       tuple((k, state.ref[k]) for k in state.t2), state.b1, state.b2,
                       state.target, state.events)


def from_view(spec: OffloadState, view: OffloadView) -> OffloadState:
    """The target's view as a state: what the spec does not see (requests, generation, what
    the consumer holds) is the spec's."""
    refs = view.t1 + view.t2
    return replace(spec, refs=tuple(sorted(refs)), t1=tuple(k for k, _ in view.t1),
                   t2=tuple(k for k, _ in view.t2), b1=tuple(view.b1), b2=tuple(view.b2),
                   target=view.target, events=tuple(view.events))


# --- Invariants: one named predicate per property ------------------------------------------------


def refs_well_formed(state: OffloadState) -> bool:
    """Every resident key is pending (-1) or ready with a pin count >= 0, held once."""
    keys = [k for k, _ in state.refs]
    return len(set(keys)) == len(keys) and all(type(r) is int and r >= PENDING
                                               for _, r in state.refs)


def lists_hold_the_resident_keys(state: OffloadState) -> bool:
    """The policy's lists hold each resident key exactly once, and nothing else (LRU: t1
    alone)."""
    listed = state.t1 + state.t2
    return (len(set(listed)) == len(listed) and set(listed) == set(state.ref)
            and (state.policy == "arc" or not state.t2))


def within_capacity(state: OffloadState) -> bool:
    """The tier never holds more keys than it has room for (|T1| + |T2| <= c)."""
    return len(state.refs) <= state.capacity


def ghosts_are_not_resident(state: OffloadState) -> bool:
    """ARC's ghosts are keys without data: in neither T1 nor T2, each in one ghost list."""
    ghosts = state.b1 + state.b2
    return len(set(ghosts)) == len(ghosts) and not set(ghosts) & set(state.ref)


def ghost_lists_bounded(state: OffloadState) -> bool:
    """Each ghost list holds at most c keys (vLLM bounds each list, not |T1| + |B1|)."""
    return len(state.b1) <= state.capacity and len(state.b2) <= state.capacity


def target_within_capacity(state: OffloadState) -> bool:
    """ARC's target T1 size stays in [0, c]."""
    return 0 <= state.target <= state.capacity


def pending_keys_stay_in_t1(state: OffloadState) -> bool:
    """A key whose store is pending has not been seen twice: it is in T1, never T2."""
    return all(state.ref[k] >= 0 for k in state.t2)


def events_replay_to_ready(state: OffloadState) -> bool:
    """A consumer that has taken every event holds exactly the ready keys."""
    return _replay(state.announced, state.events) == ready_keys(state)


def events_name_real_changes(state: OffloadState) -> bool:
    """No event is empty, and a metadata-only removal is never of a key a consumer holds."""
    held = state.announced
    for item in state.events:
        if not item.keys or (item.metadata_only and set(item.keys) & held):
            return False
        held = _replay(held, (item,))
    return True


Invariant = Callable[[OffloadState], bool]

ALL: tuple[Invariant, ...] = (
    refs_well_formed, lists_hold_the_resident_keys, within_capacity, ghosts_are_not_resident,
    ghost_lists_bounded, target_within_capacity, pending_keys_stay_in_t1,
    events_replay_to_ready, events_name_real_changes)


def violated(state: OffloadState) -> list[str]:
    """The names of the invariants that do not hold in state."""
    return [inv.__name__ for inv in ALL if not inv(state)]


# --- What one store must do (checked on a target's output by the machine) ------------------------


def store_violations(before: OffloadState, command: PrepareStore,
                     output: tuple[tuple[Key, ...], tuple[Key, ...]] | None,
                     after: OffloadState) -> list[str]:
    """The store rules a target's ``prepare_store`` broke, by name:

    - ``store_is_all_or_nothing``: None leaves every key where it was; otherwise it holds
      every key it said it stores.
    - ``store_evicts_only_idle_keys``: each victim was ready and unpinned.
    - ``store_keeps_offered_keys``: no victim is one of the call's keys (vLLM #35846).
    - ``store_evicts_only_what_it_needs``: as many victims as the new keys lack room for.
    - ``store_fails_only_when_full``: None only when fewer keys are evictable than needed.
    """
    broken = []
    to_store = tuple(k for k in command.keys if k not in before.ref)
    need = len(to_store) - (before.capacity - len(before.refs))
    if output is None:
        if after.refs != before.refs:
            broken.append("store_is_all_or_nothing")
        if need <= 0 or len(evictable(before, command.keys)) >= need:
            broken.append("store_fails_only_when_full")
        return broken
    stored, gone = output
    if any(after.ref.get(k) != PENDING for k in stored):
        broken.append("store_is_all_or_nothing")
    if any(before.ref.get(k) != 0 for k in gone):
        broken.append("store_evicts_only_idle_keys")
    if set(gone) & set(command.keys):
        broken.append("store_keeps_offered_keys")
    if len(gone) != max(0, need):
        broken.append("store_evicts_only_what_it_needs")
    return broken
