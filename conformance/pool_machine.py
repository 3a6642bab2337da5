"""The block-pool conformance machine: drive a target and the spec side by side, every step.

Rules are what a serving engine does with a pool: admit a request (look up its cached
prefix, touch the hits, allocate the rest), cache its full blocks, slide its window, finish
it (free its blocks, chain tail first), evict from a KV connector, reset the prefix cache,
drain events, and make bad calls (one rule per kind: the pool must refuse each with a typed
error and change nothing). Every call is a `spec.pool` command run on both through
`lockstep.Lockstep`, so outputs and refusals are compared as they happen; after every step
the target's abstract state (`PoolView`) must equal the spec's and every named invariant of
`spec.pool_invariants` must hold on it. A running request's blocks flow between rules as a
`Held` value in the ``held`` Bundle. Pools are tiny (2-16 blocks) and keys few, so
exhaustion, eviction, duplicate keys and hits on free blocks happen all the time.

Under an eviction policy (`spec.eviction`, ``machine_for(..., policy=...)``) the machine
also does what the policy offers: requests carry retention hints per token range, priorities
are set, the clock advances, blocks are pinned and unpinned, and the policy's bad calls are
made; its invariants (`pool_invariants.pinned_blocks_stay_cached`, `no_expired_priority`, ...)
hold after every step, and `evicted_lowest_priority_first` judges every allocation's output.

`machine_for(make_adapter)` builds a TestCase class for any pool adapter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from hypothesis import event, note, strategies as st
from hypothesis.stateful import (
    Bundle,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from kvspec.conformance.lockstep import Refused
from kvspec.conformance.machine import LockstepMachine, bad_call
from kvspec.conformance.targets import PoolView, VllmApiPool, view_of
from kvspec.spec import event_consumer, pool as model, pool_invariants
from kvspec.spec.eviction import Policy, TokenRangeRetention
from kvspec.spec.pool import NULL_BLOCK, PoolState, Profile

BLOCK_SIZE = 2
NUM_FAMILIES = 2  # distinct prompt prefixes: few, so that keys repeat
GROUPS = (0, 1)
# Bounds on pending events (kvspec's pool; a target without them gets None): small, so that
# collapses into a snapshot happen within a program.
EVENT_BOUNDS = st.sampled_from([None, None, 1, 2, 3, 6])


# Retention hints a request may carry (read under ``priority``; block i holds tokens
# [2i, 2i + 2)): none, a kept system prompt, a demoted tail, a short-lived hot range.
HINTS = st.sampled_from([
    (),
    (TokenRangeRetention(0, 2, 90),),
    (TokenRangeRetention(0, 2, 80), TokenRangeRetention(2, None, 10, 3)),
    (TokenRangeRetention(0, None, 60, 2),),
    (TokenRangeRetention(2, 6, 0),),
    (TokenRangeRetention(0, None, 20), TokenRangeRetention(0, 4, 70, 3)),  # overlapping
])


def chain_hash(family: int, index: int) -> bytes:
    """The block hash of block ``index`` of prompt family ``family``: a stand-in chain, short
    and readable in a counterexample (a pool takes any bytes as a block hash)."""
    return f"family{family}-block{index}".encode()


def chain_tokens(family: int, index: int) -> tuple[int, ...]:
    return (family * 1000 + index,) * BLOCK_SIZE


@dataclass(frozen=True)
class Held:
    """One running request's blocks in one KV-cache group (a value of the ``held`` Bundle)."""

    uid: int
    family: int
    group: int
    blocks: tuple[int, ...]
    lora_id: int | None = None
    retention: tuple[TokenRangeRetention, ...] = ()


class PoolMachine(LockstepMachine[PoolState]):
    """Runs a pool adapter against `spec.pool`; ``machine_for`` sets the adapter. Every step
    runs under the step deadline (`deadline.BoundedSteps`)."""

    spec_step = staticmethod(model.step)
    view_of = staticmethod(view_of)
    check_representation_each_step = False  # target_representation, the last invariant
    profile: Profile = Profile.V0_13
    policy: Policy | None = None  # the profile's when None
    max_blocks = 16  # the largest pool drawn (a policy's machine: 8, for more eviction)
    held = Bundle("held")

    def __init__(self) -> None:
        super().__init__()
        self.before_allocation: PoolState | None = None  # the target's, for the judge
        self.num_cached: dict[int, int] = {}  # Held.uid -> blocks keyed so far
        self.next_uid = 0
        self.taken: tuple[model.Event, ...] = ()  # every event take_events handed out
        self.just_allocated: tuple[int, ...] = ()  # checked by allocated_blocks_are_fresh
        self.consumer_stalls = False  # drawn by build: nobody takes events

    def bad_calls_now(self) -> bool:
        """Bad-call rules are enabled on one step in three (by the commands run so far), so
        that nine of them do not crowd out what an engine does."""
        return self.every(3)

    def maintenance_now(self) -> bool:
        """A policy's machine runs a KV connector's evictions and resets on one step in
        three, so that requests (admitted, cached, finished) fill the programs and blocks
        of different priorities meet at allocation; the lru machine runs them every step."""
        return self.policy is None or self.every(3, 1)

    # -- set-up --------------------------------------------------------------------------

    @initialize(
        num_blocks=st.integers(2, 16),  # scaled into [2, max_blocks] by build
        enable_caching=st.sampled_from([True, True, True, False]),
        enable_events=st.booleans(),
        event_bound=EVENT_BOUNDS,
        consumer_stalls=st.booleans(),
    )
    def build(self, num_blocks: int, enable_caching: bool, enable_events: bool,
              event_bound: int | None, consumer_stalls: bool) -> None:
        if not self.adapter.supports_event_bound():
            event_bound = None  # vLLM's pools keep every event
        num_blocks = 2 + (num_blocks - 2) * (self.max_blocks - 2) // 14
        # With a bound, the consumer may stall (take_events is never called): events then
        # pile up to collapses over a cache with blocks in it.
        self.consumer_stalls = consumer_stalls and event_bound is not None
        self.lockstep(model.NewPool(num_blocks, enable_caching, enable_events, event_bound,
                                    self.profile, self.policy))
        event(f"pool size {'<=4' if num_blocks <= 4 else '5-8' if num_blocks <= 8 else '9-16'}")

    # -- rules: what a serving engine does -----------------------------------------------

    @rule(target=held, family=st.integers(0, NUM_FAMILIES - 1),
          group=st.sampled_from((0, 0, 0, 1)), both_groups=st.sampled_from([False] * 3 + [True]),
          lora_id=st.sampled_from([None, None, 7]), num_new=st.integers(0, 4),
          max_prefix=st.integers(0, 5), cache_now=st.booleans(), hints=HINTS)
    def admit_request(self, family: int, group: int, both_groups: bool, lora_id: int | None,
                      num_new: int, max_prefix: int, cache_now: bool,
                      hints: tuple[TokenRangeRetention, ...]) -> Any:
        """Look up the cached prefix, touch the hits, allocate the rest (may exhaust the pool),
        and maybe key its full blocks at once (a prompt that fills its blocks)."""
        groups = GROUPS if both_groups else (group,)
        hits: list[int] = []
        for index in range(4):
            found = self.lockstep(model.GetCachedBlock(chain_hash(family, index), groups))
            if found is None:
                break
            hits.append(found[groups.index(group)])
            if len(groups) > 1:
                event("hit across two groups")
        if len(groups) == 1:
            hashes = tuple(chain_hash(family, index) for index in range(4))
            self.lockstep(model.GetCachedPrefix(hashes, group, max_prefix))
        if hits:
            if any(self.spec.ref[b] == 0 for b in hits):
                event("hit on a free (evictable) block")
            if any(self.spec.ref[b] > 0 for b in hits):
                event("hit on a block in use (shared)")
            self.lockstep(model.Touch(tuple(hits)))
        free_before = model.num_free(self.spec)
        if any(self.spec.key_of[b] is not None for b in model.eviction_order(self.spec)[:num_new]):
            event("allocation evicts a cached block")
        if self.spec.retention and model.eviction_order(self.spec) != self.spec.free:
            event("priority reorders eviction")
        if self.spec.policy.has_priorities:  # the judge's only input: no view read otherwise
            self.before_allocation = self.target_state()
        allocated = self.lockstep(model.GetNewBlocks(num_new))
        self.before_allocation = None
        if isinstance(allocated, Refused):
            event("allocation refused: pool exhausted")
            if hits:
                self.lockstep(model.FreeBlocks(tuple(reversed(hits))))
            return multiple()
        self.just_allocated = allocated
        if num_new and num_new == free_before:
            event("allocation took every free block")
        self.next_uid += 1
        self.num_cached[self.next_uid] = len(hits)
        held = Held(self.next_uid, family, group, tuple(hits) + allocated, lora_id, hints)
        if cache_now:
            self.invariant_allocated_blocks_are_fresh()  # before caching keys them
            self._cache(held, len(held.blocks))
        return held

    @rule(held=held, more=st.integers(0, 7))
    def cache_full_blocks(self, held: Held, more: int) -> None:
        """Some of a request's blocks became full: key them with their chain hashes (null
        blocks skipped)."""
        num_cached = self.num_cached[held.uid]
        if num_cached >= len(held.blocks):
            return
        self._cache(held, num_cached + 1 + more % (len(held.blocks) - num_cached))

    def _cache(self, held: Held, num_full: int) -> None:
        num_cached, blocks = self.num_cached[held.uid], held.blocks
        if num_cached >= num_full:
            return
        if any(self.spec.key_of[b] is not None for b in blocks[num_cached:num_full]
               if b != NULL_BLOCK) and not self._all_promotable(blocks, num_cached, num_full):
            return  # a hit block below num_full: caching it again is a bad call, made elsewhere
        if not self.spec.enable_caching:
            situation = "cache_full_blocks with caching off"
        elif NULL_BLOCK in blocks[num_cached:num_full]:
            situation = "cache_full_blocks over a null block"
        elif num_cached and self.spec.key_of[blocks[num_cached - 1]] is None:
            situation = "cache_full_blocks after an unkeyed block"  # null, or evicted
        else:
            situation = "cache_full_blocks"
        if not self.allows(situation):
            return
        hashes = tuple(chain_hash(held.family, i) for i in range(len(blocks)))
        tokens = tuple(t for i in range(num_cached, num_full)
                       for t in chain_tokens(held.family, i))
        self.lockstep(model.CacheFullBlocks(blocks, hashes, num_cached, num_full, held.group,
                                            tokens, BLOCK_SIZE, held.lora_id, held.retention))
        self.num_cached[held.uid] = num_full
        if NULL_BLOCK in blocks[num_cached:num_full]:
            event("cached a range with a null block in it")
        key = model.make_key(hashes[num_full - 1], held.group)
        if len(dict(self.spec.cached).get(key, ())) > 1:
            event("same key cached in two blocks")

    def _all_promotable(self, blocks: tuple[int, ...], num_cached: int, num_full: int) -> bool:
        """0.33: every keyed block of the range holds a partial entry for a shorter prefix
        (cache_full_blocks promotes it); never under 0.13."""
        if not self.spec.profile.multi_key_blocks:
            return False
        return all(self.spec.key_of[b] is None
                   or model.promotable(self.spec, b, (i + 1) * BLOCK_SIZE)
                   for i, b in enumerate(blocks[:num_full])
                   if i >= num_cached and b != NULL_BLOCK)

    @rule(target=held, held=consumes(held))
    def slide_window(self, held: Held) -> Held:
        """A sliding-window request drops its oldest block for the null block."""
        real = [i for i, b in enumerate(held.blocks) if b != NULL_BLOCK]
        if not real:
            return held
        index = real[0]
        self.lockstep(model.FreeBlocks((held.blocks[index],)))
        event("block replaced by the null block")
        blocks = held.blocks[:index] + (NULL_BLOCK,) + held.blocks[index + 1:]
        return replace(held, blocks=blocks)

    @rule(held=consumes(held), reverse=st.sampled_from([True, True, True, False]))
    def finish_request(self, held: Held, reverse: bool) -> None:
        """A request ends: its blocks are freed, chain tail first (or, rarely, head first)."""
        order = tuple(reversed(held.blocks)) if reverse else held.blocks
        self.lockstep(model.FreeBlocks(order))
        del self.num_cached[held.uid]
        if NULL_BLOCK in order:
            event("freed a list with the null block in it")
        if model.num_free(self.spec) == self.spec.num_blocks - 1:
            event("pool fully free")

    @precondition(maintenance_now)
    @rule(block_ids=st.lists(st.integers(0, 15), max_size=3, unique=True))
    def evict_blocks(self, block_ids: list[int]) -> None:
        """A KV connector evicts some blocks' keys."""
        n = self.spec.num_blocks
        self.lockstep(model.EvictBlocks(tuple(dict.fromkeys(b % n for b in block_ids))))

    def idle_policy_pool(self) -> bool:
        """A policy's pool with no block in use: an idle engine, when an operator resets the
        prefix cache (after a weight update). Its machine resets whenever it finds one, so
        that the blocks' retention priorities and pins meet a reset; rarely otherwise."""
        return (self.built and self.policy is not None
                and not any(self.spec.ref[b] for b in range(1, self.spec.num_blocks)))

    @precondition(lambda self: self.maintenance_now() or self.idle_policy_pool())
    @rule(attempt=st.integers(0, 3))
    def reset_prefix_cache(self, attempt: int) -> None:
        """Reset the prefix cache (as after a weight update); tried on a quarter of draws
        (every draw on an idle policy pool)."""
        if attempt and not self.idle_policy_pool():
            return
        had_priorities = bool(self.spec.retention)
        done = self.lockstep(model.ResetPrefixCache())
        event(f"reset {'succeeded' if done else 'refused: blocks in use'}")
        if done and had_priorities:
            event("reset dropped retention priorities")

    # -- rules: what an eviction policy offers (spec.eviction) ---------------------------

    def _has_priorities(self) -> bool:
        return self.built and self.spec.policy.has_priorities

    def _has_pins(self) -> bool:
        return self.built and self.spec.policy.has_pins

    @precondition(_has_priorities)
    @rule(pick=st.integers(0, 15), count=st.integers(1, 2),
          priority=st.sampled_from([0, 10, 35, 60, 100]),
          duration=st.sampled_from([None, None, 1, 3]))
    def set_retention(self, pick: int, count: int, priority: int, duration: int | None) -> None:
        """Re-prioritise cached blocks (a client's retention call: demote or keep)."""
        keyed = self._keyed()
        if not keyed:
            return
        chosen = tuple(keyed[(pick + i) % len(keyed)] for i in range(min(count, len(keyed))))
        if any(self.spec.ref[b] == 0 for b in chosen):
            event("priority of a free block changed")
        self.lockstep(model.SetRetention(tuple(dict.fromkeys(chosen)), priority, duration))

    @precondition(lambda self: (self._has_priorities() or self._has_pins())
                  and self.maintenance_now())
    @rule(delta=st.sampled_from([0, 1, 1, 2, 5]))
    def advance_clock(self, delta: int) -> None:
        """Time passes: priorities whose expiry has come revert to the default."""
        live = len(self.spec.retention)
        self.lockstep(model.AdvanceClock(self.spec.now + delta))
        if len(self.spec.retention) < live:
            event("a priority expired")

    @precondition(_has_pins)
    @rule(pick=st.integers(0, 15), count=st.integers(1, 3))
    def pin_blocks(self, pick: int, count: int) -> None:
        """Pin cached blocks (a system prompt): refused over the cap."""
        candidates = [b for b in self._keyed() if b not in self.spec.pinned]
        if not candidates:
            return
        chosen = tuple(dict.fromkeys(candidates[(pick + i) % len(candidates)]
                                     for i in range(count)))
        if any(self.spec.ref[b] == 0 for b in chosen):
            event("pinned a free block")
        output = self.lockstep(model.PinBlocks(chosen))
        event("pin refused: over the cap" if isinstance(output, Refused) else "pinned")

    @precondition(lambda self: self._has_pins() and bool(self.spec.pinned))
    @rule(pick=st.integers(0, 15))
    def unpin_blocks(self, pick: int) -> None:
        """Unpin a pinned block: it is evictable again once nobody holds it."""
        block = self.spec.pinned[pick % len(self.spec.pinned)]
        self.lockstep(model.UnpinBlocks((block,)))
        if self.spec.ref[block] == 0:
            event("unpinned block became free")

    @precondition(lambda self: not self.consumer_stalls)
    @rule()
    def take_events(self) -> None:
        """A consumer (a KV-aware router) takes the pending events."""
        self.taken += self.lockstep(model.TakeEvents())

    # -- rules: bad calls, each refused with a typed error and no change ------------------

    @bad_call(bad_calls_now, pick=st.integers(0, 15))
    def bad_free_unreferenced(self, pick: int) -> None:
        """Free a block in use together with a free one: nothing may be released."""
        candidates = [b for b in range(1, self.spec.num_blocks) if self.spec.ref[b] == 0]
        if not candidates:
            return
        in_use = [b for b in range(1, self.spec.num_blocks) if self.spec.ref[b] > 0][:1]
        self.refuse(model.FreeBlocks(tuple(in_use) + (candidates[pick % len(candidates)],)))

    @bad_call(bad_calls_now, offset=st.sampled_from([0, 1, 10_000, -1]))
    def bad_free_outside_pool(self, offset: int) -> None:
        self.refuse(model.FreeBlocks((self._outside(offset),)))

    @bad_call(bad_calls_now, offset=st.sampled_from([0, 1, 10_000, -1]))
    def bad_touch_outside_pool(self, offset: int) -> None:
        self.refuse(model.Touch((self._outside(offset),)))

    def _outside(self, offset: int) -> int:
        return -1 if offset < 0 else self.spec.num_blocks + offset

    @bad_call(bad_calls_now)
    def bad_alloc_negative(self) -> None:
        self.refuse(model.GetNewBlocks(-1))

    @bad_call(bad_calls_now, extra=st.integers(1, 3))
    def bad_alloc_too_many(self, extra: int) -> None:
        self.refuse(model.GetNewBlocks(model.num_free(self.spec) + extra))

    @bad_call(bad_calls_now, pick=st.integers(0, 15))
    def bad_cache_keyed_block(self, pick: int) -> None:
        """Key a block that already has a key."""
        keyed = [b for b in range(1, self.spec.num_blocks) if self.spec.key_of[b] is not None]
        if not keyed:
            return
        block = keyed[pick % len(keyed)]
        self.refuse(model.CacheFullBlocks((block,), (chain_hash(NUM_FAMILIES, 0),), 0, 1, 0,
                                           (0, 0), BLOCK_SIZE))

    @bad_call(bad_calls_now, offset=st.integers(0, 3))
    def bad_evict_outside_pool(self, offset: int) -> None:
        """Evict an id outside the pool beside every keyed block: all or none."""
        self.refuse(model.EvictBlocks((self.spec.num_blocks + offset, *self._keyed())))

    @bad_call(bad_calls_now)
    def bad_evict_negative_id(self) -> None:
        self.refuse(model.EvictBlocks((-1, *self._keyed())))

    def _keyed(self) -> tuple[int, ...]:
        return tuple(b for b in range(1, self.spec.num_blocks) if self.spec.key_of[b] is not None)

    @bad_call(bad_calls_now, bad=st.sampled_from(["not bytes", 12345, None]),
              via_cache=st.booleans())
    def bad_malformed_hash(self, bad: Any, via_cache: bool) -> None:
        """A block hash that is not bytes, in a lookup or in cache_full_blocks."""
        if not self.spec.enable_caching:
            return
        unkeyed = [b for b in range(1, self.spec.num_blocks) if self.spec.key_of[b] is None]
        if unkeyed and via_cache:
            self.refuse(model.CacheFullBlocks((unkeyed[0],), (bad,), 0, 1, 0, (0, 0),
                                               BLOCK_SIZE))
        else:
            self.refuse(model.GetCachedBlock(bad, (0,)))

    @bad_call(bad_calls_now, _has_priorities, priority=st.sampled_from([-1, 101, 35]),
              unkeyed=st.booleans())
    def bad_retention(self, priority: int, unkeyed: bool) -> None:
        """A priority out of [0, 100], or one for a block without a key."""
        blocks = [b for b in range(1, self.spec.num_blocks) if self.spec.key_of[b] is None]
        if priority == 35 and not blocks:
            return
        target = blocks[:1] if priority == 35 or unkeyed else list(self._keyed()[:1])
        self.refuse(model.SetRetention(tuple(target), priority))

    @bad_call(bad_calls_now, lambda self: self._has_priorities() or self._has_pins())
    def bad_clock_backwards(self) -> None:
        if self.spec.now:
            self.refuse(model.AdvanceClock(self.spec.now - 1))

    @bad_call(bad_calls_now, _has_pins,
              kind=st.sampled_from(["unkeyed", "twice", "listed twice"]))
    def bad_pin(self, kind: str) -> None:
        """Pin a block without a key, a pinned block, or one block listed twice."""
        if kind == "unkeyed":
            blocks = [b for b in range(self.spec.num_blocks) if self.spec.key_of[b] is None]
            self.refuse(model.PinBlocks((blocks[0],)))
        elif kind == "twice" and self.spec.pinned:
            self.refuse(model.PinBlocks(self.spec.pinned[:1]))
        elif self._keyed():
            self.refuse(model.PinBlocks(self._keyed()[:1] * 2))

    @bad_call(bad_calls_now, _has_pins)
    def bad_unpin(self) -> None:
        """Unpin a block that is not pinned."""
        unpinned = [b for b in range(1, self.spec.num_blocks) if b not in self.spec.pinned]
        if unpinned:
            self.refuse(model.UnpinBlocks((unpinned[0],)))

    # Whenever a block is pinned (not one step in three): pins are rare in tiny pools.
    @bad_call(lambda self: self._has_pins() and bool(self.spec.pinned), evict=st.booleans())
    def bad_free_pinned(self, evict: bool) -> None:
        """Free a pinned block as often as it is referenced (the pin's reference too), or
        evict a pinned block: both refused."""
        pinned = self.spec.pinned
        if not pinned:
            return
        if evict:
            self.refuse(model.EvictBlocks(pinned[:1]))
        else:
            self.refuse(model.FreeBlocks(pinned[:1] * self.spec.ref[pinned[0]]))

    # -- checks after every step ---------------------------------------------------------

    def judge(self, command: Any, output: Any) -> None:
        """The target's own output of an allocation, judged by name before it is compared."""
        before = self.before_allocation
        if isinstance(command, model.GetNewBlocks) and before is not None:
            assert pool_invariants.evicted_lowest_priority_first(before, tuple(output)), (
                f"invariant evicted_lowest_priority_first violated by the target: it took "
                f"{tuple(output)} from free blocks {before.free} (retention "
                f"{before.retention})")
    # Hypothesis runs invariants in name order: the named invariants (on the target's state)
    # come before the whole-state comparison, so a broken invariant is reported by name.

    def state_from_view(self, view: PoolView) -> PoolState:
        state = replace(self.spec, ref=view.ref, free=view.free, key_of=view.key_of,
                        cached=view.cached, events=self.taken + view.pending_events,
                        num_taken=len(self.taken), now=view.now, retention=view.retention,
                        pinned=view.pinned)
        if self.profile is Profile.V0_33:  # 0.33's parts of the state: the target's
            state = replace(state, partial_keys=view.partial_keys, fired=view.fired,
                            forwarded=view.forwarded)
        return state

    @invariant()
    def invariant_allocated_blocks_are_fresh(self) -> None:
        """Blocks get_new_blocks just returned have ref count 1 and no key."""
        allocated, self.just_allocated = self.just_allocated, ()
        assert pool_invariants.allocated_blocks_are_fresh(self.target_state(), allocated), \
            f"invariant allocated_blocks_are_fresh violated by the target for {allocated}"

    @invariant()
    def matches_spec_counts(self) -> None:
        if not self.built:
            return
        free = self.adapter.perform(model.GetNumFreeBlocks())
        usage = self.adapter.perform(model.GetUsage())
        assert free == model.num_free(self.spec), \
            f"get_num_free_blocks: target {free}, spec {model.num_free(self.spec)}"
        assert isinstance(usage, float) and abs(usage - model.usage(self.spec)) < 1e-12, \
            f"get_usage: target {usage}, spec {model.usage(self.spec)}"

    @invariant()
    def matches_spec_event_collapses(self) -> None:
        """The pool's count of collapses into a snapshot (where it keeps one) is the spec's."""
        if not self.built:
            return
        actual = self.adapter.event_collapses()
        if self.spec.num_collapses:
            event("pending events collapsed into a snapshot")
        assert actual is None or actual == self.spec.num_collapses, \
            f"event collapses: target {actual}, spec {self.spec.num_collapses}"

    @invariant()
    def matches_spec_state(self) -> None:
        if not self.built:
            return
        actual, expected = self.target_view(), view_of(self.spec)
        if actual != expected:
            note(f"target: {actual}\nspec:   {expected}")
        assert actual.free == expected.free, \
            f"free order: target {actual.free}, spec {expected.free}"
        assert actual.ref == expected.ref, f"ref counts: target {actual.ref}, spec {expected.ref}"
        assert actual.key_of == expected.key_of, "block keys differ"
        assert actual.cached == expected.cached, "cached map differs"
        assert actual.pending_events == expected.pending_events, \
            f"pending events: target {actual.pending_events}, spec {expected.pending_events}"
        assert (actual.now, actual.retention, actual.pinned) == (
            expected.now, expected.retention, expected.pinned), (
            f"policy state (clock, retention, pinned): target "
            f"{(actual.now, actual.retention, actual.pinned)}, spec "
            f"{(expected.now, expected.retention, expected.pinned)}")
        assert actual.partial_keys == expected.partial_keys, \
            f"partial entries: target {actual.partial_keys}, spec {expected.partial_keys}"
        assert actual.fired == expected.fired, \
            f"reuse watchers fired: target {actual.fired}, spec {expected.fired}"
        assert actual.forwarded == expected.forwarded, \
            f"frees forwarded: target {actual.forwarded}, spec {expected.forwarded}"


    @invariant()
    def target_representation(self) -> None:
        """The target's own representation invariant (impl's
        ``BlockPool.check_representation()``), last: a bug the spec's named invariants see is
        reported by name first."""
        if self.built:
            self.adapter.check_representation()


# The bad-call rules: each must be refused with a typed error, changing nothing.
BAD_CALLS = tuple(sorted(PoolMachine.bad_call_rules))
# Situations vLLM's own callers never create (its KV-cache managers guard them): an audit
# with --scope contract leaves them out.
OUT_OF_CONTRACT = PoolMachine.bad_call_rules | {"cache_full_blocks with caching off"}

# The spec's own states are checked exhaustively (explore.py) and by CrossHair; here the
# target's, which the spec's must equal (matches_spec_state).
PoolMachine.add_invariants(pool_invariants.ALL)
PoolMachine.add_invariants(event_consumer.ALL)  # a router's view


WATCHED_TWICE = "unpin_blocks of a block with a pending watcher"


class PoolMachine033(PoolMachine):
    """The pool machine under the vllm-0.33 profile: the rules of `PoolMachine` plus 0.33's
    new operations (partial entries and their promotion, copy-on-write re-pointing, reuse
    watchers, writability, reports of reused blocks, frees forwarded to a foreign owner),
    and 0.33's invariants (`pool_invariants.V0_33`). Each new rule runs only where the target
    has the method; its discrepancies are named situations, so an audit reports one and goes
    on. The 0.13 machine is left as it was: none of this costs its steps anything."""

    profile = Profile.V0_33

    def __init__(self) -> None:
        super().__init__()
        self.state_before: PoolState | None = None  # the spec's, before the current step
        self.watched_twice = False  # a block has had two watchers pending at once
        step = self.lockstep.step

        def recording(state: Any, command: Any) -> tuple[Any, Any]:
            self.state_before = state
            return step(state, command)

        self.lockstep.step = recording

    def _can(self, name: str) -> bool:
        return self.built and self.adapter.has_method(name)

    def judge(self, command: Any, output: Any) -> None:
        super().judge(command, output)
        before = self.state_before
        if isinstance(command, model.GetNewBlocks) and before is not None and before.watchers:
            event("a watched block may be handed out")
            after = self.target_state()
            self._blame_watched_twice(after.fired)
            assert pool_invariants.watched_blocks_fire_when_handed_out(
                before, tuple(output), after), (
                f"invariant watched_blocks_fire_when_handed_out violated by the target: it "
                f"handed out {tuple(output)} with watchers {before.watchers} pending; fired "
                f"{after.fired}")

    def _blame_watched_twice(self, fired: tuple[tuple[int, int], ...]) -> None:
        """A firing that differs after a block was watched twice is that situation's: an
        audit reports it once and stops watching a block twice."""
        if self.watched_twice and fired != self.spec.fired:
            self.situation = WATCHED_TWICE

    @invariant()
    def matches_spec_state(self) -> None:
        if self.built:
            self._blame_watched_twice(self.target_view().fired)
        PoolMachine.matches_spec_state(self)

    def _hashes(self, held: Held) -> tuple[bytes, ...]:
        return tuple(chain_hash(held.family, i) for i in range(len(held.blocks)))

    @precondition(lambda self: self._can("cache_partial_block") and self.spec.enable_caching)
    @rule(held=PoolMachine.held, index=st.integers(0, 7), prefix=st.integers(0, 7),
          replace_existing=st.sampled_from([False, False, False, True]),
          beside_key=st.booleans())
    def cache_partial_block(self, held: Held, index: int, prefix: int,
                            replace_existing: bool, beside_key: bool) -> None:
        """Make one of a request's blocks reachable from a prefix boundary (a hybrid Mamba
        group's partial hit): a primary key, a partial entry beside one (``beside_key``: on
        a keyed block, at the first boundary), or a promotion."""
        if not held.blocks:
            return
        keyed = [b for b in held.blocks if b != NULL_BLOCK and self.spec.key_of[b] is not None]
        if beside_key and keyed:
            block, prefix = keyed[index % len(keyed)], 0
        else:
            block = held.blocks[index % len(held.blocks)]
        num_hash_blocks = 1 + prefix % len(held.blocks)
        num_tokens = num_hash_blocks * BLOCK_SIZE
        covered = model.key_tokens_of(self.spec, block) if block != NULL_BLOCK else None
        if block == NULL_BLOCK:
            situation = "cache_partial_block on the null block"
        elif replace_existing:
            situation = "cache_partial_block replacing a block's keys"
        elif self.spec.key_of[block] is None:
            situation = "cache_partial_block on a block without a key"
        elif covered is not None and covered < num_tokens:
            situation = "cache_partial_block promoting a block's key"
        else:
            situation = "cache_partial_block beside a primary key"
        if not self.allows(situation):
            return
        tokens = chain_tokens(held.family, num_hash_blocks - 1)
        self.lockstep(model.CachePartialBlock(block, self._hashes(held), num_tokens, held.group,
                                              BLOCK_SIZE, BLOCK_SIZE, tokens, held.lora_id,
                                              replace_existing))
        event(situation)
        if block != NULL_BLOCK and model.partials_of(self.spec, block):
            event("a block with partial entries")

    @precondition(lambda self: self._can("move_block_hashes") and model.num_free(self.spec) > 0)
    @rule(held=PoolMachine.held, index=st.integers(0, 7))
    def move_block_hashes(self, held: Held, index: int) -> None:
        """Copy-on-write: the request keeps writing one of its keyed blocks, so the prefix
        cache's keys move to a fresh private copy, which is then released to the cache."""
        if not held.blocks:
            return
        block = held.blocks[index % len(held.blocks)]
        if block == NULL_BLOCK or self.spec.key_of[block] is None:
            return
        if not self.allows("move_block_hashes"):
            return
        copy = self.lockstep(model.GetNewBlocks(1))
        if isinstance(copy, Refused):
            return
        self.lockstep(model.MoveBlockHashes(block, copy[0]))
        self.lockstep(model.FreeBlocks(copy))
        event("keys moved to a copy" + (" with partial entries" if model.partials_of(
            self.spec, copy[0]) else ""))

    @precondition(lambda self: self._can("cache_partial_block"))
    @rule(held=consumes(PoolMachine.held))
    def unpin_blocks(self, held: Held) -> None:
        """A reader releases a request's blocks but keeps reading them until the pool reuses
        them (HiSparse): unpin_blocks(blocks, on_reuse), chain tail first."""
        blocks = tuple(b for b in reversed(held.blocks) if b != NULL_BLOCK)
        del self.num_cached[held.uid]
        watched = {b for b, _ in self.spec.watchers}
        situation = WATCHED_TWICE if watched & set(blocks) else "unpin_blocks"
        if not blocks or not self.allows(situation):
            self.lockstep(model.FreeBlocks(tuple(reversed(held.blocks))))
            return
        self.lockstep(model.UnpinWithWatcher(blocks))
        self.watched_twice = self.watched_twice or situation == WATCHED_TWICE
        event(situation)

    @precondition(lambda self: self._can("is_block_writable"))
    @rule(pick=st.integers(0, 15))
    def is_block_writable(self, pick: int) -> None:
        block = pick % self.spec.num_blocks
        if self.lockstep(model.IsBlockWritable(block)) is True:
            event("a writable block")

    @precondition(lambda self: self._can("emit_cached_block_events"))
    @rule(held=PoolMachine.held)
    def emit_cached_block_events(self, held: Held) -> None:
        """Report mode "full": the request's cached prefix is announced again."""
        num_cached = min(self.num_cached.get(held.uid, 0), len(held.blocks))
        tokens = tuple(t for i in range(num_cached) for t in chain_tokens(held.family, i))
        self.lockstep(model.EmitCachedBlockEvents(self._hashes(held), num_cached, BLOCK_SIZE,
                                                  held.group, tokens, held.lora_id))

    @precondition(lambda self: self._can("cache_partial_block"))
    @rule(held=consumes(PoolMachine.held),
          foreign=st.lists(st.integers(1, 3), min_size=1, max_size=3))  # 0: its null
    def free_with_foreign_blocks(self, held: Held, foreign: list[int]) -> None:
        """A request whose table mixes this pool's blocks with another pool's (deferred
        frees across pools) ends: the foreign blocks go to their owner."""
        del self.num_cached[held.uid]
        if not self.allows("free_blocks forwarding foreign blocks"):
            self.lockstep(model.FreeBlocks(tuple(reversed(held.blocks))))
            return
        self.lockstep(model.FreeWithForeign(tuple(reversed(held.blocks)), tuple(foreign)))
        event("freed a table with another pool's blocks (forwarded)")


PoolMachine033.add_invariants(pool_invariants.V0_33)


def machine_for(make_adapter: Callable[[], VllmApiPool],
                profile: Profile = Profile.V0_13,
                policy: Policy | None = None) -> type[PoolMachine]:
    """A PoolMachine subclass that checks adapters made by make_adapter against profile
    (and an eviction policy: the profile's when None); under vllm-0.33 (and no other
    policy), with 0.33's operations (`PoolMachine033`)."""
    small = policy is not None and policy.name.value in ("priority", "pinned")
    base = PoolMachine033 if profile is Profile.V0_33 and policy is None else PoolMachine
    return base.for_target(make_adapter, profile=profile, policy=policy,
                           max_blocks=8 if small else 16)
