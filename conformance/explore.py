"""Exhaustive small scope: every reachable pool state, breadth first, for tiny pools.

From a fresh pool, apply every `spec.pool` command of a small alphabet (allocate 1 or 2, free
one or two blocks in either order, touch a block, key a block with one of two keys, evict a block,
reset, drain events) to every state reached so far, up to a depth bound. Every invariant is
checked in every state; each distinct state is kept with one shortest trace that reaches it,
and those traces can be replayed against a target to compare every step with the spec.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import permutations

from kvspec.conformance.lockstep import Lockstep
from kvspec.conformance.targets import VllmApiPool, view_of
from kvspec.spec import pool as model, pool_invariants
from kvspec.spec.pool import BlockId, PoolState, Profile

Trace = tuple[model.PoolCommand, ...]

MAX_REF = 2  # touch stops here, so ref counts stay bounded and the space finite


def key_hash(key_index: int) -> bytes:
    return hashlib.sha256(f"kvspec-explore:{key_index}".encode()).digest()


def cache_command(block: BlockId, key_index: int) -> model.CacheFullBlocks:
    """Key one block with one of the alphabet's keys, in group 0."""
    return model.CacheFullBlocks((block,), (key_hash(key_index),), 0, 1, 0, (key_index,) * 2, 2)


def enabled_ops(state: PoolState, num_keys: int) -> Iterator[model.PoolCommand]:
    """Every command of the alphabet that the spec accepts in state."""
    blocks = range(1, state.num_blocks)
    used = [b for b in blocks if state.ref[b] > 0]
    for n in (1, 2):
        if n <= model.num_free(state):
            yield model.GetNewBlocks(n)
    for b in used:
        yield model.FreeBlocks((b,))
    for pair in permutations(used, 2):
        yield model.FreeBlocks(pair)
    for b in blocks:
        if state.ref[b] < MAX_REF:
            yield model.Touch((b,))
        if state.enable_caching and state.key_of[b] is None:
            for k in range(num_keys):
                yield cache_command(b, k)
        if state.key_of[b] is not None:
            yield model.EvictBlocks((b,))
    yield model.ResetPrefixCache()
    if len(state.events) > state.num_taken:
        yield model.TakeEvents()


def _core(state: PoolState) -> tuple[object, ...]:
    """A state up to its event history: two states equal here have the same futures."""
    return (state.ref, state.free, state.key_of, state.cached)


@dataclass
class Exploration:
    states: int
    transitions: int
    depth_reached: int
    traces: list[Trace]  # one shortest trace per state


def explore(num_blocks: int, num_keys: int = 2, max_depth: int = 8,
            enable_events: bool = True, profile: Profile = Profile.V0_13,
            check: Callable[[PoolState], list[str]] = pool_invariants.violated) -> Exploration:
    """Breadth-first search of the spec's reachable states; fails on any broken invariant."""
    start = model.new_pool(num_blocks, True, enable_events, profile)
    seen: dict[tuple[object, ...], Trace] = {_core(start): ()}
    frontier: list[tuple[PoolState, Trace]] = [(start, ())]
    transitions = depth = 0
    while frontier and depth < max_depth:
        depth += 1
        next_frontier = []
        for state, trace in frontier:
            for op in enabled_ops(state, num_keys):
                successor = model.step(state, op)[0]
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


def maximal_traces(traces: list[Trace]) -> list[Trace]:
    """The traces that are not a prefix of another: replaying them visits every state."""
    prefixes = {trace[:i] for trace in traces for i in range(len(trace))}
    return [trace for trace in traces if trace not in prefixes]


def replay(trace: Trace, adapter: VllmApiPool, num_blocks: int, enable_events: bool = True,
           profile: Profile = Profile.V0_13) -> None:
    """Run a trace on the spec and a target in lock step, comparing every output and state."""
    lockstep: Lockstep[PoolState] = Lockstep(model.step, adapter)
    lockstep(model.NewPool(num_blocks, True, enable_events, None, profile))
    for number, command in enumerate(trace, 1):
        where = f"step {number} ({command}) of {[str(c) for c in trace]}"
        try:
            lockstep(command)
        except AssertionError as error:
            raise AssertionError(f"{where}: {error}") from error
        assert lockstep.state is not None
        assert adapter.view() == view_of(lockstep.state), \
            f"{where}: target {adapter.view()}, spec {view_of(lockstep.state)}"
