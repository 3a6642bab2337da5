"""KV-cache events: value semantics, vLLM 0.13 field order, and the multi-worker aggregator."""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import pytest
from hypothesis import event, given, strategies as st

from kvspec.impl.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    InvalidEventsError,
    InvalidWorkerCountError,
    KVCacheEvent,
    KVEventAggregator,
    KVEventBatch,
)


def stored(*hashes: int, parent: int | None = None) -> BlockStored:
    return BlockStored(list(hashes), parent, [1, 2] * len(hashes), 2, None, MEDIUM_GPU)


def test_field_order_matches_vllm_0_13() -> None:
    assert [f.name for f in dataclasses.fields(BlockStored)] == [
        "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
    ]
    assert [f.name for f in dataclasses.fields(BlockRemoved)] == ["block_hashes", "medium"]
    assert dataclasses.fields(AllBlocksCleared) == ()
    assert [f.name for f in dataclasses.fields(EventBatch)] == [
        "ts", "events", "data_parallel_rank",
    ]
    assert MEDIUM_GPU == "GPU"


def test_positional_and_keyword_construction_agree() -> None:
    by_position = BlockStored([1, 2], 7, [3, 4, 5, 6], 2, 5, "GPU")
    by_keyword = BlockStored(block_hashes=[1, 2], parent_block_hash=7, token_ids=[3, 4, 5, 6],
                             block_size=2, lora_id=5, medium="GPU")
    assert by_position == by_keyword
    assert by_position.parent_block_hash == 7 and by_position.lora_id == 5
    assert BlockRemoved([b"\x01"], "GPU") == BlockRemoved(block_hashes=[b"\x01"], medium="GPU")


def test_value_semantics() -> None:
    a, b = stored(1, 2, parent=0), stored(1, 2, parent=0)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != stored(1, 2, parent=9)
    removed: KVCacheEvent = BlockRemoved([1], "GPU")
    assert removed != BlockStored([1], None, [], 1, None, "GPU")
    assert AllBlocksCleared() == AllBlocksCleared()
    assert hash(AllBlocksCleared()) == hash(AllBlocksCleared())
    assert removed != AllBlocksCleared()
    assert "block_hashes=[1, 2]" in repr(a)


def test_events_are_frozen_slotted_and_picklable() -> None:
    events: list[KVCacheEvent] = [stored(1), BlockRemoved([1], "GPU"), AllBlocksCleared()]
    for item in events:
        assert isinstance(item, KVCacheEvent)
        assert not hasattr(item, "__dict__")
        assert pickle.loads(pickle.dumps(item)) == item
    with pytest.raises(dataclasses.FrozenInstanceError):
        stored(1).block_size = 3  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        BlockRemoved([1], "GPU").medium = None  # type: ignore[misc]


def test_event_batches() -> None:
    batch = KVEventBatch(1.5, [stored(1)])
    assert batch.data_parallel_rank is None
    assert isinstance(batch, EventBatch)
    assert KVEventBatch(1.5, [stored(1)], 2) == KVEventBatch(ts=1.5, events=[stored(1)],
                                                             data_parallel_rank=2)


# --- aggregator --------------------------------------------------------------------------------


@pytest.mark.parametrize("count", [0, -1, 1.5, "2", None, True])
def test_aggregator_refuses_bad_worker_counts(count: Any) -> None:
    with pytest.raises(InvalidWorkerCountError, match=repr(count)):
        KVEventAggregator(count)


def test_aggregator_common_and_all_events() -> None:
    aggregator = KVEventAggregator(2)
    assert aggregator.get_number_of_workers() == 2
    aggregator.add_events([stored(1), BlockRemoved([5], "GPU")])
    aggregator.add_events([stored(1), AllBlocksCleared()])
    assert aggregator.get_common_events() == [stored(1)]
    assert aggregator.get_all_events() == [stored(1), BlockRemoved([5], "GPU"),
                                           AllBlocksCleared()]
    aggregator.clear_events()
    assert aggregator.get_all_events() == [] and aggregator.get_common_events() == []
    aggregator.increment_workers(2)
    assert aggregator.get_number_of_workers() == 4
    aggregator.reset_workers()
    assert aggregator.get_number_of_workers() == 1
    assert "num_workers=1" in repr(aggregator)


@pytest.mark.parametrize("bad", [(stored(1),), {stored(1)}, None, stored(1), [stored(1), 3]])
def test_aggregator_refuses_bad_events_and_changes_nothing(bad: Any) -> None:
    aggregator = KVEventAggregator(1)
    aggregator.add_events([stored(7)])
    with pytest.raises(InvalidEventsError):
        aggregator.add_events(bad)
    assert aggregator.get_all_events() == [stored(7)]
    assert issubclass(InvalidEventsError, TypeError) and issubclass(InvalidEventsError, ValueError)


def test_aggregator_refuses_a_negative_worker_increment() -> None:
    aggregator = KVEventAggregator(3)
    with pytest.raises(InvalidWorkerCountError):
        aggregator.increment_workers(-1)
    assert aggregator.get_number_of_workers() == 3


EVENTS = st.sampled_from([stored(1), stored(2), stored(1, 2, parent=1), BlockRemoved([1], "GPU"),
                          AllBlocksCleared()])


@given(num_workers=st.integers(1, 4), reports=st.lists(st.lists(EVENTS, max_size=4), max_size=4))
def test_common_events_are_those_every_worker_reported(num_workers: int,
                                                       reports: list[list[KVCacheEvent]]) -> None:
    reports = (reports + [[]] * num_workers)[:num_workers]
    aggregator = KVEventAggregator(num_workers)
    for report in reports:
        aggregator.add_events(report)
    counts: dict[KVCacheEvent, int] = {}
    for report in reports:
        for item in report:
            counts[item] = counts.get(item, 0) + 1
    assert aggregator.get_common_events() == [e for e, c in counts.items() if c == num_workers]
    assert aggregator.get_all_events() == list(counts)
    event(f"common events: {len(aggregator.get_common_events())}")
