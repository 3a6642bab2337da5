"""Two-tier mutants: bugs of the composition of the GPU pool and the CPU offload tier (the
transfers between them, the hold, the guard and the router), planted into the spec itself
(spec/two_tier.py) and caught by its exhaustive exploration (tests/test_two_tier.py).

Each mutant monkeypatches a function of ``kvspec.spec.two_tier`` that ``step`` (or its
operations) calls through the module's globals, never a helper the invariants read
(``holds``, ``load_destinations``, ``gpu_copies``, ``drained`` and the drains fold the
router's view inside ``router_view_matches_both_tiers``), so each invariant still judges
what it should. One mutant per invariant that is the composition's own; the components'
invariants (``gpu_pool_keeps_its_invariants``, ``cpu_tier_keeps_its_invariants``) are scored
by the pool's and the offload tier's own mutants. The explorer asserts ``violated(state) ==
[]`` on each reached state, so the failure names every invariant broken; each mutant breaks
its own first (in ``ALL`` order), before any other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace as changed
from typing import Any

from kvspec.spec import offload as cpu_spec, pool as gpu_spec
from tests.mutants import Mutant, replace

EXPLORER = ("tests/test_two_tier.py::test_every_reachable_two_tier_state_keeps_the_rules[1-7]",)


def guard_ignores_store_holds() -> None:
    """vLLM #42289 / SGLang #27631 / #31427: a finished request's GPU blocks are returned to
    the pool while a store job still reads them (the fence, 0.33's
    ``_block_id_to_pending_jobs``, not consulted on free): the guard lets a request free a
    block below the holds of the transfers on it, so the block is free and reusable while
    the copy runs."""
    from kvspec.spec import two_tier as spec

    def guard(gpu: Any, transfers: tuple[Any, ...]) -> None:
        for block in spec.load_destinations(transfers):
            if gpu_spec.keys_of(gpu, block):
                raise spec.HoldReleased(f"block {block} is being written by a load")
    replace(spec, "_guard", guard)


def load_keys_destination_at_start() -> None:
    """A load's destination blocks are keyed (``cache_full_blocks`` with the loaded keys'
    hashes) when the load starts instead of when it completes: a request's prefix lookup
    hits the blocks and reads half-written KV."""
    from kvspec.spec import two_tier as spec

    original = spec.start_load

    def start_load(state: Any, req: Any, keys: tuple[Any, ...],
                   block_ids: tuple[Any, ...]) -> Any:
        after = original(state, req, keys, block_ids)
        gpu = gpu_spec.cache_full_blocks(
            after.gpu, block_ids, tuple(spec.block_hash_of(k) for k in keys), 0,
            len(block_ids), spec.GROUP, keys, 1)
        return changed(after, gpu=gpu)
    replace(spec, "start_load", start_load)


def load_unpins_at_start() -> None:
    """LMCache #5098-like: a load's CPU pin is dropped when the job starts instead of when it
    completes (``complete_load`` right after ``prepare_load``), so the CPU tier may evict a
    key the copy still reads."""
    from kvspec.spec import two_tier as spec

    original = spec.start_load

    def start_load(state: Any, req: Any, keys: tuple[Any, ...],
                   block_ids: tuple[Any, ...]) -> Any:
        after = original(state, req, keys, block_ids)
        return changed(after, cpu=cpu_spec.complete_load(after.cpu, keys))
    replace(spec, "start_load", start_load)


def store_copies_unaccepted_keys() -> None:
    """A store transfer is issued for every key offered, not only those ``prepare_store``
    accepted: a key the CPU tier already holds (ready), or a store into a full tier it
    refused, gets a copy job writing a key that is not pending."""
    from kvspec.spec import two_tier as spec

    def start_store(state: Any, req: Any, block_ids: tuple[Any, ...],
                    keys: tuple[Any, ...]) -> Any:
        spec._check_pairs(block_ids, keys, state.gpu)
        for block, key in zip(block_ids, keys, strict=True):
            held = gpu_spec.keys_of(state.gpu, block)
            if state.gpu.ref[block] < 1 or not held:
                raise spec.BlockHoldsNoData(f"block {block} holds no data")
            if spec.gpu_key(key) not in held:
                raise spec.KeyMismatch(f"block {block} does not hold CPU key {key}")
        cpu, output = cpu_spec.prepare_store(state.cpu, req, keys)
        transfer = spec.Transfer(True, req, block_ids, keys, state.cpu.generation)
        gpu = gpu_spec.touch(state.gpu, block_ids)
        return changed(state, gpu=gpu, cpu=cpu, transfers=state.transfers + (transfer,)), output
    replace(spec, "start_store", start_store)


def failed_store_drops_record() -> None:
    """A failed store's transfer record is dropped (and its GPU blocks released) without
    telling the CPU tier (no ``complete_store(success=False)``): its keys stay pending
    forever, never stored, never retried, never evictable."""
    from kvspec.spec import two_tier as spec

    original = spec.finish_transfer

    def finish_transfer(state: Any, index: int, success: bool) -> Any:
        if type(index) is int and 0 <= index < len(state.transfers) and not success \
                and state.transfers[index].is_store:
            job = state.transfers[index]
            return changed(state, gpu=gpu_spec.free_blocks(state.gpu, job.block_ids),
                           transfers=state.transfers[:index] + state.transfers[index + 1:])
        return original(state, index, success)
    replace(spec, "finish_transfer", finish_transfer)


def router_misses_gpu_removals() -> None:
    """LMCache #5076 / SGLang #27562: the router consumes both tiers' events but drops the
    GPU pool's removals (``BlockRemoved``): a block evicted from the GPU is still routed to
    as cached there."""
    from kvspec.spec import two_tier as spec
    from kvspec.spec.event_consumer import consume

    original = spec.step

    def drain_gpu_keeping_removed(state: Any) -> Any:
        gpu, events = gpu_spec.take_events(state.gpu)
        view = state.router.gpu
        for event in events:
            if not isinstance(event, gpu_spec.Removed):
                view = consume(view, event)
        return changed(state, gpu=gpu, router=changed(state.router, gpu=view))

    def step(state: Any, command: Any) -> tuple[Any, object]:
        if state is not None and isinstance(command, spec.TakeEvents):
            return spec._drain_cpu(drain_gpu_keeping_removed(state)), None
        if state is not None and isinstance(command, spec.Gpu) \
                and isinstance(command.command, gpu_spec.TakeEvents):
            before = state.gpu.num_taken
            after = drain_gpu_keeping_removed(state)
            return after, after.gpu.events[before:]
        return original(state, command)
    replace(spec, "step", step)


def _mutant(name: str, plant: Callable[[], None], killed_by: str) -> Mutant:
    text = " ".join((plant.__doc__ or "").split())
    first = text.split(" ", 1)[0]
    if first[1:] == first[1:].lower():  # "A load's ..." reads on; "LMCache" stays
        text = text[:1].lower() + text[1:]
    return Mutant(name, "spec: Planted into the two-tier spec; " + text, plant, EXPLORER,
                  killed_by=killed_by)


MUTANTS: list[Mutant] = [
    _mutant("spec_two_tier_store_blocks_freed_mid_copy", guard_ignores_store_holds,
            "transfer_blocks_not_reused"),
    _mutant("spec_two_tier_load_keys_destination_early", load_keys_destination_at_start,
            "load_destinations_hold_no_key"),
    _mutant("spec_two_tier_load_unpins_at_start", load_unpins_at_start,
            "loads_read_ready_keys"),
    _mutant("spec_two_tier_store_copies_unaccepted_keys", store_copies_unaccepted_keys,
            "stores_write_pending_keys"),
    _mutant("spec_two_tier_failed_store_drops_record", failed_store_drops_record,
            "pending_keys_have_a_store"),
    _mutant("spec_two_tier_router_misses_gpu_removals", router_misses_gpu_removals,
            "router_view_matches_both_tiers"),
]
