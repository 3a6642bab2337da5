"""SimpleCPUOffload mutants: bugs of vLLM 0.33's SimpleCPUOffloadConnector as two composed
block pools (the phase-A pin, phase B's holds, the stores' and loads' keys and holds, the
passthrough guard), planted into the spec itself (spec/simple_cpu_offload.py) and caught by
its breadth-first exploration (tests/test_simple_cpu_offload.py).

Each mutant monkeypatches a function of ``kvspec.spec.simple_cpu_offload`` that ``step``
calls through the module's globals (``lookup_cpu_hit``, ``start_load``, ``start_store``),
never a helper the invariants read (``key``, ``gpu_holds``, ``cpu_holds``,
``pinned_cpu_blocks``), so each invariant still judges what it should. One mutant per
invariant that is the composition's own; the pools' invariants
(``gpu_pool_keeps_its_invariants``, ``cpu_pool_keeps_its_invariants``) are scored by the
pool's own mutants. The explorer asserts ``violated(state) == []`` on each reached state, so
the failure names every invariant broken at the first bad state it reaches; each mutant
breaks its own invariant there, first in ``ALL`` order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace as changed
from typing import Any

from kvspec.spec import pool as P
from tests.mutants import Mutant, replace

EXPLORER = ("tests/test_simple_cpu_offload.py::test_exploration_keeps_every_invariant",)


def lookup_does_not_pin() -> None:
    """vLLM #42289: phase A records the CPU hit in ``_pending_cpu_hits`` without touching
    its blocks (no ``cpu_block_pool.touch``, 412-416): the hit's blocks stay on the CPU free
    queue, and a store's ``get_new_blocks`` before phase B may evict them and write over the
    data phase B will load."""
    from kvspec.spec import simple_cpu_offload as spec

    def lookup_cpu_hit(state: Any, req: Any, keys: tuple[Any, ...]
                       ) -> tuple[Any, tuple[Any, ...]]:
        for block_hash in keys:
            spec.key(block_hash)
        hit = spec.cpu_hit(state.cpu, keys)
        pending = tuple(h for h in state.pending if h.req != req)  # nothing pinned to free
        if hit:
            pending += (spec.PendingHit(req, hit, keys[:len(hit)]),)
        return changed(state, pending=pending), hit
    replace(spec, "lookup_cpu_hit", lookup_cpu_hit)


def store_releases_source_at_start() -> None:
    """A store's GPU source hold is released when the job is issued instead of when it
    completes (``free_blocks`` right after the ``touch``, 668/767): a lazy store's source,
    read off the GPU free queue, goes straight back to it, so the scheduler may allocate and
    overwrite the block while the copy reads it."""
    from kvspec.spec import simple_cpu_offload as spec

    original = spec.start_store

    def start_store(state: Any, req: Any, gpu_block_ids: tuple[Any, ...],
                    keys: tuple[Any, ...]) -> tuple[Any, tuple[Any, ...]]:
        after, cpu_ids = original(state, req, gpu_block_ids, keys)
        return changed(after, gpu=P.free_blocks(after.gpu, gpu_block_ids)), cpu_ids
    replace(spec, "start_store", start_store)


def store_keys_destination_at_start() -> None:
    """A store's CPU blocks are keyed (``_insert_block_hash``, 1117-1121) when the store is
    issued instead of when it completes: a phase-A lookup hits a half-written CPU block and
    loads garbage into the GPU."""
    from kvspec.spec import simple_cpu_offload as spec

    original = spec.start_store

    def start_store(state: Any, req: Any, gpu_block_ids: tuple[Any, ...],
                    keys: tuple[Any, ...]) -> tuple[Any, tuple[Any, ...]]:
        after, cpu_ids = original(state, req, gpu_block_ids, keys)
        cpu = P.cache_full_blocks(after.cpu, cpu_ids, keys, 0, len(cpu_ids), spec.GROUP, (), 1)
        return changed(after, cpu=cpu), cpu_ids
    replace(spec, "start_store", start_store)


def load_keys_destination_at_start() -> None:
    """A load's GPU destination blocks are keyed with the hit's hashes when the load is
    issued instead of after it completes (the connector caching them itself in phase B):
    another request's prefix lookup hits the blocks and reads half-written KV."""
    from kvspec.spec import simple_cpu_offload as spec

    original = spec.start_load

    def start_load(state: Any, req: Any, gpu_block_ids: tuple[Any, ...]) -> Any:
        after = original(state, req, gpu_block_ids)
        keys = after.transfers[-1].keys
        gpu = P.cache_full_blocks(after.gpu, gpu_block_ids, keys, 0, len(gpu_block_ids),
                                  spec.GROUP, (), 1)
        return changed(after, gpu=gpu)
    replace(spec, "start_load", start_load)


def store_trusts_any_cached_copy() -> None:
    """A store's source check asks whether the GPU pool caches the hash at all (a prefix-cache
    lookup, ``get_cached_block``) instead of whether this block holds it: a stale block id
    paired with a hash (the request's block table has moved on) is copied, and the CPU block
    is keyed with a hash whose data its GPU source never held."""
    from kvspec.spec import simple_cpu_offload as spec

    def start_store(state: Any, req: Any, gpu_block_ids: tuple[Any, ...],
                    keys: tuple[Any, ...]) -> tuple[Any, tuple[Any, ...]]:
        spec._check_gpu_blocks(state.gpu, gpu_block_ids)
        if len(keys) != len(gpu_block_ids) or len(set(keys)) != len(keys):
            raise spec.BadTransfer(f"blocks {list(gpu_block_ids)} and hashes {list(keys)}")
        storing = {h for t in state.transfers if t.is_store for h in t.keys}
        for block, block_hash in zip(gpu_block_ids, keys, strict=True):
            if not P.get_cached_block(state.gpu, block_hash, (spec.GROUP,)):
                raise spec.SourceHoldsNoData(f"GPU block {block} does not hold {block_hash!r}")
            if block_hash in storing or P.get_cached_block(state.cpu, block_hash, (spec.GROUP,)):
                raise spec.AlreadyInCpu(f"{block_hash!r} is cached in the CPU pool")
        cpu, cpu_ids = P.get_new_blocks(state.cpu, len(gpu_block_ids))
        gpu = P.touch(state.gpu, gpu_block_ids)
        store = spec.Transfer(True, req, gpu_block_ids, cpu_ids, keys)
        return changed(state, gpu=gpu, cpu=cpu, transfers=state.transfers + (store,)), cpu_ids
    replace(spec, "start_store", start_store)


def load_keeps_pending_hit() -> None:
    """Phase B reads the pending hit (``_pending_cpu_hits.get`` instead of ``pop``, 450) and
    releases its phase-A pin (527), but the entry stays: the hit's blocks are counted as
    pinned twice (by the entry and by the load) on one reference, and ``request_finished``
    (1225-1229) frees the same pin a second time, under the load still reading them."""
    from kvspec.spec import simple_cpu_offload as spec

    original = spec.start_load

    def start_load(state: Any, req: Any, gpu_block_ids: tuple[Any, ...]) -> Any:
        after = original(state, req, gpu_block_ids)
        return changed(after, pending=state.pending)
    replace(spec, "start_load", start_load)


def _mutant(name: str, plant: Callable[[], None], killed_by: str) -> Mutant:
    text = " ".join((plant.__doc__ or "").split())
    first = text.split(" ", 1)[0]
    if first[1:] == first[1:].lower():  # "A store's ..." reads on; "vLLM" stays
        text = text[:1].lower() + text[1:]
    return Mutant(name, "spec: Planted into the SimpleCPUOffload spec; " + text, plant,
                  EXPLORER, killed_by=killed_by)


MUTANTS: list[Mutant] = [
    _mutant("spec_simple_offload_lookup_does_not_pin", lookup_does_not_pin,
            "pinned_cpu_hits_stay_cached"),
    _mutant("spec_simple_offload_store_source_released_early", store_releases_source_at_start,
            "transfer_gpu_blocks_not_reused"),
    _mutant("spec_simple_offload_store_keys_destination_early",
            store_keys_destination_at_start, "store_destinations_unkeyed_until_done"),
    _mutant("spec_simple_offload_load_keys_destination_early", load_keys_destination_at_start,
            "load_destinations_unkeyed_until_done"),
    _mutant("spec_simple_offload_store_trusts_any_cached_copy", store_trusts_any_cached_copy,
            "store_sources_keep_their_key"),
    _mutant("spec_simple_offload_load_keeps_pending_hit", load_keeps_pending_hit,
            "holds_are_accounted"),
]
