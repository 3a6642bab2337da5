"""The block-pool conformance machine: drive a target and the spec side by side, every step.

Rules are the operations a serving engine performs on the pool: admit a request (look up
its cached prefix, touch the hits, allocate the rest), cache its full blocks, finish it
(free its blocks, chain tail first), evict from a KV connector, reset the prefix cache,
drain events, and make bad calls. After every step the target's outputs must equal the
spec's, its abstract state (`PoolView`) must equal the spec's, and every invariant of
`spec.pool_invariants` must hold. Pools are tiny (2-16 blocks) and keys few, so
exhaustion, eviction, duplicate keys and hits on free blocks happen all the time.

`machine_for(target_factory)` builds a TestCase class for any target.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from hypothesis import event, note, strategies as st
from hypothesis.stateful import (
    initialize,
    invariant,
    precondition,
    rule,
)

from kvspec.spec import pool as model, pool_invariants
from kvspec.spec.conformance.deadline import BoundedSteps
from kvspec.spec.conformance.targets import PoolTarget, PoolView, view_of
from kvspec.spec.pool import NULL_BLOCK, PoolError, PoolState, Profile

BLOCK_SIZE = 2
NUM_FAMILIES = 2  # distinct prompt prefixes: few, so that keys repeat
GROUPS = (0, 1)
BAD_CALLS = (
    "free unreferenced", "free outside pool", "touch outside pool", "alloc negative",
    "alloc too many", "cache a keyed block", "evict outside pool", "evict negative id",
    "malformed hash",
)
# Bounds on pending events (kvspec's pool; a target without them gets None): small, so that
# collapses into a snapshot happen within a program.
EVENT_BOUNDS = st.sampled_from([None, None, 1, 2, 3, 6])
# Situations vLLM's own callers never create (its KV-cache managers guard them): an audit
# with --scope contract leaves them out.
OUT_OF_CONTRACT = frozenset(
    {f"bad call: {kind}" for kind in BAD_CALLS} | {"cache_full_blocks with caching off"})


def chain_hash(family: int, index: int) -> bytes:
    """The block hash of block ``index`` of prompt family ``family`` (a stand-in chain)."""
    return hashlib.sha256(f"kvspec:{family}:{index}".encode()).digest()


def chain_tokens(family: int, index: int) -> tuple[int, ...]:
    return (family * 1000 + index,) * BLOCK_SIZE


@dataclass
class Holding:
    """One running request's blocks in one KV-cache group, with how many are cached."""

    family: int
    group: int
    blocks: list[int]
    num_cached: int = 0
    lora_id: int | None = None
    uid: int = field(default=0)


class PoolMachine(BoundedSteps):
    """Runs a `PoolTarget` against `spec.pool`; subclasses set ``make_target``. Every step
    runs under the step deadline (`deadline.BoundedSteps`)."""

    make_target: Callable[[], PoolTarget]
    profile: Profile = Profile.V0_13
    excluded: frozenset[str] = frozenset()  # situations an audit has already reported
    situation = ""  # what the current step is doing, named for an audit's report

    def __init__(self) -> None:
        super().__init__()
        self.target = type(self).make_target()
        self.spec: PoolState = model.new_pool(2)
        self.holdings: list[Holding] = []
        self.next_uid = 0
        self.target_taken: tuple[model.Event, ...] = ()  # what the target's take_events gave
        self.consumer_stalls = False  # drawn by build: nobody takes events
        self._version = 0  # bumped by every call on the target; keys the cached view
        self._view: tuple[int, PoolView] | None = None
        self._state: tuple[tuple[int, int, int], PoolState] | None = None

    # -- helpers -------------------------------------------------------------------------

    def _step(self, name: str, spec_call: Callable[[PoolState], Any],
              target_call: Callable[[], Any]) -> Any:
        """Run one operation on both; a call the spec refuses must be refused alike."""
        try:
            result = spec_call(self.spec)
        except PoolError as refused:
            self._expect_refusal(name, refused, target_call)
            return None
        if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], PoolState):
            self.spec, output = result
        elif isinstance(result, PoolState):
            self.spec, output = result, None
        else:
            output = result
        try:
            actual = target_call()
        finally:
            self._version += 1
        return output, actual

    def _expect_refusal(self, name: str, refused: PoolError,
                        target_call: Callable[[], Any]) -> None:
        before = self._target_view()
        self._version += 1
        expected_base = LookupError if isinstance(refused, LookupError) else ValueError
        try:
            target_call()
        except (ValueError, LookupError) as error:
            assert isinstance(error, expected_base), (
                f"{name}: spec refuses with {type(refused).__name__} ({refused}); target raised "
                f"{type(error).__name__}, not a {expected_base.__name__}: {error}")
            assert str(error), f"{name}: {type(error).__name__} without a message"
        else:
            raise AssertionError(f"{name}: spec refuses ({refused}) but the target accepted it")
        after = self._target_view()
        assert after == before, f"{name}: a refused call changed the target's state"
        event(f"refused: {name}")

    def _allows(self, situation: str) -> bool:
        """Name what the step is about to do; False when an audit has excluded it."""
        self.situation = situation
        return situation not in self.excluded

    def _new_uid(self) -> int:
        self.next_uid += 1
        return self.next_uid

    def _live(self) -> list[Holding]:
        return self.holdings

    # -- set-up --------------------------------------------------------------------------

    @initialize(
        num_blocks=st.integers(2, 16),
        enable_caching=st.sampled_from([True, True, True, False]),
        enable_events=st.booleans(),
        event_bound=EVENT_BOUNDS,
        consumer_stalls=st.booleans(),
    )
    def build(self, num_blocks: int, enable_caching: bool, enable_events: bool,
              event_bound: int | None, consumer_stalls: bool) -> None:
        if not self.target.supports_event_bound():
            event_bound = None  # vLLM's pools keep every event
        # With a bound, the consumer may stall (take_events is never called): events then
        # pile up to collapses over a cache with blocks in it.
        self.consumer_stalls = consumer_stalls and event_bound is not None
        self.spec = model.new_pool(num_blocks, enable_caching, enable_events, self.profile,
                                   event_bound)
        self.target.build(num_blocks, enable_caching, enable_events, event_bound)
        event(f"pool size {'<=4' if num_blocks <= 4 else '5-8' if num_blocks <= 8 else '9-16'}")

    # -- rules: what a serving engine does -----------------------------------------------

    @rule(data=st.data(), family=st.integers(0, NUM_FAMILIES - 1),
          group=st.sampled_from((0, 0, 0, 1)),
          lora_id=st.sampled_from([None, None, 7]))
    def admit_request(self, data: st.DataObject, family: int, group: int,
                      lora_id: int | None) -> None:
        """Look up the cached prefix, touch the hits, allocate the rest (may exhaust the pool)."""
        hits: list[int] = []
        groups = list(GROUPS) if data.draw(st.integers(0, 3)) == 0 else [group]
        for index in range(4):
            h = chain_hash(family, index)
            result = self._step("get_cached_block",
                                lambda s, h=h: model.get_cached_block(s, h, groups),  # type: ignore[misc]
                                lambda h=h: self.target.get_cached_block(h, groups))  # type: ignore[misc]
            assert result is not None
            expected, actual = result
            expected_list = None if expected is None else list(expected)
            assert actual == expected_list, f"get_cached_block({family}, {index}, {groups}): " \
                f"target {actual}, spec {expected_list}"
            if expected is None:
                break
            hits.append(expected[groups.index(group)])
            if len(groups) > 1:
                event("hit across two groups")
        if len(groups) == 1:
            self._check_prefix_lookup(family, group, hits, data.draw(st.integers(0, 5)))
        if hits:
            was_free = [b for b in hits if self.spec.ref[b] == 0]
            if was_free:
                event("hit on a free (evictable) block")
            if any(self.spec.ref[b] > 0 for b in hits):
                event("hit on a block in use (shared)")
            self._step("touch", lambda s: model.touch(s, hits), lambda: self.target.touch(hits))
        n = data.draw(st.integers(0, 4))
        free_before = model.num_free(self.spec)
        evicting = [b for b in self.spec.free[:n] if self.spec.key_of[b] is not None]
        result = self._step("get_new_blocks", lambda s: model.get_new_blocks(s, n),
                            lambda: self.target.get_new_blocks(n))
        if result is None:
            event("allocation refused: pool exhausted")
            if hits:
                self._release(hits)
            return
        expected, actual = result
        assert actual == list(expected), f"get_new_blocks({n}): target {actual}, spec {expected}"
        assert pool_invariants.allocated_blocks_are_fresh(self.target_state(), tuple(actual)), \
            f"invariant allocated_blocks_are_fresh violated by the target for {actual}"
        if n and n == free_before:
            event("allocation took every free block")
        if evicting:
            event("allocation evicted a cached block")
        holding = Holding(family, group, hits + list(expected), len(hits), lora_id,
                          self._new_uid())
        self.holdings.append(holding)
        if data.draw(st.booleans()):
            self._cache(holding, len(holding.blocks))

    def _check_prefix_lookup(self, family: int, group: int, hits: list[int],
                             max_blocks: int) -> None:
        """The bulk lookup (where the target has one) is get_cached_block to the first miss."""
        hashes = [chain_hash(family, index) for index in range(4)]
        actual = self.target.get_cached_prefix(hashes, group, max_blocks)
        if actual is not None:
            assert actual == hits[:max_blocks], (
                f"get_cached_prefix({family}, group {group}, max {max_blocks}): target "
                f"{actual}, spec {hits[:max_blocks]}")

    def _release(self, blocks: list[int]) -> None:
        order = list(reversed(blocks))
        self._step("free_blocks", lambda s: model.free_blocks(s, order),
                   lambda: self.target.free_blocks(order))

    @precondition(lambda self: self.holdings)
    @rule(data=st.data())
    def cache_full_blocks(self, data: st.DataObject) -> None:
        """A request's newly full blocks get their chain keys (null blocks skipped)."""
        holding = data.draw(st.sampled_from(self.holdings))
        if holding.num_cached >= len(holding.blocks):
            return
        self._cache(holding, data.draw(st.integers(holding.num_cached + 1, len(holding.blocks))))

    def _cache(self, holding: Holding, num_full: int) -> None:
        if holding.num_cached >= num_full:
            return
        hashes = [chain_hash(holding.family, i) for i in range(len(holding.blocks))]
        tokens = [t for i in range(holding.num_cached, num_full)
                  for t in chain_tokens(holding.family, i)]
        blocks, num_cached = list(holding.blocks), holding.num_cached
        if any(self.spec.key_of[b] is not None for b in blocks[num_cached:num_full]
               if b != NULL_BLOCK):
            return  # a hit block below num_full: caching it again is a bad call, made elsewhere
        if not self.spec.enable_caching:
            situation = "cache_full_blocks with caching off"
        elif NULL_BLOCK in blocks[num_cached:num_full]:
            situation = "cache_full_blocks over a null block"
        elif num_cached and self.spec.key_of[blocks[num_cached - 1]] is None:
            situation = "cache_full_blocks after an unkeyed block"  # null, or evicted
        else:
            situation = "cache_full_blocks"
        if not self._allows(situation):
            return
        self._step(
            "cache_full_blocks",
            lambda s: model.cache_full_blocks(s, blocks, hashes, num_cached, num_full,
                                              holding.group, tokens, BLOCK_SIZE, holding.lora_id),
            lambda: self.target.cache_full_blocks(blocks, hashes, num_cached, num_full,
                                                  holding.group, tokens, BLOCK_SIZE,
                                                  holding.lora_id))
        holding.num_cached = num_full
        if NULL_BLOCK in blocks[num_cached:num_full]:
            event("cached a range with a null block in it")
        if len(dict(self.spec.cached).get(model.make_key(hashes[num_full - 1], holding.group),
                                          ())) > 1:
            event("same key cached in two blocks")

    @precondition(lambda self: self.holdings)
    @rule(data=st.data())
    def slide_window(self, data: st.DataObject) -> None:
        """A sliding-window request drops its oldest block for the null block."""
        holding = data.draw(st.sampled_from(self.holdings))
        real = [i for i, b in enumerate(holding.blocks) if b != NULL_BLOCK]
        if not real:
            return
        index = real[0]
        block = holding.blocks[index]
        holding.blocks[index] = NULL_BLOCK
        self._step("free_blocks", lambda s: model.free_blocks(s, [block]),
                   lambda: self.target.free_blocks([block]))
        event("block replaced by the null block")

    @precondition(lambda self: self.holdings)
    @rule(data=st.data(), reverse=st.sampled_from([True, True, True, False]))
    def finish_request(self, data: st.DataObject, reverse: bool) -> None:
        """A request ends: its blocks are freed, chain tail first (or, rarely, head first)."""
        holding = data.draw(st.sampled_from(self.holdings))
        self.holdings.remove(holding)
        order = list(reversed(holding.blocks)) if reverse else list(holding.blocks)
        self._step("free_blocks", lambda s: model.free_blocks(s, order),
                   lambda: self.target.free_blocks(order))
        if NULL_BLOCK in order:
            event("freed a list with the null block in it")
        if model.num_free(self.spec) == self.spec.num_blocks - 1:
            event("pool fully free")

    @rule(data=st.data())
    def evict_blocks(self, data: st.DataObject) -> None:
        """A KV connector evicts some blocks' keys."""
        ids = data.draw(st.sets(st.integers(0, self.spec.num_blocks - 1), max_size=3))
        # The same set object for both: the eviction order is the set's iteration order.
        self._step("evict_blocks", lambda s: model.evict_blocks(s, ids),
                   lambda: self.target.evict_blocks(ids))

    @rule(attempt=st.integers(0, 3))
    def reset_prefix_cache(self, attempt: int) -> None:
        """Reset the prefix cache (as after a weight update); tried on a quarter of draws."""
        if attempt:
            return
        result = self._step("reset_prefix_cache", model.reset_prefix_cache,
                            self.target.reset_prefix_cache)
        assert result is not None
        expected, actual = result
        assert actual == expected, f"reset_prefix_cache: target {actual}, spec {expected}"
        event(f"reset {'succeeded' if expected else 'refused: blocks in use'}")

    @precondition(lambda self: not self.consumer_stalls)
    @rule()
    def take_events(self) -> None:
        result = self._step("take_events", model.take_events, self.target.take_events)
        assert result is not None
        expected, actual = result
        self.target_taken += tuple(actual)
        assert actual == list(expected), f"take_events: target {actual}, spec {list(expected)}"

    @rule(data=st.data())
    def bad_call(self, data: st.DataObject) -> None:
        """Calls the pool must refuse, leaving its state exactly as it was."""
        s = self.spec
        n = s.num_blocks
        kind = data.draw(st.sampled_from(BAD_CALLS))
        if not self._allows(f"bad call: {kind}"):
            return
        if kind == "free unreferenced":
            candidates = [b for b in range(1, n) if s.ref[b] == 0]
            if not candidates:
                return
            b = data.draw(st.sampled_from(candidates))
            held = [h.blocks[0] for h in self.holdings if h.blocks and h.blocks[0]][:1]
            ids = held + [b]
            self._refuse(kind, lambda s: model.free_blocks(s, ids),
                         lambda: self.target.free_blocks(ids))
        elif kind in ("free outside pool", "touch outside pool"):
            outside = data.draw(st.sampled_from([n, n + 1, 10_000, -1]))
            ids = [outside]
            if kind.startswith("free"):
                self._refuse(kind, lambda s: model.free_blocks(s, ids),
                             lambda: self.target.free_blocks(ids))
            else:
                self._refuse(kind, lambda s: model.touch(s, ids), lambda: self.target.touch(ids))
        elif kind == "alloc negative":
            self._refuse(kind, lambda s: model.get_new_blocks(s, -1),
                         lambda: self.target.get_new_blocks(-1))
        elif kind == "alloc too many":
            k = model.num_free(s) + data.draw(st.integers(1, 3))
            self._refuse(kind, lambda s: model.get_new_blocks(s, k),
                         lambda: self.target.get_new_blocks(k))
        elif kind == "cache a keyed block":
            keyed = [b for b in range(1, n) if s.key_of[b] is not None]
            if not keyed:
                return
            block = data.draw(st.sampled_from(keyed))
            h = [chain_hash(NUM_FAMILIES, 0)]
            self._refuse(kind,
                         lambda s: model.cache_full_blocks(s, [block], h, 0, 1, 0, (0, 0),
                                                           BLOCK_SIZE),
                         lambda: self.target.cache_full_blocks([block], h, 0, 1, 0, [0, 0],
                                                               BLOCK_SIZE, None))
        elif kind in ("evict outside pool", "evict negative id"):
            evicted = {data.draw(st.integers(n, n + 3)) if kind == "evict outside pool" else -1}
            evicted |= {b for b in range(1, n) if s.key_of[b] is not None}  # all or none
            self._refuse(kind, lambda s: model.evict_blocks(s, evicted),
                         lambda: self.target.evict_blocks(evicted))
        elif kind == "malformed hash":
            bad: Any = data.draw(st.sampled_from(["not bytes", 12345, None]))
            if not s.enable_caching:
                return
            blocks = [b for b in range(1, n) if s.key_of[b] is None][:1]
            via_cache = data.draw(st.booleans())
            if blocks and via_cache:
                self._refuse(kind,
                             lambda s: model.cache_full_blocks(s, blocks, [bad], 0, 1, 0, (0, 0),
                                                               BLOCK_SIZE),
                             lambda: self.target.cache_full_blocks(blocks, [bad], 0, 1, 0,
                                                                   [0, 0], BLOCK_SIZE, None))
            else:
                self._refuse(kind, lambda s: model.get_cached_block(s, bad, [0]),
                             lambda: self.target.get_cached_block(bad, [0]))

    def _refuse(self, name: str, spec_call: Callable[[PoolState], Any],
                target_call: Callable[[], Any]) -> None:
        try:
            spec_call(self.spec)
        except PoolError as refused:
            self._expect_refusal(name, refused, target_call)
            return
        raise AssertionError(f"bad call {name!r} is not refused by the spec")

    # -- checks after every step ---------------------------------------------------------
    # Hypothesis runs invariants in name order: the named invariants (on the target's state,
    # then on the spec's) come before the whole-state comparison, so a broken invariant is
    # reported by name.

    def _target_view(self) -> PoolView:
        if self._view is None or self._view[0] != self._version:
            self._view = (self._version, self.target.view())
        return self._view[1]

    def target_state(self) -> PoolState:
        """The target's state, through the abstraction function, in the spec's terms."""
        key = (self._version, len(self.target_taken), id(self.spec))
        if self._state is None or self._state[0] != key:
            view = self._target_view()
            self._state = (key, replace(
                self.spec, ref=view.ref, free=view.free, key_of=view.key_of, cached=view.cached,
                events=self.target_taken + view.pending_events, num_taken=len(self.target_taken)))
        return self._state[1]

    @invariant()
    def matches_spec_counts(self) -> None:
        free, usage = self.target.get_num_free_blocks(), self.target.get_usage()
        assert free == model.num_free(self.spec), \
            f"get_num_free_blocks: target {free}, spec {model.num_free(self.spec)}"
        assert abs(usage - model.usage(self.spec)) < 1e-12, \
            f"get_usage: target {usage}, spec {model.usage(self.spec)}"

    @invariant()
    def matches_spec_event_collapses(self) -> None:
        """The pool's count of collapses into a snapshot (where it keeps one) is the spec's."""
        actual = self.target.event_collapses()
        if self.spec.num_collapses:
            event("pending events collapsed into a snapshot")
        assert actual is None or actual == self.spec.num_collapses, \
            f"event collapses: target {actual}, spec {self.spec.num_collapses}"

    @invariant()
    def matches_spec_state(self) -> None:
        actual, expected = self._target_view(), view_of(self.spec)
        if actual != expected:
            note(f"target: {actual}\nspec:   {expected}")
        assert actual.free == expected.free, \
            f"free order: target {actual.free}, spec {expected.free}"
        assert actual.ref == expected.ref, f"ref counts: target {actual.ref}, spec {expected.ref}"
        assert actual.key_of == expected.key_of, "block keys differ"
        assert actual.cached == expected.cached, "cached map differs"
        assert actual.pending_events == expected.pending_events, \
            f"pending events: target {actual.pending_events}, spec {expected.pending_events}"


def _add_named_invariants(cls: type[PoolMachine]) -> None:
    """One @invariant per predicate of spec.pool_invariants, checked on the target's state."""
    for predicate in pool_invariants.ALL:
        def check(self: PoolMachine, predicate: Any = predicate) -> None:
            # On the target's state only: the spec's must equal it (matches_spec_state), and
            # the spec itself is checked exhaustively (explore.py) and by CrossHair.
            if not predicate(self.target_state()):
                broken = pool_invariants.violated(self.target_state())
                raise AssertionError(f"invariants violated by the target: {', '.join(broken)}")
        check.__name__ = f"invariant_{predicate.__name__}"
        check.__doc__ = predicate.__doc__
        setattr(cls, check.__name__, invariant()(check))


_add_named_invariants(PoolMachine)


def machine_for(make_target: Callable[[], PoolTarget],
                profile: Profile = Profile.V0_13) -> type[PoolMachine]:
    """A PoolMachine subclass that checks targets made by make_target against profile."""
    return type("PoolConformance", (PoolMachine,),
                {"make_target": staticmethod(make_target), "profile": profile})
