"""kvspec's LRU offloading manager (impl/kv_offload/lru_manager.py): what it touches and what it
evicts. The rules it shares with the ARC manager are tests/test_abstract.py's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvspec.impl.kv_offload import LRUOffloadingManager
from tests import offload_managers
from tests.offload_managers import stored

# The fixture of tests/offload_managers.py, bound here for pytest to find.
backend_factory = offload_managers.backend_factory


def test_lru_touch_makes_the_first_key_most_recent(backend_factory: Callable[[int], Any]) -> None:
    m = LRUOffloadingManager(backend_factory(4))
    stored(m, [1, 2, 3])
    assert m.prepare_store([4]) is not None  # pending keys move too
    m.touch([4, 1, 99])
    assert [k for k, _ in m.ordered_entries()] == [2, 3, 1, 4]


def test_lru_evicts_from_the_lru_end_skipping_pinned_and_pending(
        backend_factory: Callable[[int], Any]) -> None:
    m = LRUOffloadingManager(backend_factory(4))
    stored(m, [1, 2])
    assert m.prepare_store([3]) is not None
    m.complete_store([3])
    assert m.prepare_store([4]) is not None  # 4 pending
    m.prepare_load([1])
    out = m.prepare_store([5, 6])
    assert out is not None and out.block_hashes_evicted == [2, 3]
    assert m.ordered_entries() == [(1, 1), (4, -1), (5, -1), (6, -1)]


# ------------------------------------------------ ARC
