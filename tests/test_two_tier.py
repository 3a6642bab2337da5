"""The two-tier spec (spec/two_tier.py): each refusal, each invariant, an exhaustive small scope.

The exploration runs every command of a small alphabet (a GPU pool of 2 blocks plus the null
block, a CPU tier of 1 or 2 keys, 2 block hashes) breadth-first from an empty state to a depth
bound, on every state reached: each reached state keeps every invariant, and each refused
command raises a typed error and leaves its state as it was. The pool keeps every event it
ever emitted, so the space never closes: the depth bound is what ends it. The planted bugs
show each invariant can fail.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, replace

import pytest

from kvspec.spec import offload as O, pool as P, two_tier as T
from kvspec.spec.two_tier import TwoTierState

B0, B1 = T.block_hash_of(0), T.block_hash_of(1)


def run(*commands: T.Command, blocks: int = 3, capacity: int = 2) -> TwoTierState:
    state = T.step(None, T.NewTwoTier(blocks, capacity))[0]
    for command in commands:
        state = T.step(state, command)[0]
        assert T.violated(state) == [], command
    return state


def cache(block: int, key: int) -> T.Gpu:
    """Key GPU block ``block`` with CPU key ``key``'s content (one token, block size 1)."""
    return T.Gpu(P.CacheFullBlocks((block,), (T.block_hash_of(key),), 0, 1, T.GROUP, (key,), 1))


ALLOC = T.Gpu(P.GetNewBlocks(1))


def refused(state: TwoTierState, command: T.Command, error: type[Exception]) -> None:
    before = state
    with pytest.raises(error):
        T.step(state, command)
    assert state == before and T.violated(state) == []
    assert issubclass(error, ValueError | LookupError)


# --- The key mapping ----------------------------------------------------------------------------


def test_a_cpu_key_is_the_external_hash_of_its_gpu_key() -> None:
    for key in (0, 1, 2**64 - 1):
        assert P.external_hash(T.gpu_key(key)) == key
    for bad in (-1, 2**64):
        with pytest.raises(T.BadTwoTierKey):
            T.gpu_key(bad)


# --- Each refusal -------------------------------------------------------------------------------


def test_store_refusals() -> None:
    state = run(ALLOC, ALLOC, cache(1, 0))
    refused(state, T.StartStore("a", (1,), (-1,)), T.BadTwoTierKey)
    refused(state, T.StartStore("a", (1, 2), (0,)), T.BadTransfer)
    refused(state, T.StartStore("a", (1, 1), (0, 1)), T.BadTransfer)
    refused(state, T.StartStore("a", (), ()), T.BadTransfer)
    refused(state, T.StartStore("a", (0,), (0,)), T.BadTransfer)
    refused(state, T.StartStore("a", (9,), (0,)), T.UnknownBlock)
    refused(state, T.StartStore("a", (2,), (1,)), T.BlockHoldsNoData)  # no key
    refused(state, T.StartStore("a", (1,), (1,)), T.KeyMismatch)
    freed = T.step(state, T.Gpu(P.FreeBlocks((1,))))[0]  # keyed, but free
    refused(freed, T.StartStore("a", (1,), (0,)), T.BlockHoldsNoData)


def test_load_refusals() -> None:
    state = run(ALLOC, ALLOC, cache(1, 0), T.StartStore("a", (1,), (0,)))
    refused(state, T.StartLoad("b", (0,), (2,)), O.StoreNotComplete)  # pending: a refusal
    refused(state, T.StartLoad("b", (1,), (2,)), O.UnknownOffloadKey)
    refused(state, T.StartLoad("b", (0,), (1,)), T.DestinationNotFresh)  # holds a key
    state = T.step(state, T.FinishTransfer(0))[0]
    freed = T.step(state, T.Gpu(P.FreeBlocks((2,))))[0]
    refused(freed, T.StartLoad("b", (0,), (2,)), T.DestinationNotFresh)  # free
    loading = T.step(state, T.StartLoad("b", (0,), (2,)))[0]
    assert T.violated(loading) == []
    refused(loading, T.StartLoad("c", (0,), (2,)), T.BlockInTransfer)
    refused(loading, T.FinishTransfer(1), T.UnknownTransfer)
    refused(loading, T.FinishTransfer(-1), T.UnknownTransfer)


def test_gpu_commands_cannot_break_a_transfer() -> None:
    storing = run(ALLOC, ALLOC, cache(1, 0), T.StartStore("a", (1,), (0,)))
    assert storing.gpu.ref[1] == 2  # the request's reference and the store's hold
    state = T.step(storing, T.Gpu(P.FreeBlocks((1,))))[0]  # the request lets go
    refused(state, T.Gpu(P.FreeBlocks((1,))), T.HoldReleased)  # the hold is the transfer's
    refused(state, T.Gpu(P.GetNewBlocks(2)), P.NotEnoughFree)  # block 1 is not free
    state = T.step(state, T.FinishTransfer(0))[0]
    assert 1 in state.gpu.free and T.violated(state) == []
    loading = T.step(state, T.StartLoad("b", (0,), (2,)))[0]
    refused(loading, cache(2, 1), T.HoldReleased)  # a load's target cannot be keyed


def test_commands_outside_the_model() -> None:
    state = run()
    refused(state, T.Gpu(P.NewPool(3)), T.NotATwoTierCommand)
    refused(state, T.Gpu(P.EmitCachedBlockEvents((B0,), 1, 1, 0)), T.NotATwoTierCommand)
    refused(state, T.Cpu(O.PrepareStore("a", (0,))), T.NotATwoTierCommand)
    refused(state, T.Cpu(O.Reset()), T.NotATwoTierCommand)
    with pytest.raises(T.NotATwoTierCommand):
        T.step(None, T.TakeEvents())


# --- The model at work --------------------------------------------------------------------------


def test_a_store_then_a_load_round_trip() -> None:
    state = run(ALLOC, cache(1, 0), T.StartStore("a", (1,), (0,)), T.FinishTransfer(0),
                T.Gpu(P.FreeBlocks((1,))), T.Gpu(P.EvictBlocks((1,))), ALLOC, ALLOC)
    assert O.ready_keys(state.cpu) == {0} and not T.gpu_copies(state.gpu)
    state = T.step(state, T.StartLoad("b", (0,), (2,)))[0]
    assert T.violated(state) == []
    assert state.cpu.ref[0] == 1 and state.gpu.ref[2] == 2
    state = T.step(state, T.FinishTransfer(0))[0]
    assert state.cpu.ref[0] == 0 and state.gpu.ref[2] == 1 and not state.transfers
    assert T.violated(state) == []


def test_only_the_keys_the_tier_stores_are_copied() -> None:
    state = run(ALLOC, ALLOC, cache(1, 0), cache(2, 1), T.StartStore("a", (1,), (0,)))
    state, output = T.step(state, T.StartStore("b", (1, 2), (0, 1)))
    assert output == ((1,), ()) and state.transfers[-1].block_ids == (2,)
    assert T.violated(state) == []


def test_a_full_tier_stores_nothing() -> None:
    state = run(ALLOC, ALLOC, cache(1, 0), T.StartStore("a", (1,), (0,)), T.FinishTransfer(0),
                T.Gpu(P.FreeBlocks((1,))), T.Gpu(P.EvictBlocks((1,))), T.Gpu(P.GetNewBlocks(1)),
                T.StartLoad("b", (0,), (1,)), cache(2, 1), capacity=1)
    state, output = T.step(state, T.StartStore("c", (2,), (1,)))
    assert output is None and len(state.transfers) == 1 and T.violated(state) == []


def test_a_key_evicted_from_both_tiers_is_in_neither_view() -> None:
    state = run(ALLOC, ALLOC, cache(1, 0), T.StartStore("a", (1,), (0,)), T.FinishTransfer(0),
                T.TakeEvents(), capacity=1)
    assert dict(state.router.gpu.counts) == {0: 1} and state.router.cpu == {0}
    state = run(*(ALLOC, ALLOC, cache(1, 0), T.StartStore("a", (1,), (0,)), T.FinishTransfer(0),
                  T.TakeEvents(), T.Gpu(P.EvictBlocks((1,))), cache(2, 1),
                  T.StartStore("b", (2,), (1,)), T.FinishTransfer(0), T.TakeEvents()),
                capacity=1)
    assert dict(state.router.gpu.counts) == {1: 1} and state.router.cpu == {1}


def test_a_failed_store_leaves_nothing_behind() -> None:
    state = run(ALLOC, cache(1, 0), T.StartStore("a", (1,), (0,)),
                T.FinishTransfer(0, success=False), T.Cpu(O.TakeEvents()))
    assert not state.cpu.refs and not state.router.cpu and state.gpu.ref[1] == 1


# --- Planted bugs: each invariant can fail ------------------------------------------------------


def _storing() -> TwoTierState:
    state = run(ALLOC, ALLOC, cache(1, 0), T.StartStore("a", (1,), (0,)))
    return T.step(state, T.Gpu(P.FreeBlocks((1,))))[0]  # only the store holds block 1


def _loading() -> TwoTierState:
    return run(ALLOC, ALLOC, cache(1, 0), T.StartStore("a", (1,), (0,)), T.FinishTransfer(0),
               T.StartLoad("b", (0,), (2,)))


PLANTED = {
    # The pool frees the store's block behind the transfer's back: it is free, reusable.
    "transfer_blocks_not_reused":
        lambda: replace(s := _storing(), gpu=P.free_blocks(s.gpu, (1,))),
    # The load's target gets a key while it is written.
    "load_destinations_hold_no_key":
        lambda: replace(s := _loading(), gpu=P.cache_full_blocks(s.gpu, (2,), (B1,), 0, 1, 0)),
    # The CPU tier unpins the key a load still reads.
    "loads_read_ready_keys":
        lambda: replace(s := _loading(), cpu=O.complete_load(s.cpu, (0,))),
    # The CPU tier completes a store still in flight.
    "stores_write_pending_keys":
        lambda: replace(s := _storing(), cpu=O.complete_store(s.cpu, (0,), True)),
    # The store is forgotten: its key stays pending forever.
    "pending_keys_have_a_store": lambda: replace(_storing(), transfers=()),
    # The pool's events are taken without reaching the router.
    "router_view_matches_both_tiers":
        lambda: replace(s := _loading(), gpu=P.take_events(s.gpu)[0]),
    # Block 1 (held) put on the free queue.
    "gpu_pool_keeps_its_invariants":
        lambda: replace(s := _loading(), gpu=replace(s.gpu, free=(1,))),
    "cpu_tier_keeps_its_invariants":
        lambda: replace(s := _loading(), cpu=replace(s.cpu, capacity=0)),
}


def test_every_invariant_has_a_planted_bug() -> None:
    assert set(PLANTED) == {inv.__name__ for inv in T.ALL}


@pytest.mark.parametrize("invariant", T.ALL, ids=lambda inv: inv.__name__)
def test_a_planted_bug_breaks_the_invariant(invariant: T.Invariant) -> None:
    bad = PLANTED[invariant.__name__]()
    assert not invariant(bad)
    assert T.violated(bad)


# --- Exhaustive small scope ---------------------------------------------------------------------


def alphabet(blocks: tuple[int, ...] = (1, 2), keys: tuple[int, ...] = (0, 1)
             ) -> tuple[T.Command, ...]:
    commands: list[T.Command] = [ALLOC, T.Gpu(P.TakeEvents()), T.Cpu(O.TakeEvents()),
                                 T.TakeEvents()]
    for b in blocks:
        commands += [T.Gpu(P.FreeBlocks((b,))), T.Gpu(P.EvictBlocks((b,)))]
        for k in keys:
            commands += [cache(b, k), T.StartStore("a", (b,), (k,)),
                         T.StartLoad("a", (k,), (b,))]
    commands += [T.Cpu(O.Touch("a", (k,))) for k in keys]
    commands += [T.FinishTransfer(i, ok) for i in (0, 1) for ok in (True, False)]
    return tuple(commands)


@dataclass(frozen=True)
class Explored:
    states: int
    transitions: int
    refused: int
    seconds: float
    loading: int  # states with a load in flight
    storing: int  # states with a store in flight


REFUSALS = (T.TwoTierError, P.PoolError, O.OffloadError)


def explore(capacity: int, depth: int) -> Explored:
    commands = alphabet()
    start = T.step(None, T.NewTwoTier(3, capacity))[0]
    seen = {start}
    frontier = deque([(start, 0)])
    transitions = refusals = 0
    began = time.perf_counter()
    while frontier:
        state, level = frontier.popleft()
        if level == depth:
            continue
        for command in commands:
            try:
                after = T.step(state, command)[0]
            except REFUSALS as error:
                assert isinstance(error, ValueError | LookupError), (command, error)
                refusals += 1
                continue
            transitions += 1
            if after not in seen:
                assert T.violated(after) == [], (state, command)
                seen.add(after)
                frontier.append((after, level + 1))
    return Explored(len(seen), transitions, refusals, time.perf_counter() - began,
                    sum(any(not t.is_store for t in s.transfers) for s in seen),
                    sum(any(t.is_store for t in s.transfers) for s in seen))


@pytest.mark.parametrize(("capacity", "depth"), [(1, 7), (2, 7)])
def test_every_reachable_two_tier_state_keeps_the_rules(
    capacity: int, depth: int, capsys: pytest.CaptureFixture[str],
) -> None:
    found = explore(capacity, depth)
    with capsys.disabled():
        print(f"\n  explored {found.states} two-tier states ({found.transitions} transitions, "
              f"{found.refused} refused) to depth {depth}: 2 GPU blocks + null, a {capacity}-key "
              f"CPU tier, 2 hashes, {found.seconds:.1f} s")
    assert found.states > 10_000 and found.loading > 0 and found.storing > 0
