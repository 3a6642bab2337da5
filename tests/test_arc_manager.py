"""kvspec's ARC offloading manager (impl/kv_offload/arc_manager.py): promotion, the ghost lists
and the target, its choice of victim, and an eviction that walks each list once. The rules it
shares with the LRU manager are tests/test_abstract.py's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvspec.impl.kv_offload import ARCOffloadingManager, LRUOffloadingManager
from tests import offload_managers
from tests.offload_managers import stored

# The fixture of tests/offload_managers.py, bound here for pytest to find.
backend_factory = offload_managers.backend_factory


def test_arc_touch_promotes_ready_keys_and_keeps_pending_ones_in_t1(
        backend_factory: Callable[[int], Any]) -> None:
    m = ARCOffloadingManager(backend_factory(4))
    stored(m, [1, 2])
    m.prepare_load([2])
    assert m.prepare_store([3]) is not None
    m.touch([1, 2, 3])  # pinned 2 is promoted too; pending 3 stays (0.13 raised KeyError)
    assert m.t1_entries() == [(3, -1)]
    assert m.t2_entries() == [(2, 1), (1, 0)]
    assert m.prepare_store([4]) is not None
    m.touch([3])
    assert [k for k, _ in m.t1_entries()] == [4, 3]
    m.touch([2])
    assert [k for k, _ in m.t2_entries()] == [1, 2]
    m.check_representation()


def test_arc_ghost_touches_move_the_target(backend_factory: Callable[[int], Any]) -> None:
    m = ARCOffloadingManager(backend_factory(2))
    stored(m, [1, 2])
    m.touch([2])  # 2 in T2
    stored(m, [3])  # len(T1) = 1 >= p = 0: evicts 1 from T1 to B1
    assert m.b1_keys() == [1]
    m.touch([1])
    assert m.target_t1_size == 1.0 and isinstance(m.target_t1_size, float)
    m.touch([3])  # T1 empty: len(T1) = 0 < 1, the victim comes from T2
    stored(m, [4])
    assert m.b2_keys() == [2]
    m.touch([2])  # p = max(1 - max(1, 1 / 1), 0)
    assert m.target_t1_size == 0.0
    m.touch([1, 2])  # reversed: the B2 ghost 2 first (p stays 0), then the B1 ghost 1
    assert m.target_t1_size == 1.0
    m.check_representation()


def test_arc_prefers_t1_at_or_above_target_and_trims_ghosts(
        backend_factory: Callable[[int], Any]) -> None:
    m = ARCOffloadingManager(backend_factory(2), enable_events=True)
    for key in range(10):
        stored(m, [key])
    assert m.b1_keys() == [6, 7]  # trimmed to the capacity, oldest dropped
    assert [k for k, _ in m.t1_entries()] == [8, 9]


def test_arc_falls_back_to_t1_when_t2_has_no_candidate(
        backend_factory: Callable[[int], Any]) -> None:
    # vLLM #55461: p above len(T1), T2 all pinned, T1 has an unpinned key.
    m = ARCOffloadingManager(backend_factory(2))
    stored(m, [1, 2])
    stored(m, [3])  # evicts 1 into B1
    assert m.b1_keys() == [1]
    m.touch([1])
    m.touch([1])
    assert m.target_t1_size == 2.0
    m.touch([2])
    m.prepare_load([2])  # T2 = [2] pinned; T1 = [3] ready, len(T1) = 1 < p = 2
    out = m.prepare_store([4])
    assert out is not None and out.block_hashes_evicted == [3]
    assert m.b1_keys() == [1, 3]
    m.check_representation()


def test_arc_store_of_a_ghost_removes_the_ghost(backend_factory: Callable[[int], Any]) -> None:
    m = ARCOffloadingManager(backend_factory(1))
    stored(m, [1])
    stored(m, [2])
    assert m.b1_keys() == [1]
    stored(m, [1])
    assert m.b1_keys() == [2] and m.t1_entries() == [(1, 0)]


def test_arc_eviction_walks_each_list_once(backend_factory: Callable[[int], Any]) -> None:
    # vLLM #50992: 5,000 victims behind 5,000 pinned keys. Restarting the scan for each
    # victim inspects ~25M entries; the forward cursors inspect each entry at most once.
    n = 10_000
    m = ARCOffloadingManager(backend_factory(n))
    keys = list(range(n))
    stored(m, keys)
    m.touch(keys[:2_000])  # 2,000 in T2, pinned below with 3,000 of T1
    m.prepare_load(keys[:5_000])
    out = m.prepare_store(list(range(n, n + 5_000)))
    assert out is not None and len(out.block_hashes_evicted) == 5_000
    assert set(out.block_hashes_evicted) == set(keys[5_000:])
    assert m.eviction_steps <= n + 5_000
    m.check_representation()

    lru = LRUOffloadingManager(backend_factory(n))
    stored(lru, keys)
    lru.prepare_load(keys[:5_000])
    assert lru.prepare_store(list(range(n, n + 5_000))) is not None
    assert lru.eviction_steps == n
