"""The rules every vLLM 0.13 offloading manager of kvspec keeps (impl/kv_offload/abstract.py:
``RefCountingManager``, the base of the LRU and ARC managers), by example, under both policies.

Lookups, loads and stores with their ref counts, events, all-or-nothing eviction that never
takes the calling store's own keys, and typed refusals that change nothing. The rules are
vLLM 0.13's with the bugs vLLM 0.33 fixed, fixed (impl/kv_offload/arc_manager.py lists them).
Each test runs on a toy backend and, under vLLM 0.13, on vLLM's ``CPUBackend``
(tests/offload_managers.py).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

from kvspec.impl.kv_offload import (
    ARCOffloadingManager,
    DuplicateOffloadKey,
    LRUOffloadingManager,
    NotPinned,
    OffloadingError,
    OffloadingEvent,
    StoreNotComplete,
    StoreNotPending,
    UnknownOffloadKey,
)
from tests import offload_managers
from tests.offload_managers import Manager, held, ids, snapshot, stored

# The fixtures of tests/offload_managers.py, bound here for pytest to find.
backend_factory = offload_managers.backend_factory
make = offload_managers.make


def test_lookup_counts_leading_ready_keys(make: Callable[[int], Manager]) -> None:
    m = make(8)
    stored(m, [1, 2])
    assert m.prepare_store([3]) is not None  # pending
    assert m.lookup([1, 2, 3]) == 2
    assert m.lookup([1, 9, 2]) == 1
    assert m.lookup(iter([2, 1])) == 2
    assert m.lookup([]) == 0


def test_store_then_complete_emits_events_in_order(make: Callable[[int], Manager]) -> None:
    m = make(4)
    out = m.prepare_store([b"a", b"b"])
    assert out is not None
    assert out.block_hashes_to_store == [b"a", b"b"] and out.block_hashes_evicted == []
    assert len(ids(out.store_spec)) == 2
    assert held(m) == [(b"a", -1), (b"b", -1)]
    again = m.prepare_store([b"a", b"c"])  # a is present (pending): not stored again
    assert again is not None and again.block_hashes_to_store == [b"c"]
    m.complete_store([b"a", b"b"])
    m.check_representation()
    assert [(e.block_hashes, e.removed) for e in m.take_events()] == [([b"a", b"b"], False)]
    assert list(m.take_events()) == []
    m.complete_store([b"c"])
    assert list(m.take_events()) == [
        OffloadingEvent([b"c"], m.backend.block_size, m.backend.medium, False)]


def test_nothing_to_store_returns_an_empty_output(make: Callable[[int], Manager]) -> None:
    m = make(2)
    stored(m, [1, 2])
    out = m.prepare_store([2, 1])
    assert out is not None
    assert out.block_hashes_to_store == [] and out.block_hashes_evicted == []
    assert ids(out.store_spec) == []


def test_load_pins_and_complete_load_unpins(make: Callable[[int], Manager]) -> None:
    m = make(2)
    out = m.prepare_store([1, 2])
    assert out is not None
    m.complete_store([1, 2])
    spec = m.prepare_load([2, 1])
    assert ids(spec) == list(reversed(ids(out.store_spec)))
    m.prepare_load([1])
    refs = dict(held(m))
    assert refs == {1: 2, 2: 1}
    m.check_representation()
    assert m.prepare_store([3]) is None  # every key pinned: no victim
    m.complete_load([1, 2])
    m.complete_load([1])
    assert dict(held(m)) == {1: 0, 2: 0}
    m.check_representation()


def test_failed_store_frees_the_block_without_an_event(make: Callable[[int], Manager]) -> None:
    m = make(2)
    assert m.prepare_store([1, 2]) is not None
    m.complete_store([2], success=False)
    m.check_representation()
    assert [k for k, _ in held(m)] == [1]
    assert m.backend.get_num_free_blocks() == 1
    assert list(m.take_events()) == []
    if isinstance(m, ARCOffloadingManager):
        assert m.b1_keys() == [] and m.b2_keys() == []
    with pytest.raises(UnknownOffloadKey):
        m.complete_store([2])


REFUSALS: list[tuple[str, Callable[[Manager], Any], type[Exception]]] = [
    ("load a duplicate", lambda m: m.prepare_load([1, 1]), DuplicateOffloadKey),
    ("load an unknown key", lambda m: m.prepare_load([1, 99]), UnknownOffloadKey),
    ("load a pending key", lambda m: m.prepare_load([1, 3]), StoreNotComplete),
    ("complete_load a duplicate", lambda m: m.complete_load([2, 2]), DuplicateOffloadKey),
    ("complete_load an unknown key", lambda m: m.complete_load([2, 99]), UnknownOffloadKey),
    ("complete_load an unpinned key", lambda m: m.complete_load([2, 1]), NotPinned),
    ("complete_load a pending key", lambda m: m.complete_load([2, 3]), NotPinned),
    ("store a duplicate", lambda m: m.prepare_store([5, 5]), DuplicateOffloadKey),
    ("complete_store a duplicate", lambda m: m.complete_store([3, 3]), DuplicateOffloadKey),
    ("complete_store an unknown key", lambda m: m.complete_store([3, 99]), UnknownOffloadKey),
    ("complete a store twice", lambda m: m.complete_store([3, 1]), StoreNotPending),
    ("fail a completed store", lambda m: m.complete_store([3, 1], success=False),
     StoreNotPending),
]


@pytest.mark.parametrize(("what", "call", "error"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_every_refusal_is_typed_named_and_changes_nothing(
        make: Callable[[int], Manager], what: str, call: Callable[[Manager], Any],
        error: type[Exception]) -> None:
    m = make(4)
    stored(m, [1, 2])
    m.prepare_load([2])  # 1 ready, 2 pinned once, 3 pending
    assert m.prepare_store([3]) is not None
    before = snapshot(m)
    with pytest.raises(error) as raised:
        call(m)
    assert isinstance(raised.value, OffloadingError)
    assert isinstance(raised.value, ValueError | LookupError)
    assert any(repr(k) in str(raised.value) for k in (1, 2, 3, 5, 99))
    assert snapshot(m) == before
    m.check_representation()


def test_the_calls_own_keys_are_never_evicted(make: Callable[[int], Manager]) -> None:
    # vLLM #35846: [1, 3] with 1 held and the cache full must evict 2, not 1.
    m = make(2)
    stored(m, [1, 2])
    out = m.prepare_store([1, 3])
    assert out is not None
    assert out.block_hashes_to_store == [3] and out.block_hashes_evicted == [2]
    assert m.lookup([1]) == 1
    m.check_representation()


def test_eviction_is_all_or_nothing(make: Callable[[int], Manager]) -> None:
    m = make(3)
    stored(m, [1, 2, 3])
    list(m.take_events())
    before = snapshot(m)
    # Three ready keys, but two are the call's own: one victim for two new keys.
    assert m.prepare_store([1, 2, 4, 5]) is None
    assert snapshot(m) == before
    m.prepare_load([1, 2])
    before = snapshot(m)
    assert m.prepare_store([4, 5]) is None  # only 3 is evictable
    assert snapshot(m) == before
    m.check_representation()


def test_eviction_frees_blocks_and_announces_victims(make: Callable[[int], Manager]) -> None:
    m = make(3)
    stored(m, [1, 2, 3])
    list(m.take_events())
    m.prepare_load([1])
    out = m.prepare_store([4, 5])
    assert out is not None and out.block_hashes_evicted == [2, 3]
    events = list(m.take_events())
    assert [(e.block_hashes, e.removed) for e in events] == [([2, 3], True)]
    assert events[0].medium == m.backend.medium
    assert m.lookup([2]) == 0 and m.lookup([1]) == 1
    m.check_representation()


def test_events_off(backend_factory: Callable[[int], Any]) -> None:
    for cls in (LRUOffloadingManager, ARCOffloadingManager):
        m = cls(backend_factory(2))
        assert m.events is None
        stored(m, [1, 2])
        assert m.prepare_store([3]) is not None
        assert list(m.take_events()) == []


def test_random_operations_keep_the_representation(make: Callable[[int], Manager]) -> None:
    rng = random.Random(7)
    m = make(6)
    for _ in range(1_500):
        keys = rng.sample(range(12), rng.randint(1, 4))
        op = rng.randrange(5)
        try:
            if op == 0:
                m.prepare_store(keys)
            elif op == 1:
                m.complete_store(keys, success=rng.random() < 0.8)
            elif op == 2:
                m.prepare_load(keys)
            elif op == 3:
                m.complete_load(keys)
            else:
                m.touch(keys)
        except OffloadingError:
            pass
        m.check_representation()


def test_check_representation_catches_a_wrong_count(make: Callable[[int], Manager]) -> None:
    m = make(2)
    stored(m, [1])
    m._evictable += 1  # a corruption no public call can make
    with pytest.raises(AssertionError, match="evictable"):
        m.check_representation()


# ------------------------------------------------ LRU
