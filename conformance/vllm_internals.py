"""The checker's reads of vLLM's objects that vLLM gives no public name, all in one place.

The checker compares a target's whole state with the spec's after every step. For a few
parts of that state vLLM has no public accessor: the map can only be asked about a key it is
given, not listed; the offloading manager's policy and its two counters are attributes of
its own. Each function below is one such read, named for what it returns, with the vLLM
file and class it reads and why no public name will do. Everything else in kvspec reads
vLLM through public names; tests/test_architecture.py fails on a private name of another
module read anywhere in the package or the benchmarks, and names this module as the one
place for vLLM's.

When a vLLM release renames one of these attributes, this module is what changes: the
machines, adapters and tests call the functions, never the attributes. The functions take
``Any``: vLLM is imported lazily (the checker runs without it) and its classes are not typed
for us.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from typing import Any


def block_hash_map_entries(cache_map: Any) -> Iterator[tuple[Any, list[Any]]]:
    """(key, its blocks) for every key of vLLM's ``BlockHashToBlockMap``.

    Reads ``BlockHashToBlockMap._cache`` (vllm/v1/core/block_pool.py, vLLM 0.13 and 0.33):
    per key one block, or a dict block id -> block when several blocks hold the key. The map
    offers ``get_one_block``, ``insert``, ``pop`` (and 0.33's ``contain``), all for a key the
    caller already has: nothing lists its keys, and the checker must see every key to
    compare the map with the spec's (a stale key is exactly the bug it looks for)."""
    for key, entry in cache_map._cache.items():
        yield key, list(entry.values()) if isinstance(entry, dict) else [entry]


def block_hash_map_ids_source(variable: str) -> str:
    """The same read as ``block_hash_map_entries`` (``BlockHashToBlockMap._cache``,
    vllm/v1/core/block_pool.py), key -> block ids, as the source text of a written
    counterexample: a test that runs on vLLM alone, without kvspec's checker."""
    return (f"{{key: tuple(b.block_id for b in (entry.values() if isinstance(entry, dict) "
            f"else [entry])) for key, entry in {variable}._cache.items()}}")


def offload_policy(manager: Any) -> Any:
    """vLLM 0.33's ``CPUOffloadingManager``'s cache policy object (its LRU or ARC lists).

    Reads ``CPUOffloadingManager._policy`` (vllm/v1/kv_offload/cpu/manager.py). The manager
    answers lookups and hands out store and evict decisions, but shows neither which chunks
    it holds nor in what order: those live in the policy, which it keeps to itself. The
    policy's own lists (``chunks``; ``t1``, ``t2``, ``b1``, ``b2``, ``target_t1_size``) are
    public names of the policy."""
    return manager._policy


def lru_ranks(policy: Any) -> Mapping[Any, Any]:
    """Key -> recency rank in vLLM 0.33's LRU offload policy (comparable values, a tuple in
    0.33; greater is more recent).

    Reads ``LRUCachePolicy._ranks`` (vllm/v1/kv_offload/cpu/policies/lru.py). The policy's
    public ``chunks`` dict is not kept in recency order (a touch re-ranks a key without moving
    it), so the order the spec compares, least recent first, is only in the ranks."""
    ranks: Mapping[Any, Any] = policy._ranks
    return ranks


def evictable_chunk_count(manager: Any) -> int:
    """How many chunks vLLM 0.33's ``CPUOffloadingManager`` counts as evictable (ref count 0).

    Reads ``CPUOffloadingManager._num_evictable_cache_chunks``
    (vllm/v1/kv_offload/cpu/manager.py): a counter the manager keeps beside its chunks to
    decide whether a store fits, with no public accessor; the checker holds it to the chunks
    it counts (the manager's representation invariant)."""
    return int(manager._num_evictable_cache_chunks)


def write_pending_chunk_count(manager: Any) -> int:
    """How many chunks vLLM 0.33's ``CPUOffloadingManager`` counts as being written (ref
    count -1).

    Reads ``CPUOffloadingManager._num_write_pending_chunks``
    (vllm/v1/kv_offload/cpu/manager.py), the second counter beside the chunks; as
    ``evictable_chunk_count``, no public accessor."""
    return int(manager._num_write_pending_chunks)


def mamba_retired_blocks(manager: Any) -> Mapping[str, int]:
    """Request id -> how many of its blocks vLLM 0.33's ``MambaManager`` (align mode) has
    retired (freed as the request's state moved past them).

    Reads ``MambaManager._num_retired_blocks``
    (vllm/v1/core/single_type_kv_cache_manager.py): align mode's bookkeeping per request,
    which the manager uses for its own allocations and shows through no method; the spec's
    ``MambaAlign`` state has the same count, and the test compares them call by call."""
    retired: Mapping[str, int] = manager._num_retired_blocks
    return retired


def mamba_allocated_requests(manager: Any) -> Collection[str]:
    """The requests for which vLLM 0.33's ``MambaManager`` (align mode) has allocated blocks.

    Reads ``MambaManager._allocated_block_reqs``
    (vllm/v1/core/single_type_kv_cache_manager.py), align mode's other per-request record;
    no public name, as ``mamba_retired_blocks``."""
    allocated: Collection[str] = manager._allocated_block_reqs
    return allocated
