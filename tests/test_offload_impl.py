"""kvspec's offloading managers (impl/kv_offload/): each rule, by example.

Every test runs against a toy backend of its own and, under a vLLM 0.13 interpreter
(.venv-vllm-0.13.0), against vLLM's real ``CPUBackend``. The rules are vLLM 0.13's with
the bugs vLLM 0.33 fixed, fixed (impl/kv_offload/arc_manager.py lists them).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
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

Manager = LRUOffloadingManager | ARCOffloadingManager


@dataclass
class ToyBlock:
    block_id: int
    ref_cnt: int = -1


@dataclass
class ToySpec:
    block_ids: list[int]

    @staticmethod
    def medium() -> str:
        return "TOY"


@dataclass
class ToyBackend:
    """vLLM's Backend, duck-typed, that refuses a double free and an over-allocation."""

    num_blocks: int
    block_size: int = 16
    medium: str = "TOY"
    free_ids: list[int] = field(default_factory=list)
    live: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.free_ids = list(range(self.num_blocks - 1, -1, -1))

    def get_num_free_blocks(self) -> int:
        return len(self.free_ids)

    def allocate_blocks(self, block_hashes: list[Any]) -> list[ToyBlock]:
        if len(block_hashes) > len(self.free_ids):
            raise AssertionError("allocation beyond the free blocks")
        blocks = [ToyBlock(self.free_ids.pop()) for _ in block_hashes]
        self.live.update(b.block_id for b in blocks)
        return blocks

    def free(self, block: ToyBlock) -> None:
        if block.block_id not in self.live:
            raise AssertionError(f"block {block.block_id} freed twice")
        self.live.remove(block.block_id)
        self.free_ids.append(block.block_id)

    def get_load_store_spec(self, block_hashes: Any, blocks: Any) -> ToySpec:
        return ToySpec([b.block_id for b in blocks])


def _vllm_cpu_backend() -> Callable[[int], Any] | None:
    try:
        import vllm
        from vllm.v1.kv_offload.backends.cpu import CPUBackend
    except ImportError:
        return None
    if not str(getattr(vllm, "__version__", "")).startswith("0.13"):
        return None
    return lambda n: CPUBackend(block_size=16, num_blocks=n)


BACKENDS: dict[str, Callable[[int], Any] | None] = {
    "toy": ToyBackend,
    "vllm-cpu": _vllm_cpu_backend(),
}


@pytest.fixture(params=sorted(BACKENDS))
def backend_factory(request: pytest.FixtureRequest) -> Callable[[int], Any]:
    factory = BACKENDS[request.param]
    if factory is None:
        pytest.skip("vLLM 0.13's CPUBackend is not importable here")
    return factory


@pytest.fixture(params=["lru", "arc"])
def make(request: pytest.FixtureRequest,
         backend_factory: Callable[[int], Any]) -> Callable[[int], Manager]:
    cls = LRUOffloadingManager if request.param == "lru" else ARCOffloadingManager

    def build(capacity: int) -> Manager:
        return cls(backend_factory(capacity), enable_events=True)

    return build


def _ids(spec: Any) -> list[int]:
    return [int(i) for i in spec.block_ids]


def snapshot(m: Manager) -> tuple[Any, ...]:
    events = list(m.events or [])
    free = m.backend.get_num_free_blocks()
    if isinstance(m, LRUOffloadingManager):
        return (m.ordered_entries(), events, free)
    return (m.t1_entries(), m.t2_entries(), m.b1_keys(), m.b2_keys(), m.target_t1_size,
            events, free)


def stored(m: Manager, keys: list[Any]) -> None:
    out = m.prepare_store(keys)
    assert out is not None
    m.complete_store(out.block_hashes_to_store)
    m.check_representation()


def held(m: Manager) -> list[tuple[Any, int]]:
    if isinstance(m, LRUOffloadingManager):
        return m.ordered_entries()
    return m.t1_entries() + m.t2_entries()


# ------------------------------------------------ the rules shared by both policies


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
    assert len(_ids(out.store_spec)) == 2
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
    assert _ids(out.store_spec) == []


def test_load_pins_and_complete_load_unpins(make: Callable[[int], Manager]) -> None:
    m = make(2)
    out = m.prepare_store([1, 2])
    assert out is not None
    m.complete_store([1, 2])
    spec = m.prepare_load([2, 1])
    assert _ids(spec) == list(reversed(_ids(out.store_spec)))
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
