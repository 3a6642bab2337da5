"""Exhaustive small scope: every reachable pool state, breadth first, for tiny pools.

From a fresh pool, apply every operation of a small alphabet (allocate 1 or 2, free one or
two blocks in either order, touch a block, key a block with one of two keys, evict a block,
reset, drain events) to every state reached so far, up to a depth bound. Every invariant is
checked in every state; each distinct state is kept with one shortest trace that reaches it,
and those traces can be replayed against a target to compare every step with the spec.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import permutations

from kvspec.spec import pool as model, pool_invariants
from kvspec.spec.conformance.targets import PoolTarget, view_of
from kvspec.spec.pool import NULL_BLOCK, PoolState, Profile

MAX_REF = 2  # touch stops here, so ref counts stay bounded and the space finite


def key_hash(key_index: int) -> bytes:
    return hashlib.sha256(f"kvspec-explore:{key_index}".encode()).digest()


@dataclass(frozen=True)
class Op:
    """One operation of the exploration alphabet, applicable to the spec or a target."""

    kind: str
    args: tuple[int, ...] = ()

    def __str__(self) -> str:
        return f"{self.kind}{self.args}"

    def apply(self, state: PoolState) -> PoolState:
        a = self.args
        if self.kind == "alloc":
            return model.get_new_blocks(state, a[0])[0]
        if self.kind == "free":
            return model.free_blocks(state, a)
        if self.kind == "touch":
            return model.touch(state, a)
        if self.kind == "cache":
            return model.cache_full_blocks(state, [a[0]], [key_hash(a[1])], 0, 1, 0, (a[1],) * 2, 2)
        if self.kind == "evict":
            return model.evict_blocks(state, a)
        if self.kind == "reset":
            return model.reset_prefix_cache(state)[0]
        if self.kind == "take":
            return model.take_events(state)[0]
        raise LookupError(f"unknown operation {self.kind!r}")

    def run_on(self, target: PoolTarget) -> object:
        """Perform the operation on a target; returns its output (None for the mutators)."""
        a = self.args
        if self.kind == "alloc":
            return target.get_new_blocks(a[0])
        if self.kind == "reset":
            return target.reset_prefix_cache()
        if self.kind == "take":
            return target.take_events()
        if self.kind == "free":
            target.free_blocks(list(a))
        elif self.kind == "touch":
            target.touch(list(a))
        elif self.kind == "cache":
            target.cache_full_blocks([a[0]], [key_hash(a[1])], 0, 1, 0, [a[1]] * 2, 2, None)
        elif self.kind == "evict":
            target.evict_blocks(set(a))
        else:
            raise LookupError(f"unknown operation {self.kind!r}")
        return None


def enabled_ops(state: PoolState, num_keys: int) -> Iterator[Op]:
    """Every operation of the alphabet that is valid in state."""
    blocks = range(1, state.num_blocks)
    used = [b for b in blocks if state.ref[b] > 0]
    for n in (1, 2):
        if n <= model.num_free(state):
            yield Op("alloc", (n,))
    for b in used:
        yield Op("free", (b,))
    for pair in permutations(used, 2):
        yield Op("free", pair)
    for b in blocks:
        if state.ref[b] < MAX_REF:
            yield Op("touch", (b,))
        if state.enable_caching and state.key_of[b] is None:
            for k in range(num_keys):
                yield Op("cache", (b, k))
        if state.key_of[b] is not None:
            yield Op("evict", (b,))
    yield Op("reset")
    if len(state.events) > state.num_taken:
        yield Op("take")


def _core(state: PoolState) -> tuple[object, ...]:
    """A state up to its event history: two states equal here have the same futures."""
    return (state.ref, state.free, state.key_of, state.cached)


@dataclass
class Exploration:
    states: int
    transitions: int
    depth_reached: int
    traces: list[tuple[Op, ...]]  # one shortest trace per state


def explore(num_blocks: int, num_keys: int = 2, max_depth: int = 8,
            enable_events: bool = True, profile: Profile = Profile.V0_13,
            check: Callable[[PoolState], list[str]] = pool_invariants.violated) -> Exploration:
    """Breadth-first search of the spec's reachable states; fails on any broken invariant."""
    start = model.new_pool(num_blocks, True, enable_events, profile)
    seen: dict[tuple[object, ...], tuple[Op, ...]] = {_core(start): ()}
    frontier: list[tuple[PoolState, tuple[Op, ...]]] = [(start, ())]
    transitions = depth = 0
    while frontier and depth < max_depth:
        depth += 1
        next_frontier = []
        for state, trace in frontier:
            for op in enabled_ops(state, num_keys):
                successor = op.apply(state)
                transitions += 1
                broken = check(successor)
                if broken:
                    raise AssertionError(
                        f"invariants {broken} broken after {[str(o) for o in trace + (op,)]}")
                key = _core(successor)
                if key not in seen:
                    seen[key] = trace + (op,)
                    next_frontier.append((successor, trace + (op,)))
        frontier = next_frontier
    return Exploration(len(seen), transitions, depth, list(seen.values()))


def maximal_traces(traces: list[tuple[Op, ...]]) -> list[tuple[Op, ...]]:
    """The traces that are not a prefix of another: replaying them visits every state."""
    prefixes = {trace[:i] for trace in traces for i in range(len(trace))}
    return [trace for trace in traces if trace not in prefixes]


def replay(trace: tuple[Op, ...], target: PoolTarget, num_blocks: int,
           enable_events: bool = True, profile: Profile = Profile.V0_13) -> None:
    """Run a trace on the spec and a target together, comparing every output and state."""
    state = model.new_pool(num_blocks, True, enable_events, profile)
    target.build(num_blocks, True, enable_events)
    for step, op in enumerate(trace, 1):
        expected_output: object = None
        if op.kind == "alloc":
            state, allocated = model.get_new_blocks(state, op.args[0])
            expected_output = list(allocated)
        elif op.kind == "reset":
            state, ok = model.reset_prefix_cache(state)
            expected_output = ok
        elif op.kind == "take":
            state, taken = model.take_events(state)
            expected_output = list(taken)
        else:
            state = op.apply(state)
        output = op.run_on(target)
        where = f"step {step} ({op}) of {[str(o) for o in trace]}"
        if expected_output is not None:
            assert output == expected_output, f"{where}: target {output}, spec {expected_output}"
        assert target.view() == view_of(state), \
            f"{where}: target {target.view()}, spec {view_of(state)}"
        assert NULL_BLOCK not in target.view().free, where
