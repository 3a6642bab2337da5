"""The SimpleCPUOffload spec (spec/simple_cpu_offload.py): each command and refusal, each
invariant planted false, vLLM #42289 as a model variant without the phase-A pin, and a
breadth-first exploration of a small scope (GPU pool of 2 blocks + null, CPU pool of 2 blocks
+ null, 2 block hashes, 2 requests) that asserts every reached state keeps every invariant and
every refused command raises a typed error and leaves its state as it was. With the pools'
events off the space closes (6,687 states, every one reached by depth 16); depth 10 reaches
3,769 of them (a few seconds on an idle machine: the test bounds the depth, not
the time)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import replace

import pytest

from kvspec.spec import pool as P, simple_cpu_offload as S
from kvspec.spec.simple_cpu_offload import SimpleOffloadState

H0, H1 = b"\x00" * 7 + b"\x01", b"\x00" * 7 + b"\x02"
ALLOC = S.Gpu(P.GetNewBlocks(1))


def cache(block: int, block_hash: bytes) -> S.Gpu:
    """The scheduler keys GPU block ``block`` with ``block_hash`` (one token, block size 1)."""
    return S.Gpu(P.CacheFullBlocks((block,), (block_hash,), 0, 1, S.GROUP, (), 1))


def run(*commands: S.Command, gpu: int = 3, cpu: int = 3) -> SimpleOffloadState:
    state = S.step(None, S.NewSimpleOffload(gpu, cpu))[0]
    for command in commands:
        state = S.step(state, command)[0]
        assert S.violated(state) == [], command
    return state


def offloaded(*hashes: bytes, gpu: int = 3, cpu: int = 3) -> SimpleOffloadState:
    """GPU blocks 1.. keyed with ``hashes``, stored to the CPU pool, the store done, the GPU
    blocks freed: the CPU pool holds each hash in a free, keyed block."""
    commands: list[S.Command] = []
    for i, h in enumerate(hashes, start=1):
        commands += [ALLOC, cache(i, h)]
    ids = tuple(range(1, len(hashes) + 1))
    commands += [S.StartStore("w", ids, hashes), S.FinishTransfer(0),
                 S.Gpu(P.FreeBlocks(ids))]
    return run(*commands, gpu=gpu, cpu=cpu)


def alloc(state: SimpleOffloadState, n: int) -> tuple[SimpleOffloadState, tuple[int, ...]]:
    """The scheduler allocates n GPU blocks (a `Gpu` passthrough): the state and their ids."""
    state, ids = S.pool_step(state, True, P.GetNewBlocks(n))
    assert isinstance(ids, tuple)
    return state, tuple(b for b in ids if isinstance(b, int))


def refused(state: SimpleOffloadState, command: S.Command,
            error: type[Exception]) -> None:
    before = replace(state)
    with pytest.raises(error):
        S.step(state, command)
    assert state == before


# --- Commands ------------------------------------------------------------------------------------


def test_store_allocates_cpu_blocks_holds_sources_and_keys_on_success() -> None:
    state = run(ALLOC, cache(1, H0))
    state, cpu_ids = S.step(state, S.StartStore("r", (1,), (H0,)))
    assert S.violated(state) == []
    assert cpu_ids == (1,) or cpu_ids == (2,)
    assert state.gpu.ref[1] == 2 and state.cpu.ref[cpu_ids[0]] == 1
    assert P.keys_of(state.cpu, cpu_ids[0]) == ()  # half-written: no key yet
    done = S.step(state, S.FinishTransfer(0))[0]
    assert done.transfers == () and done.gpu.ref[1] == 1 and done.cpu.ref[cpu_ids[0]] == 0
    assert P.keys_of(done.cpu, cpu_ids[0]) == (S.key(H0),)
    failed = S.step(state, S.FinishTransfer(0, success=False))[0]
    assert P.keys_of(failed.cpu, cpu_ids[0]) == () and failed.cpu.ref[cpu_ids[0]] == 0


def test_lazy_store_reads_a_free_keyed_block_and_takes_it_off_the_free_queue() -> None:
    state = run(ALLOC, cache(1, H0), S.Gpu(P.FreeBlocks((1,))))
    assert 1 in state.gpu.free
    state = S.step(state, S.StartStore("lazy", (1,), (H0,)))[0]
    assert 1 not in state.gpu.free and state.gpu.ref[1] == 1 and S.violated(state) == []


def test_lookup_pins_the_longest_cached_prefix() -> None:
    state = offloaded(H0)
    cpu_block = P.get_cached_block(state.cpu, H0, (S.GROUP,))
    assert cpu_block is not None and state.cpu.ref[cpu_block[0]] == 0
    after, hit = S.step(state, S.LookupCpuHit("r", (H0, H1)))
    assert hit == cpu_block and after.cpu.ref[hit[0]] == 1 and hit[0] not in after.cpu.free
    assert after.pending == (S.PendingHit("r", hit, (H0,)),)
    miss, nothing = S.step(state, S.LookupCpuHit("r", (H1, H0)))
    assert nothing == () and miss == state


def test_a_second_lookup_releases_the_stale_pin_first() -> None:
    state = S.step(offloaded(H0), S.LookupCpuHit("r", (H0,)))[0]
    again = S.step(state, S.LookupCpuHit("r", (H0,)))[0]
    block = state.pending[0].cpu_block_ids[0]
    assert again.cpu.ref[block] == 1 and len(again.pending) == 1
    gone = S.step(state, S.LookupCpuHit("r", (H1,)))[0]
    assert gone.cpu.ref[block] == 0 and gone.pending == ()


def test_load_repins_the_exact_blocks_releases_phase_a_and_holds_destinations() -> None:
    state = offloaded(H0, H1)
    state = S.step(state, S.LookupCpuHit("r", (H0, H1)))[0]
    hit = state.pending[0].cpu_block_ids
    state = S.step(state, ALLOC)[0]
    dest = next(b for b in (1, 2) if state.gpu.ref[b] == 1)
    state = S.step(state, S.StartLoad("r", (dest,)))[0]  # the scheduler took 1 of 2 blocks
    assert S.violated(state) == [] and state.pending == ()
    assert state.cpu.ref[hit[0]] == 1 and state.cpu.ref[hit[1]] == 0  # the rest released
    assert state.gpu.ref[dest] == 2
    assert state.transfers == (S.Transfer(False, "r", (dest,), hit[:1], (H0,)),)
    state = S.step(state, S.Gpu(P.FreeBlocks((dest,))))[0]  # the request finishes meanwhile
    done = S.step(state, S.FinishTransfer(0))[0]
    assert done.cpu.ref[hit[0]] == 0 and done.gpu.ref[dest] == 0 and S.violated(done) == []


def test_cancel_releases_the_phase_a_pin() -> None:
    state = S.step(offloaded(H0), S.LookupCpuHit("r", (H0,)))[0]
    block = state.pending[0].cpu_block_ids[0]
    done = S.step(state, S.CancelHit("r"))[0]
    assert done.pending == () and done.cpu.ref[block] == 0 and block in done.cpu.free


def test_passthroughs_step_the_pools() -> None:
    state, ids = S.step(run(), S.Gpu(P.GetNewBlocks(2)))
    assert ids == (1, 2) and state.gpu.ref[1] == 1
    state, free = S.step(state, S.Cpu(P.GetNumFreeBlocks()))
    assert free == 2


# --- Refusals ------------------------------------------------------------------------------------


def test_refusals_change_nothing() -> None:
    base = run(ALLOC, cache(1, H0))
    with pytest.raises(S.NotASimpleOffloadCommand):
        S.step(None, S.CancelHit("r"))
    refused(base, S.Gpu(P.NewPool(3)), S.NotASimpleOffloadCommand)
    refused(base, S.StartLoad("r", (1,)), S.NoPendingHit)
    refused(base, S.CancelHit("r"), S.NoPendingHit)
    refused(base, S.StartStore("r", (), ()), S.BadTransfer)
    refused(base, S.StartStore("r", (1,), (H0, H1)), S.BadTransfer)
    refused(base, S.StartStore("r", (0,), (H0,)), S.BadTransfer)
    refused(base, S.StartStore("r", (9,), (H0,)), S.UnknownBlock)
    refused(base, S.StartStore("r", (1,), (H1,)), S.SourceHoldsNoData)
    refused(base, S.StartStore("r", (1,), (b"",)), P.BadHash)
    refused(base, S.LookupCpuHit("r", (b"",)), P.BadHash)
    refused(base, S.FinishTransfer(0), S.UnknownTransfer)
    refused(base, S.Gpu(P.FreeBlocks((2,))), P.NotInUse)
    storing = S.step(base, S.StartStore("r", (1,), (H0,)))[0]
    refused(storing, S.StartStore("r", (1,), (H0,)), S.AlreadyInCpu)
    refused(storing, S.Gpu(P.FreeBlocks((1, 1))), S.HoldReleased)  # drops the store's hold
    refused(storing, S.Gpu(P.EvictBlocks((1,))), S.HoldReleased)  # unkeys its source
    cpu_dest = storing.transfers[0].cpu_block_ids[0]
    refused(storing, S.Cpu(P.FreeBlocks((cpu_dest,))), S.HoldReleased)
    refused(storing, S.Cpu(P.CacheFullBlocks((cpu_dest,), (H1,), 0, 1, 0, (), 1)),
            S.HoldReleased)  # keys a half-written block
    stored = S.step(storing, S.FinishTransfer(0))[0]
    refused(stored, S.StartStore("r", (1,), (H0,)), S.AlreadyInCpu)
    refused(run(ALLOC, cache(1, H0), gpu=3, cpu=1), S.StartStore("r", (1,), (H0,)),
            P.NotEnoughFree)


def test_load_refusals_change_nothing() -> None:
    state = S.step(offloaded(H0, H1), S.LookupCpuHit("r", (H0, H1)))[0]
    block = state.pending[0].cpu_block_ids[0]
    refused(state, S.Cpu(P.FreeBlocks((block,))), S.HoldReleased)
    refused(state, S.Cpu(P.EvictBlocks((block,))), S.HoldReleased)
    refused(state, S.StartLoad("r", (1,)), S.DestinationNotFresh)  # block 1 is free
    keyed = run(ALLOC, cache(1, H0), S.StartStore("w", (1,), (H0,)), S.FinishTransfer(0),
                S.LookupCpuHit("r", (H0,)))
    refused(keyed, S.StartLoad("r", (1,)), S.DestinationNotFresh)  # block 1 is keyed
    state, ids = alloc(state, 2)
    refused(state, S.StartLoad("r", ids + ids[:1]), S.BadTransfer)
    refused(state, S.StartLoad("r", ()), S.BadTransfer)
    loading = S.step(state, S.StartLoad("r", ids[:1]))[0]
    refused(loading, S.Gpu(cache(ids[0], H0).command), S.HoldReleased)  # keys a load target
    refused(loading, S.Gpu(P.FreeBlocks((ids[0], ids[0]))), S.HoldReleased)
    again = S.step(loading, S.LookupCpuHit("r", (H1,)))[0]
    refused(again, S.StartLoad("r", ids[1:]), S.LoadInFlight)
    other = S.step(loading, S.LookupCpuHit("q", (H1,)))[0]
    refused(other, S.StartLoad("q", ids[:1]), S.BlockInTransfer)
    three = S.step(offloaded(H0, H1), S.LookupCpuHit("r", (H0,)))[0]
    three, more = alloc(three, 2)
    refused(three, S.StartLoad("r", more), S.BadTransfer)  # 2 destinations, a 1-block hit


# --- Each invariant can fail ---------------------------------------------------------------------


def _loading() -> SimpleOffloadState:
    state = S.step(offloaded(H0, H1), S.LookupCpuHit("r", (H0,)))[0]
    state = S.step(state, S.Gpu(P.GetNewBlocks(1)))[0]
    dest = next(b for b in (1, 2) if state.gpu.ref[b] == 1)
    return run_from(state, S.StartLoad("r", (dest,)), S.LookupCpuHit("q", (H1,)))


def run_from(state: SimpleOffloadState, *commands: S.Command) -> SimpleOffloadState:
    for command in commands:
        state = S.step(state, command)[0]
    assert S.violated(state) == []
    return state


def _storing() -> SimpleOffloadState:
    return run(ALLOC, cache(1, H0), S.StartStore("r", (1,), (H0,)))


def test_pinned_cpu_hits_stay_cached_can_fail() -> None:
    state = _loading()
    hit = state.pending[0].cpu_block_ids[0]
    unpinned = replace(state, cpu=P.free_blocks(state.cpu, (hit,)))
    assert not S.pinned_cpu_hits_stay_cached(unpinned)
    unkeyed = replace(state, cpu=P.evict_blocks(state.cpu, (hit,)))
    assert not S.pinned_cpu_hits_stay_cached(unkeyed)
    assert "pinned_cpu_hits_stay_cached" in S.violated(unkeyed)


def test_transfer_gpu_blocks_not_reused_can_fail() -> None:
    state = _storing()
    dropped = replace(state, gpu=P.free_blocks(state.gpu, (1, 1)))
    assert not S.transfer_gpu_blocks_not_reused(dropped)
    assert {"transfer_gpu_blocks_not_reused", "holds_are_accounted"} <= set(S.violated(dropped))


def test_store_destinations_unkeyed_until_done_can_fail() -> None:
    state = _storing()
    dest = state.transfers[0].cpu_block_ids[0]
    early = replace(state, cpu=P.cache_full_blocks(state.cpu, (dest,), (H0,), 0, 1, 0))
    assert S.violated(early) == ["store_destinations_unkeyed_until_done"]


def test_load_destinations_unkeyed_until_done_can_fail() -> None:
    state = _loading()
    dest = state.transfers[0].gpu_block_ids[0]
    early = replace(state, gpu=P.cache_full_blocks(state.gpu, (dest,), (H0,), 0, 1, 0))
    assert S.violated(early) == ["load_destinations_unkeyed_until_done"]


def test_store_sources_keep_their_key_can_fail() -> None:
    state = _storing()
    unkeyed = replace(state, gpu=P.evict_blocks(state.gpu, (1,)))
    assert S.violated(unkeyed) == ["store_sources_keep_their_key"]


def test_holds_are_accounted_can_fail() -> None:
    state = _loading()
    hit = state.transfers[0].cpu_block_ids[0]
    doubled = replace(state, transfers=state.transfers * 2)  # two loads, one reference
    assert not S.holds_are_accounted(doubled)
    assert S.pinned_cpu_hits_stay_cached(doubled) and doubled.cpu.ref[hit] == 1


def test_pool_invariants_are_checked_on_each_pool() -> None:
    state = _storing()
    bad_gpu = replace(state, gpu=replace(state.gpu, free=state.gpu.free + state.gpu.free[:1]))
    bad_cpu = replace(state, cpu=replace(state.cpu, ref=(1,) + state.cpu.ref[1:]))
    assert not S.gpu_pool_keeps_its_invariants(bad_gpu)
    assert "gpu.free_order_has_no_duplicates" in S.violated(bad_gpu)
    assert not S.cpu_pool_keeps_its_invariants(bad_cpu)
    assert "cpu.ref_counts_nonnegative" in S.violated(bad_cpu)


# --- vLLM #42289: phase A without the pin --------------------------------------------------------

Stepper = Callable[[SimpleOffloadState, S.Command], tuple[SimpleOffloadState, object]]


def step_without_phase_a_pin(state: SimpleOffloadState, command: S.Command
                             ) -> tuple[SimpleOffloadState, object]:
    """The model before #42289's fix: phase A records the hit but touches nothing (and phase
    B, cancel and the stale-pin release free nothing of it)."""
    if isinstance(command, S.LookupCpuHit):
        hit = S.cpu_hit(state.cpu, command.keys)
        pending = tuple(h for h in state.pending if h.req != command.req)
        if hit:
            pending += (S.PendingHit(command.req, hit, command.keys[:len(hit)]),)
        return replace(state, pending=pending), hit
    if isinstance(command, S.CancelHit | S.StartLoad) and any(
            h.req == command.req for h in state.pending):
        unpinned = next(h for h in state.pending if h.req == command.req)
        state = replace(state, cpu=P.touch(state.cpu, unpinned.cpu_block_ids))  # no pin
    return S.step(state, command)


def test_42289_a_store_evicts_an_unpinned_hit_before_phase_b() -> None:
    # The CPU pool has one block, holding H0, free. A request hits it (phase A); before
    # phase B a store of H1 needs a CPU block.
    state, (block,) = alloc(offloaded(H0, cpu=2), 1)
    state = run_from(state, cache(block, H1))
    store = S.StartStore("w", (block,), (H1,))
    buggy = step_without_phase_a_pin(state, S.LookupCpuHit("r", (H0,)))[0]
    (hit,) = buggy.pending[0].cpu_block_ids
    # Caught at once: the hit's block is on the CPU free queue, unreferenced.
    assert {"pinned_cpu_hits_stay_cached", "holds_are_accounted"} <= set(S.violated(buggy))
    assert hit in buggy.cpu.free
    # What that allows: the store's allocation evicts H0 and writes the hit's block.
    buggy, cpu_ids = step_without_phase_a_pin(buggy, store)
    assert isinstance(cpu_ids, tuple)
    assert cpu_ids == (hit,) and P.keys_of(buggy.cpu, hit) == ()
    assert "pinned_cpu_hits_stay_cached" in S.violated(buggy)
    fixed = S.step(state, S.LookupCpuHit("r", (H0,)))[0]
    refused(fixed, store, P.NotEnoughFree)  # the pin keeps it


# --- Exploration ---------------------------------------------------------------------------------


def alphabet() -> tuple[S.Command, ...]:
    hashes = (H0, H1)
    blocks = (1, 2)
    commands: list[S.Command] = [ALLOC, S.Cpu(P.GetNewBlocks(1))]
    commands += [S.Gpu(P.FreeBlocks((b,))) for b in blocks]
    commands += [S.Cpu(P.FreeBlocks((b,))) for b in blocks]
    commands += [S.Cpu(P.EvictBlocks((b,))) for b in blocks]
    commands += [cache(b, h) for b in blocks for h in hashes]
    for req in ("r", "q"):
        commands += [S.LookupCpuHit(req, hashes), S.CancelHit(req)]
        commands += [S.StartLoad(req, (b,)) for b in blocks]
    commands += [S.StartStore("w", (b,), (h,)) for b in blocks for h in hashes]
    commands += [S.FinishTransfer(i, ok) for i in (0, 1) for ok in (True, False)]
    return tuple(commands)


def explore(stepper: Stepper, depth: int) -> tuple[int, int, int, list[str]]:
    """Breadth-first to ``depth``: (states, steps, refusals, the first violation found)."""
    start = S.step(None, S.NewSimpleOffload(3, 3))[0]
    seen = {start}
    frontier: deque[tuple[SimpleOffloadState, int]] = deque([(start, 0)])
    steps = refusals = 0
    commands = alphabet()
    while frontier:
        state, d = frontier.popleft()
        if d == depth:
            continue
        for command in commands:
            before = replace(state)
            try:
                after = stepper(state, command)[0]
            except (ValueError, LookupError):
                refusals += 1
                assert state == before, command
                continue
            steps += 1
            bad = S.violated(after)
            if bad:
                return len(seen), steps, refusals, bad
            if after not in seen:
                seen.add(after)
                frontier.append((after, d + 1))
    return len(seen), steps, refusals, []


def test_exploration_keeps_every_invariant() -> None:
    """Bounded by its depth (3,769 states), never by the time it takes: a loaded machine
    explores the same states, more slowly."""
    states, steps, refusals, bad = explore(S.step, depth=10)
    assert bad == []
    assert states == 3_769 and steps > states and refusals > 0


def test_exploration_finds_42289_without_the_phase_a_pin() -> None:
    bad = explore(step_without_phase_a_pin, depth=7)[3]
    assert "pinned_cpu_hits_stay_cached" in bad
