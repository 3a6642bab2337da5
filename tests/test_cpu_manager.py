"""impl's CPUOffloadingManager (vLLM 0.33's API, impl/kv_offload/cpu_manager.py) by example:
the API's shape, per-request recency, ARC's store-miss adaptation, events, reset and the
typed refusals (its keys and data classes: tests/test_base.py). The offload machine checks it
against `spec.offload` under the vllm-0.33 profile (tests/test_offload_machine.py,
``TestImplOffloadConforms033``)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvspec.impl.kv_offload import (
    BadOffloadConfig,
    CPUOffloadingManager,
    DuplicateOffloadKey,
    LookupResult,
    NotPinned,
    ReqContext,
    StoreNotComplete,
    StoreNotPending,
    UnknownOffloadKey,
    get_offload_block_hash,
)
from kvspec.impl.kv_offload.base import CPULoadStoreSpec, OffloadKey
from tests.offload_managers import key, keys


def num(k: bytes) -> int:
    return int.from_bytes(get_offload_block_hash(OffloadKey(k)), "big")


def entries(found: list[tuple[bytes, int]]) -> list[tuple[int, int]]:
    return [(num(k), r) for k, r in found]


def events(manager: CPUOffloadingManager) -> list[tuple[list[int], bool, bool]]:
    return [([num(k) for k in e.keys], e.removed, e.metadata_only)
            for e in manager.take_events()]


def stored(manager: CPUOffloadingManager, ctx: ReqContext, *ns: int) -> None:
    output = manager.prepare_store(keys(*ns), ctx)
    assert output is not None
    manager.complete_store(output.keys_to_store, ctx)


@pytest.mark.parametrize(("chunks", "policy"), [(0, "lru"), (-1, "arc"), (True, "lru"),
                                                 (2, "fifo")])
def test_a_bad_config_is_refused(chunks: int, policy: str) -> None:
    with pytest.raises(BadOffloadConfig):
        CPUOffloadingManager(chunks, cache_policy=policy)


def test_lookup_answers_per_key_and_a_store_completes() -> None:
    manager = CPUOffloadingManager(4, enable_events=True)
    ctx = ReqContext(req_id="r")
    manager.on_new_request(ctx)
    with manager.lock:
        output = manager.prepare_store(keys(1, 2), ctx)
    assert output is not None
    assert output.keys_to_store == keys(1, 2) and output.evicted_keys == []
    assert isinstance(output.store_spec, CPULoadStoreSpec) and output.store_spec.chunk_ids == [0, 1]
    assert [manager.lookup(k, ctx) for k in keys(1, 3)] == [LookupResult.HIT_PENDING,
                                                             LookupResult.MISS]
    manager.complete_store(keys(1, 2), ctx)
    assert manager.lookup(key(1), ctx) is LookupResult.HIT
    assert events(manager) == [([1, 2], False, False)]
    assert events(manager) == []
    manager.check_representation()


def test_refusals_are_typed_and_change_nothing() -> None:
    manager = CPUOffloadingManager(4, enable_events=True)
    ctx = ReqContext(req_id="r")
    stored(manager, ctx, 1)
    assert manager.prepare_store(keys(2), ctx) is not None  # 2 pending
    before = entries(manager.ordered_entries())
    cases: list[tuple[type[Exception], object]] = [
        (StoreNotComplete, lambda: manager.prepare_load(keys(1, 2), ctx)),
        (UnknownOffloadKey, lambda: manager.prepare_load(keys(1, 9), ctx)),
        (DuplicateOffloadKey, lambda: manager.prepare_load(keys(1, 1), ctx)),
        (NotPinned, lambda: manager.complete_load(keys(1), ctx)),
        (StoreNotPending, lambda: manager.complete_store(keys(1), ctx)),
        (UnknownOffloadKey, lambda: manager.complete_store(keys(9), ctx)),
        (DuplicateOffloadKey, lambda: manager.prepare_store(keys(3, 3), ctx)),
    ]
    for error, call in cases:
        with pytest.raises(error):
            call()  # type: ignore[operator]
        assert entries(manager.ordered_entries()) == before
        manager.check_representation()


def test_a_full_tier_refuses_a_store_and_evicts_nothing() -> None:
    manager = CPUOffloadingManager(2, enable_events=True)
    ctx = ReqContext(req_id="r")
    stored(manager, ctx, 1, 2)
    manager.prepare_load(keys(1), ctx)
    events(manager)
    # Key 2 may go, key 1 is pinned: two new keys do not fit.
    assert manager.prepare_store(keys(3, 4), ctx) is None
    assert entries(manager.ordered_entries()) == [(1, 1), (2, 0)]
    output = manager.prepare_store(keys(3), ctx)
    assert output is not None and output.evicted_keys == keys(2)
    assert events(manager) == [([2], True, False)]


def test_a_store_never_evicts_a_key_it_offers() -> None:
    manager = CPUOffloadingManager(2)
    ctx = ReqContext(req_id="r")
    stored(manager, ctx, 1, 2)
    # 1 is the least recent, but the call offers it.
    output = manager.prepare_store(keys(1, 3), ctx)
    assert output is not None and output.evicted_keys == keys(2)


def test_lru_recency_moves_when_the_request_finishes() -> None:
    manager = CPUOffloadingManager(4)
    writer, reader = ReqContext(req_id="w"), ReqContext(req_id="r")
    stored(manager, writer, 1, 2, 3)
    manager.on_request_finished(writer)
    assert [k for k, _ in entries(manager.ordered_entries())] == [3, 2, 1]
    manager.prepare_load(keys(3, 2), reader)
    manager.complete_load(keys(3, 2), reader)
    assert [k for k, _ in entries(manager.ordered_entries())] == [3, 2, 1]  # not yet
    manager.on_request_finished(reader)
    assert [k for k, _ in entries(manager.ordered_entries())] == [1, 2, 3]
    manager.on_request_finished(reader)  # once only
    assert [k for k, _ in entries(manager.ordered_entries())] == [1, 2, 3]


def test_arc_promotes_reused_keys_only() -> None:
    manager = CPUOffloadingManager(4, cache_policy="arc")
    writer, reader = ReqContext(req_id="w"), ReqContext(req_id="r")
    stored(manager, writer, 1, 2)
    manager.prepare_load(keys(1), writer)  # its own insertion: not a reuse
    manager.complete_load(keys(1), writer)
    manager.on_request_finished(writer)
    assert entries(manager.t1_entries()) == [(2, 0), (1, 0)] and manager.t2_entries() == []
    manager.prepare_load(keys(2), reader)
    manager.complete_load(keys(2), reader)
    manager.on_request_finished(reader)
    assert entries(manager.t1_entries()) == [(1, 0)]
    assert entries(manager.t2_entries()) == [(2, 0)]
    manager.check_representation()


def test_arc_learns_from_a_store_miss_once_per_request() -> None:
    manager = CPUOffloadingManager(1, cache_policy="arc")
    ctx, other = ReqContext(req_id="a"), ReqContext(req_id="b")
    stored(manager, ctx, 1)
    stored(manager, ctx, 2)  # evicts 1 into B1
    assert [num(k) for k in manager.b1_keys()] == [1]
    manager.prepare_load(keys(2), other)  # pin 2: the next store fails for want of room
    assert manager.prepare_store(keys(1), other) is None
    assert manager.target_t1_size == 1.0  # learned even so
    assert manager.prepare_store(keys(1), other) is None
    assert manager.target_t1_size == 1.0  # once per request and key
    manager.check_representation()


def test_a_failed_store_is_metadata_only_and_filtered_at_take() -> None:
    manager = CPUOffloadingManager(2, enable_events=True)
    ctx = ReqContext(req_id="r")
    assert manager.prepare_store(keys(1, 2), ctx) is not None
    manager.complete_store(keys(1, 2), ctx, success=False)
    assert manager.lookup(key(1), ctx) is LookupResult.MISS
    assert manager.prepare_store(keys(1), ctx) is not None  # a retry holds 1 again
    assert events(manager) == [([2], True, True)]


def test_take_events_takes_at_the_call() -> None:
    manager = CPUOffloadingManager(2, enable_events=True)
    ctx = ReqContext(req_id="r")
    stored(manager, ctx, 1)
    taken = manager.take_events()
    assert manager.events == []
    assert [e.keys for e in taken] == [keys(1)]
    quiet = CPUOffloadingManager(2)
    stored(quiet, ctx, 1)
    assert quiet.events is None and list(quiet.take_events()) == []


def test_reset_announces_ready_keys_and_ignores_late_completions() -> None:
    manager = CPUOffloadingManager(3, cache_policy="arc", enable_events=True)
    old, bad = ReqContext(req_id="old"), ReqContext(req_id="bad")
    manager.on_new_request(bad)
    stored(manager, old, 1)
    assert manager.prepare_store(keys(2), old) is not None  # in flight at the reset
    events(manager)
    manager.reset_cache()
    assert manager.generation == 1
    assert events(manager) == [([1], True, False)]
    assert manager.ordered_entries() == [] and manager.target_t1_size == 0.0
    new = ReqContext(req_id="new")
    assert manager.prepare_store(keys(2), new) is not None
    manager.complete_store(keys(2), old)  # late: the job was issued before the reset
    assert manager.lookup(key(2), new) is LookupResult.HIT_PENDING
    manager.on_request_finished(old)  # a request of the last generation: nothing to commit
    with pytest.raises(UnknownOffloadKey):  # a context that did nothing is not late
        manager.complete_store(keys(7), bad)
    manager.complete_store(keys(2), new)
    assert events(manager) == [([2], False, False)]
    manager.check_representation()


@dataclass
class BareContext:
    """A context with a request id and nothing else."""

    req_id: str


def test_a_context_without_state_is_tracked_by_request_id() -> None:
    manager = CPUOffloadingManager(4)
    ctx = BareContext("r")
    manager.on_new_request(ctx)
    stored(manager, ReqContext(req_id="w"), 1, 2)
    manager.prepare_load(keys(2, 1), ctx)
    manager.complete_load(keys(2, 1), ctx)
    manager.check_representation()
    manager.on_request_finished(ctx)
    assert [k for k, _ in entries(manager.ordered_entries())] == [1, 2]
    manager.check_representation()

