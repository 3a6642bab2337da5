"""Exhaustive small scope for the offload tier: every reachable `spec.offload` state.

From an empty tier (``NewOffload(capacity, policy, profile)``), apply every command of a small
alphabet to every state reached so far, breadth first, until no new state appears (closure)
or a depth bound. The alphabet: for requests ``"a"`` and ``"b"`` and every key tuple of
`KEY_TUPLES` (the empty tuple, each key of 0..3, every ordered pair of distinct keys, the
duplicate ``(0, 0)`` and the chain ``(0, 1, 2)``): ``Lookup``, ``PrepareLoad``, ``Touch``,
``CompleteLoad``, ``PrepareStore``, ``CompleteStore`` (success and failure, and a late one
from the generation before a reset), ``RequestFinished``, ``Reset`` and ``TakeEvents``.
Refused commands are in the alphabet too.

On every step: an accepted command's state keeps every invariant (`spec.offload.violated`);
a refused one raises an `OffloadError` (nothing else) and leaves its state as it was; every
``PrepareStore`` keeps the store rules (`spec.offload.store_violations`).

The space is made finite by three bounds, each on what a state may grow without limit:

- the generation counts resets; only "before a reset or not" changes a future (a late
  completion is one from the previous generation), so states are compared with the
  generation capped at 1;
- pins: a successor with a key pinned more than `MAX_PIN` times is checked, not expanded;
- events: a successor holding more than `MAX_EVENTS` untaken events is checked, not expanded
  (``TakeEvents`` drains them; the consumer's `announced` set is part of the state).
"""

from __future__ import annotations

from collections.abc import Container, Iterator
from dataclasses import dataclass, replace
from itertools import permutations

from kvspec.spec import offload as model
from kvspec.spec.offload import Key, OffloadError, OffloadState
from kvspec.spec.pool import Profile

REQUESTS = ("a", "b")
KEYS = (0, 1, 2, 3)
KEY_TUPLES: tuple[tuple[Key, ...], ...] = (
    ((), *((k,) for k in KEYS), *permutations(KEYS, 2), (0, 0), (0, 1, 2)))
MAX_PIN = 2
MAX_EVENTS = 2


def key_tuples(keys: tuple[Key, ...]) -> tuple[tuple[Key, ...], ...]:
    """The key lists the alphabet offers: none, each key, each ordered pair, a key twice and
    (with three keys or more) a chain of three."""
    return ((), *((k,) for k in keys), *permutations(keys, 2), keys[:1] * 2,
            *((keys[:3],) if len(keys) >= 3 else ()))


def alphabet(state: OffloadState, tuples: tuple[tuple[Key, ...], ...] = KEY_TUPLES
             ) -> Iterator[model.Command]:
    """Every command of the alphabet, refused ones included, in state."""
    for keys in tuples:
        yield model.Lookup(keys)
        yield model.Touch("a", keys)
        yield model.CompleteLoad("a", keys)
        yield model.CompleteStore("a", keys, True)
        yield model.CompleteStore("a", keys, False)
        for req in REQUESTS:
            yield model.PrepareLoad(req, keys)
            yield model.PrepareStore(req, keys)
    if state.generation:
        for keys in ((0,), (0, 1)):
            yield model.CompleteStore("a", keys, True, state.generation - 1)
    for req in REQUESTS:
        yield model.RequestFinished(req)
    yield model.Reset()
    yield model.TakeEvents()


def _key(state: OffloadState) -> OffloadState:
    """A state up to what has no effect on its futures: the generation, capped at 1, and what
    a finished request saw, inserted and reused (written, never read again; its store misses
    still count)."""
    requests = tuple((req, replace(access, seen=(), inserted=frozenset(), reused=frozenset())
                      if access.finished else access) for req, access in state.requests)
    return replace(state, generation=min(state.generation, 1), requests=requests)


def _expandable(state: OffloadState) -> bool:
    return (len(state.events) <= MAX_EVENTS
            and all(ref <= MAX_PIN for _, ref in state.refs))


def check_step(state: OffloadState, command: model.Command,
               known: Container[OffloadState] | None = None
               ) -> tuple[OffloadState | None, list[str]]:
    """Run one command; the successor (None when refused) and the rules it broke. The
    invariants are not checked again on a successor whose key is in ``known``: they depend on
    nothing the key leaves out."""
    before = replace(state)
    try:
        successor, output = model.step(state, command)
    except OffloadError:
        broken = []
        if state != before or state.ref != dict(state.refs):
            broken.append("refusal_changes_nothing")
        return None, broken
    broken = [] if known is not None and _key(successor) in known else model.violated(successor)
    if isinstance(command, model.PrepareStore):
        assert output is None or isinstance(output, tuple)
        broken += model.store_violations(state, command, output, successor)
    return successor, broken


@dataclass
class OffloadExploration:
    states: int  # distinct states expanded or reached (generation capped at 1)
    transitions: int  # commands run, refused ones included
    refused: int
    pruned: int  # successors checked but not expanded (pin or event bound)
    depth_reached: int
    closed: bool  # no new state at the last depth: every reachable state within the bounds


def explore(capacity: int, policy: str, profile: Profile, max_depth: int = 64,
            keys: tuple[Key, ...] = KEYS) -> OffloadExploration:
    """Breadth-first search of the tier's reachable states over ``keys``; fails on any broken
    rule."""
    tuples = key_tuples(keys)
    start = model.new_offload(capacity, policy, profile)
    seen: dict[OffloadState, tuple[model.Command, ...]] = {_key(start): ()}
    frontier: list[tuple[OffloadState, tuple[model.Command, ...]]] = [(start, ())]
    transitions = refused = pruned = depth = 0
    while frontier and depth < max_depth:
        depth += 1
        next_frontier = []
        for state, trace in frontier:
            for command in alphabet(state, tuples):
                successor, broken = check_step(state, command, seen)
                transitions += 1
                if broken:
                    program = [model.NewOffload(capacity, policy, profile), *trace, command]
                    raise AssertionError(f"{broken} broken by the last step of {program}")
                if successor is None:
                    refused += 1
                    continue
                if not _expandable(successor):
                    pruned += 1
                    continue
                key = _key(successor)
                if key not in seen:
                    seen[key] = trace + (command,)
                    next_frontier.append((successor, trace + (command,)))
        frontier = next_frontier
    return OffloadExploration(len(seen), transitions, refused, pruned, depth, not frontier)
