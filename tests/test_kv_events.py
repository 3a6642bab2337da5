"""KV-cache events: value semantics, vLLM 0.13's wire format, and the multi-worker aggregator.

The wire format is checked three ways: the msgpack layout written out by hand from vLLM 0.13's
struct definitions, round trips through impl's own encoder and decoder, and, when
``.venv-vllm-0.13.0`` exists, byte equality with vLLM's encoder and decoding in both
directions (a subprocess running vLLM's interpreter). vLLM 0.33's map-encoded family
(impl/kv_events_033.py) is tested in tests/test_kv_events_033.py.
"""

from __future__ import annotations

import ast
import os
import pickle
import random
import subprocess
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import event, given, strategies as st

from kvspec.impl import kv_events_033
from kvspec.impl.block_pool import BlockPool
from kvspec.impl.hashing import BlockHash, maybe_convert_block_hash
from kvspec.impl.kv_cache_utils import KVCacheBlock
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
from kvspec.spec import pool as spec_pool, pool_invariants
from kvspec.spec.pool import PoolState

REPO_ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = REPO_ROOT / ".venv-vllm-0.13.0" / "bin" / "python"

ENCODER = msgspec.msgpack.Encoder()  # what vLLM's ZMQ publisher encodes with
BATCH_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def stored(*hashes: int, parent: int | None = None) -> BlockStored:
    return BlockStored(list(hashes), parent, [1, 2] * len(hashes), 2, None, MEDIUM_GPU)


def test_field_order_matches_vllm_0_13() -> None:
    assert BlockStored.__struct_fields__ == (
        "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
    )
    assert BlockRemoved.__struct_fields__ == ("block_hashes", "medium")
    assert AllBlocksCleared.__struct_fields__ == ()
    assert EventBatch.__struct_fields__ == ("ts", "events", "data_parallel_rank")
    assert KVEventBatch.__struct_fields__ == EventBatch.__struct_fields__
    assert MEDIUM_GPU == "GPU"


def test_struct_options_match_vllm_0_13() -> None:
    for cls in (BlockStored, BlockRemoved, AllBlocksCleared):
        config = cls.__struct_config__
        assert (config.array_like, config.omit_defaults, config.gc) == (True, True, False)
        assert config.tag == cls.__name__ and config.tag_field == "type"
    for batch in (EventBatch, KVEventBatch):
        config = batch.__struct_config__
        assert (config.array_like, config.omit_defaults, config.gc, config.tag) == (
            True, True, False, None)


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
    with pytest.raises(AttributeError):
        stored(1).block_size = 3  # type: ignore[misc]
    with pytest.raises(AttributeError):
        BlockRemoved([1], "GPU").medium = None  # type: ignore[misc]


def test_event_batches() -> None:
    batch = KVEventBatch(1.5, [stored(1)])
    assert batch.data_parallel_rank is None
    assert isinstance(batch, EventBatch)
    assert KVEventBatch(1.5, [stored(1)], 2) == KVEventBatch(ts=1.5, events=[stored(1)],
                                                             data_parallel_rank=2)


# --- the wire format ---------------------------------------------------------------------------


def test_batch_encodes_as_arrays_with_class_name_tags() -> None:
    """The layout vLLM 0.13's structs give (array_like, tag=True), read back as plain msgpack."""
    batch = KVEventBatch(
        ts=2.25,
        events=[
            BlockStored([b"\xab" * 32, 7], None, [], 16, None, MEDIUM_GPU),
            BlockStored([2**64 - 1], b"\x01", [5, 6], 2, 3, None),
            BlockRemoved([9], MEDIUM_GPU),
            AllBlocksCleared(),
        ],
    )
    assert msgspec.msgpack.decode(ENCODER.encode(batch)) == [
        2.25,
        [
            ["BlockStored", [b"\xab" * 32, 7], None, [], 16, None, "GPU"],
            ["BlockStored", [2**64 - 1], b"\x01", [5, 6], 2, 3, None],
            ["BlockRemoved", [9], "GPU"],
            ["AllBlocksCleared"],
        ],
        None,  # array-like structs send their defaults too
    ]
    # An empty batch, byte for byte: fixarray(3), float64 ts, fixarray(0), positive fixint 4.
    assert ENCODER.encode(KVEventBatch(1.0, [], 4)) == (
        b"\x93\xcb\x3f\xf0\x00\x00\x00\x00\x00\x00\x90\x04")


def test_decoder_accepts_a_batch_without_its_rank() -> None:
    assert BATCH_DECODER.decode(msgspec.msgpack.encode([0.5, [["AllBlocksCleared"]]])) == (
        KVEventBatch(0.5, [AllBlocksCleared()]))


@pytest.mark.parametrize("wire", [
    {"ts": 1.0, "events": []},  # a map: what a dataclass batch encodes to
    [1.0, [["BlockMoved", [1], "GPU"]]],  # an unknown tag
    [1.0, [["BlockRemoved", [1.5], "GPU"]]],  # a hash neither int nor bytes
    [1.0, [["BlockStored", [1], None, [], 16, None]]],  # a field short
])
def test_decoder_refuses_what_vllm_refuses(wire: object) -> None:
    with pytest.raises(msgspec.ValidationError):
        BATCH_DECODER.decode(msgspec.msgpack.encode(wire))


BLOCK_HASHES = st.one_of(st.integers(0, 2**64 - 1), st.binary(min_size=1, max_size=32))
EVENT_STRUCTS: st.SearchStrategy[BlockStored | BlockRemoved | AllBlocksCleared] = st.one_of(
    st.builds(BlockStored, st.lists(BLOCK_HASHES, max_size=3), st.none() | BLOCK_HASHES,
              st.lists(st.integers(0, 2**31 - 1), max_size=8), st.integers(1, 64),
              st.none() | st.integers(1, 2**31 - 1), st.sampled_from([MEDIUM_GPU, None])),
    st.builds(BlockRemoved, st.lists(BLOCK_HASHES, max_size=3),
              st.sampled_from([MEDIUM_GPU, None])),
    st.builds(AllBlocksCleared),
)


@given(ts=st.floats(allow_nan=False), events=st.lists(EVENT_STRUCTS, max_size=5),
       rank=st.none() | st.integers(0, 64))
def test_batches_round_trip(ts: float, events: list[Any], rank: int | None) -> None:
    batch = KVEventBatch(ts, events, rank)
    assert BATCH_DECODER.decode(ENCODER.encode(batch)) == batch
    event(f"events: {len(events)}")


# --- byte equality with vLLM 0.13 itself, when its environment is at hand -----------------------

# Runs under vLLM 0.13's interpreter. Reads one Python literal: a list of
# (ts, data_parallel_rank, [(event class name, *fields), ...], impl's bytes as hex).
# Builds each batch from vLLM's own classes, checks vLLM's decoder reads impl's bytes as that
# batch, and prints vLLM's bytes of each batch as hex, one "bytes" line each (vLLM logs to
# stdout too).
VLLM_SIDE = """
import ast, sys
import msgspec
from vllm.distributed import kv_events
encoder = msgspec.msgpack.Encoder()
decoder = msgspec.msgpack.Decoder(kv_events.KVEventBatch)
for ts, rank, events, impl_hex in ast.literal_eval(sys.stdin.read()):
    batch = kv_events.KVEventBatch(
        ts=ts, events=[getattr(kv_events, kind)(*fields) for kind, *fields in events],
        data_parallel_rank=rank)
    decoded = decoder.decode(bytes.fromhex(impl_hex))
    assert decoded == batch, (decoded, batch)
    print("bytes", encoder.encode(batch).hex())
"""


def wire_cases() -> list[KVEventBatch]:
    """Hand-picked batches covering every field's shapes, then seeded random ones."""
    sha = bytes(range(32))
    cases = [
        KVEventBatch(0.0, []),
        KVEventBatch(1_732_000_000.123456, [
            BlockStored([sha, 2**64 - 1, 0], None, [], 16, None, MEDIUM_GPU),
            BlockStored([1], sha, [1, 2, 3], 3, 7, MEDIUM_GPU),
            BlockStored([b"\x00"], 2**63, [2**31 - 1], 1, None, None),
            BlockRemoved([sha], MEDIUM_GPU),
            BlockRemoved([5, 6], None),
            AllBlocksCleared(),
        ], 3),
        KVEventBatch(-2.5, [AllBlocksCleared(), AllBlocksCleared()], 0),
    ]
    rng = random.Random(2024)

    def block_hash() -> int | bytes:
        if rng.random() < 0.5:
            return rng.randrange(2**64)
        return rng.randbytes(rng.choice([8, 32]))

    for _ in range(30):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
        for _ in range(rng.randrange(6)):
            kind = rng.randrange(3)
            if kind == 0:
                block_size = rng.choice([1, 2, 16])
                num_blocks = rng.randrange(1, 4)
                events.append(BlockStored(
                    [block_hash() for _ in range(num_blocks)],
                    rng.choice([None, block_hash()]),
                    [rng.randrange(2**31) for _ in range(num_blocks * block_size)],
                    block_size, rng.choice([None, rng.randrange(1, 100)]), MEDIUM_GPU))
            elif kind == 1:
                events.append(BlockRemoved([block_hash()], MEDIUM_GPU))
            else:
                events.append(AllBlocksCleared())
        cases.append(KVEventBatch(rng.uniform(0, 2e9), events,
                                  rng.choice([None, rng.randrange(8)])))
    return cases


def as_literal(batch: KVEventBatch) -> tuple[Any, ...]:
    events = [(type(e).__name__, *(getattr(e, f) for f in e.__struct_fields__))
              for e in batch.events]
    return (batch.ts, batch.data_parallel_rank, events, ENCODER.encode(batch).hex())


@pytest.mark.slow
def test_events_are_byte_compatible_with_vllm_0_13_when_installed() -> None:
    if not VLLM_PYTHON.exists():
        pytest.skip("no .venv-vllm-0.13.0 (make vllm-env VLLM=0.13.0 builds it)")
    cases = wire_cases()
    payload = repr([as_literal(batch) for batch in cases])
    assert ast.literal_eval(payload) == [as_literal(batch) for batch in cases]  # lossless
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
    proc = subprocess.run([str(VLLM_PYTHON), "-c", VLLM_SIDE], input=payload, env=env,
                          capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = [bytes.fromhex(line.removeprefix("bytes "))
              for line in proc.stdout.splitlines() if line.startswith("bytes ")]
    assert len(theirs) == len(cases)
    for batch, their_bytes in zip(cases, theirs, strict=True):
        assert ENCODER.encode(batch) == their_bytes
        assert BATCH_DECODER.decode(their_bytes) == batch


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
    assert aggregator.get_all_events() == [stored(1), stored(1), BlockRemoved([5], "GPU"),
                                           AllBlocksCleared()]
    aggregator.clear_events()
    assert aggregator.get_all_events() == [] and aggregator.get_common_events() == []
    aggregator.increment_workers(2)
    assert aggregator.get_number_of_workers() == 4
    aggregator.reset_workers()
    assert aggregator.get_number_of_workers() == 1
    assert "num_workers=1" in repr(aggregator)


def test_aggregators_combine_through_all_events() -> None:
    """A combined aggregator fed each worker aggregator's events counts as if fed directly."""
    first, second = KVEventAggregator(1), KVEventAggregator(1)
    first.add_events([stored(1), stored(2)])
    second.add_events([stored(1)])
    combined = KVEventAggregator(1)
    combined.add_events(first.get_all_events())
    combined.increment_workers(1)
    combined.add_events(second.get_all_events())
    assert combined.get_common_events() == [stored(1)]


@pytest.mark.parametrize("bad", [(stored(1),), {stored(1)}, None, stored(1), [stored(1), 3]])
def test_aggregator_refuses_bad_events_and_changes_nothing(bad: Any) -> None:
    aggregator = KVEventAggregator(1)
    aggregator.add_events([stored(7)])
    with pytest.raises(InvalidEventsError):
        aggregator.add_events(bad)
    assert aggregator.get_all_events() == [stored(7)]
    assert issubclass(InvalidEventsError, TypeError) and issubclass(InvalidEventsError, ValueError)


@pytest.mark.parametrize("count", [0, -1, 1.5, True])
def test_aggregator_refuses_a_worker_increment_below_one(count: Any) -> None:
    aggregator = KVEventAggregator(3)
    with pytest.raises(InvalidWorkerCountError, match=repr(count)):
        aggregator.increment_workers(count)
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
    assert aggregator.get_all_events() == [e for e, c in counts.items() for _ in range(c)]
    event(f"common events: {len(aggregator.get_common_events())}")


# --- bounded pending events (impl/block_pool.py, Bounded events; spec/pool.py _bound_events) ---


@dataclass
class _Request:
    block_hashes: list[bytes]
    all_token_ids: list[int]
    lora_request: Any = None


def _key(family: int, index: int) -> bytes:
    return bytes([family, index]) * 16


def _cache(pool: BlockPool, family: int, num_blocks: int, group: int = 0,
           block_size: int = 2) -> list[KVCacheBlock]:
    blocks = pool.get_new_blocks(num_blocks)
    hashes = [_key(family, i) for i in range(num_blocks * block_size // pool.hash_block_size)]
    pool.cache_full_blocks(_Request(hashes, list(range(num_blocks * block_size))), blocks, 0,
                           num_blocks, block_size, group)
    return blocks


def _replay(events: list[KVCacheEvent]) -> Counter[Any]:
    """What a consumer that applies Stored/Removed/Cleared in order ends with."""
    keys: Counter[Any] = Counter()
    for item in events:
        if isinstance(item, BlockStored):
            keys.update(item.block_hashes)
        elif isinstance(item, BlockRemoved):
            keys.subtract(item.block_hashes)
        else:
            keys.clear()
    return +keys


def _cached(pool: BlockPool) -> Counter[Any]:
    return Counter(maybe_convert_block_hash(BlockHash(key[:-4]))
                   for key, blocks in pool.cached_block_hash_to_block.items() for _ in blocks)


def test_events_are_unbounded_by_default() -> None:
    """Without the keyword the pool is vLLM's: every event waits for take_events."""
    pool = BlockPool(8, True, 2, True)
    assert pool.max_pending_kv_events is None
    for family in range(20):
        blocks = _cache(pool, family, 3)
        pool.free_blocks(reversed(blocks))
    kinds = Counter(type(item).__name__ for item in pool.kv_event_queue)
    assert kinds["BlockStored"] == 20 and kinds["BlockRemoved"] > 20
    assert "AllBlocksCleared" not in kinds and pool.num_kv_event_collapses == 0


def test_a_collapse_is_a_snapshot_of_the_cache() -> None:
    """AllBlocksCleared, then one BlockStored per cached block in block id order, with what
    the pool keeps of it: the hash, its group's block size, no parent, tokens or LoRA."""
    pool = BlockPool(8, True, 2, True, max_pending_kv_events=3)
    queue = pool.kv_event_queue
    [small] = _cache(pool, 1, 1, group=0, block_size=2)
    [large] = _cache(pool, 2, 1, group=1, block_size=4)
    for family in (3, 4):  # a block cached and evicted: two more events, no more cached
        [churn] = _cache(pool, family, 1)
        pool.evict_blocks([churn.block_id])
        pool.free_blocks([churn])
    # Four pending after the first churn: more than 3, but collapsing into a snapshot of 3
    # would not halve them; six after the second: they collapse.
    assert pool.num_kv_event_collapses == 1
    assert queue == [
        AllBlocksCleared(),
        BlockStored([maybe_convert_block_hash(BlockHash(_key(1, 0)))], None, [], 2, None,
                    MEDIUM_GPU),
        BlockStored([maybe_convert_block_hash(BlockHash(_key(2, 0) + _key(2, 1)))], None, [], 4,
                    None, MEDIUM_GPU),
    ]
    assert [small.block_id, large.block_id] == [1, 2]
    assert pool.kv_event_queue is queue  # replaced in place: a caller may hold it
    pool.free_blocks([small, large])
    pool.evict_blocks([1, 2])  # five pending, nothing cached: the snapshot is one event
    assert pool.num_kv_event_collapses == 2 and queue == [AllBlocksCleared()]


ACTIONS = st.sampled_from(["admit"] * 3 + ["finish"] * 2 + ["evict"] * 3 + ["reset", "take"])


@given(num_blocks=st.integers(2, 12), bound=st.integers(1, 8),
       program=st.lists(st.tuples(ACTIONS, st.integers(0, 2**16)), min_size=10, max_size=80))
def test_a_stalled_consumer_still_replays_to_the_cache(num_blocks: int, bound: int,
                                                       program: list[tuple[str, int]]) -> None:
    """Whenever it takes events, a consumer that replays them knows exactly the cached keys;
    pending events never pass max(bound, 2 x cached blocks + 1); snapshots cost no more
    events than the pool really emitted (the amortised bound)."""
    pool = BlockPool(num_blocks, True, 2, True, max_pending_kv_events=bound)
    unbounded = BlockPool(num_blocks, True, 2, True)
    held: list[tuple[list[KVCacheBlock], list[KVCacheBlock]]] = []
    taken: list[KVCacheEvent] = []
    emitted = snapshot_events = 0
    for action, seed in program:
        before = len(pool.kv_event_queue)
        collapses = pool.num_kv_event_collapses
        if action == "admit" and pool.get_num_free_blocks():
            size = 1 + seed % min(3, pool.get_num_free_blocks())
            held.append((_cache(pool, seed % 4, size, seed % 2),
                         _cache(unbounded, seed % 4, size, seed % 2)))
        elif action == "finish" and held:
            mine, theirs = held.pop(seed % len(held))
            pool.free_blocks(reversed(mine))
            unbounded.free_blocks(reversed(theirs))
        elif action == "evict":
            pool.evict_blocks({seed % num_blocks})
            unbounded.evict_blocks({seed % num_blocks})
        elif action == "reset":
            assert pool.reset_prefix_cache() == unbounded.reset_prefix_cache()
        elif action == "take":
            taken += pool.take_events()
            assert _replay(taken) == _cached(pool)
        if pool.num_kv_event_collapses > collapses:
            snapshot_events += len(pool.kv_event_queue)
        emitted = len(unbounded.kv_event_queue)
        assert len(pool.kv_event_queue) <= max(bound, 2 * len(pool._key_of) + 1)
        assert before >= 0
    assert _replay(taken + pool.kv_event_queue) == _cached(pool) == _cached(unbounded)
    assert snapshot_events <= emitted
    event(f"collapses: {min(pool.num_kv_event_collapses, 3)}")


def test_the_spec_with_a_bound_keeps_every_invariant() -> None:
    """spec/pool.py with a bound, every program of a small alphabet from fresh 2- and 3-block
    pools to depth 6: every invariant, events_replay_to_cached_keys and
    pending_events_within_bound included, holds in every state reached (collapses do)."""
    alphabet: list[Callable[[PoolState], PoolState]] = [
        lambda s: spec_pool.get_new_blocks(s, 1)[0],
        lambda s: spec_pool.free_blocks(s, [1]),
        lambda s: spec_pool.free_blocks(s, [2]),
        lambda s: spec_pool.cache_full_blocks(s, [1], [b"k0"], 0, 1, 0, (0, 0), 2),
        lambda s: spec_pool.cache_full_blocks(s, [2], [b"k1"], 0, 1, 1, (1, 1), 4),
        lambda s: spec_pool.evict_blocks(s, [1, 2]),
        lambda s: spec_pool.reset_prefix_cache(s)[0],
        lambda s: spec_pool.take_events(s)[0],
    ]
    collapsed = 0
    for num_blocks, bound in ((3, 1), (3, 2), (4, 1), (4, 3)):
        frontier = {spec_pool.new_pool(num_blocks, True, True, max_pending_events=bound)}
        seen = set(frontier)
        for _ in range(6):
            reached = set()
            for state in frontier:
                for step in alphabet:
                    try:
                        after = step(state)
                    except spec_pool.PoolError:
                        continue
                    assert not pool_invariants.violated(after), (
                        pool_invariants.violated(after), after)
                    reached.add(after)
            frontier = reached - seen
            seen |= frontier
        collapsed += sum(1 for state in seen if state.num_collapses)
    assert collapsed > 100


def test_the_manager_passes_the_bound_to_its_pool() -> None:
    """KVCacheManager(max_pending_kv_events=N): a scheduler whose event consumer stalls keeps
    at most a snapshot's worth of events, and what it finally takes replays to the cache."""
    from kvspec.impl.hashing import get_request_block_hasher, sha256
    from kvspec.impl.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )
    from kvspec.impl.kv_cache_manager import KVCacheManager
    from kvspec.impl.request import Request

    spec = FullAttentionSpec(4, 1, 8, "float16")
    config = KVCacheConfig(16, (KVCacheTensor(16 * spec.page_size_bytes, ("l0",)),),
                           (KVCacheGroupSpec(("l0",), spec),))
    with pytest.raises(ValueError, match=r"max_pending_kv_events.*-1"):
        KVCacheManager(config, 64, 4, enable_kv_cache_events=True, max_pending_kv_events=-1)
    manager = KVCacheManager(config, 64, 4, enable_kv_cache_events=True,
                             max_pending_kv_events=8)
    assert manager.block_pool.max_pending_kv_events == 8
    hasher = get_request_block_hasher(4, sha256)
    for index in range(200):  # nobody takes the events
        request = Request(str(index), [index % 7] * 4 + list(range(index, index + 8)),
                          block_hasher=hasher)
        hits, num_hits = manager.get_computed_blocks(request)
        assert manager.allocate_slots(request, request.num_tokens - num_hits, num_hits,
                                      hits) is not None
        manager.free(request)
        assert len(manager.block_pool.kv_event_queue) <= max(8, 2 * 15 + 1)
    assert manager.block_pool.num_kv_event_collapses > 0
    assert _replay(manager.take_events()) == _cached(manager.block_pool)


# --- vLLM 0.33's names, kept here (the family itself: tests/test_kv_events_033.py) -------------


def test_0_33_names_are_still_importable_from_kv_events() -> None:
    """vLLM 0.33's family has its own module; kv_events, where it was, still gives its names
    (the same objects), and only those."""
    from kvspec.impl import kv_events
    from kvspec.impl.kv_events import BlockStoredV033

    assert BlockStoredV033 is kv_events_033.BlockStoredV033
    for name in kv_events.MOVED_TO_KV_EVENTS_033:
        assert getattr(kv_events, name) is getattr(kv_events_033, name)
    with pytest.raises(AttributeError, match="no attribute 'BlockStoredV099'"):
        kv_events.BlockStoredV099  # noqa: B018
