"""Hostile input to the block pool, its free queue, its prefix-cache map and its blocks.

Subjects are pools of 2 to 16 blocks after a random run of valid operations (allocation,
caching under two groups, hits on free and used blocks, freeing, eviction), so that a bad call
meets blocks in every state: free and keyed, in use and shared, never handed out, the null
block. The snapshot is everything a caller can see: each block's ref count and key, the free
order and count, the key map, pending events, usage, and the metrics collector's samples.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import given, strategies as st

from kvspec.impl.block_pool import (
    MAX_NUM_GPU_BLOCKS,
    BlockHashToBlockMap,
    BlockPool,
    InvalidBlockCountError,
)
from kvspec.impl.hashing import get_request_block_hasher, sha256
from kvspec.impl.kv_cache_metrics import KVCacheMetricsCollector
from kvspec.impl.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock
from kvspec.impl.request import LoRARequest, Request
from tests.hostile import BadCall, check
from tests.hostile.values import (
    Bad,
    HalfwayError,
    Opaque,
    bad_count,
    bad_int,
    bad_positive,
    halfway,
    not_an_int,
    not_bytes,
    not_iterable,
)

BLOCK_SIZE = 2


# ---------------------------------------------------------------------- subjects


@dataclass
class PoolSubject:
    pool: BlockPool
    requests: list[Request]
    held: list[list[KVCacheBlock]]  # blocks each live request holds (one reference each)
    other: BlockPool                # another pool, for its blocks

    def __repr__(self) -> str:
        return (f"PoolSubject(num_blocks={self.pool.num_gpu_blocks}, "
                f"caching={self.pool.enable_caching}, free={self.pool.get_num_free_blocks()})")


def _request(request_id: str, family: int, num_blocks: int) -> Request:
    tokens = [family * 1000 + i for i in range(num_blocks * BLOCK_SIZE + 1)]
    return Request(request_id, tokens, block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
                   lora_request=LoRARequest("lora", 7) if family == 2 else None)


@st.composite
def pools(draw: st.DrawFn) -> PoolSubject:
    num_blocks = draw(st.integers(2, 16))
    caching = draw(st.booleans())
    collector = KVCacheMetricsCollector(1.0, rng=random.Random(0)) if draw(st.booleans()) else None
    pool = BlockPool(num_blocks, caching, BLOCK_SIZE, draw(st.booleans()), collector)
    subject = PoolSubject(pool, [], [], BlockPool(4, True, BLOCK_SIZE))
    subject.other.get_new_blocks(2)
    for step in range(draw(st.integers(0, 6))):
        free = pool.get_num_free_blocks()
        action = draw(st.sampled_from(["admit", "admit", "finish", "evict"]))
        if action == "admit" and free:
            family = draw(st.integers(0, 2))
            size = draw(st.integers(1, min(free, 4)))
            request = _request(f"r{step}", family, size)
            hits = []
            if caching:
                for block_hash in request.block_hashes[:size]:
                    found = pool.get_cached_block(block_hash, [0])
                    if found is None:
                        break
                    hits.append(found[0])
                evictable = sum(1 for b in hits if b.ref_cnt == 0)
                if size - len(hits) + evictable > free:
                    continue
                pool.touch((hits,))
            blocks = hits + pool.get_new_blocks(size - len(hits))
            if caching:
                pool.cache_full_blocks(request, blocks, len(hits), size, BLOCK_SIZE,
                                       draw(st.sampled_from([0, 0, 1])) if not hits else 0)
            subject.requests.append(request)
            subject.held.append(blocks)
        elif action == "finish" and subject.held:
            index = draw(st.integers(0, len(subject.held) - 1))
            pool.free_blocks(reversed(subject.held.pop(index)))
            subject.requests.pop(index)
        elif action == "evict":
            pool.evict_blocks({draw(st.integers(0, num_blocks - 1))})
    return subject


def pool_snapshot(subject: PoolSubject) -> object:
    pool = subject.pool
    blocks = list(pool.blocks)
    collector: Any = pool.metrics_collector  # impl's collector: its recorded samples
    return (
        tuple((b.ref_cnt, b.block_hash) for b in blocks if not b.is_null),
        tuple(b.block_id for b in pool.free_block_queue.get_all_free_blocks()),
        pool.free_block_queue.num_free_blocks,
        tuple((key, tuple(b.block_id for b in found))
              for key, found in pool.cached_block_hash_to_block.items()),
        tuple(pool.kv_event_queue),
        pool.get_usage(),
        None if collector is None else (tuple(collector.block_metrics),
                                        len(collector._eviction_events)),
    )


# ---------------------------------------------------------------------- bad blocks


def _free_block(subject: PoolSubject) -> KVCacheBlock | None:
    free = subject.pool.free_block_queue.get_all_free_blocks()
    return free[0] if free else None


@st.composite
def bad_block(draw: st.DrawFn, subject: PoolSubject, *, free_is_bad: bool) -> Bad:
    """A value that is not a block this call may take."""
    choices = [
        Bad(None, "None"), Bad(3, "3"), Bad(Opaque(), "Opaque()"),
        Bad(KVCacheBlock(1), "KVCacheBlock(1) made outside any pool", ("block_id=1",)),
        Bad(subject.other.blocks[1], "a block of another pool", ("block_id=1",)),
    ]
    free = _free_block(subject)
    if free_is_bad and free is not None:
        choices.append(Bad(free, f"pool.blocks[{free.block_id}] (free)",
                           (f"block {free.block_id}", f"block_id={free.block_id}")))
    return draw(st.sampled_from(choices))


def _held(subject: PoolSubject) -> list[KVCacheBlock]:
    return [b for blocks in subject.held for b in blocks]


# ---------------------------------------------------------------------- bad calls


@st.composite
def pool_bad_calls(draw: st.DrawFn, subject: PoolSubject) -> BadCall:
    pool = subject.pool
    held = _held(subject)
    operation = draw(st.sampled_from(sorted(_POOL_CALLS)))
    call: BadCall = draw(_POOL_CALLS[operation](subject, pool, held))
    return BadCall(call.describe, call.run, call.bad, call.named, call.propagates,
                   call.accepted, operation)


def _call(describe: str, run: Any, bad: Bad | None = None, **kwargs: Any) -> BadCall:
    if bad is None:
        return BadCall(describe, run, **kwargs)
    return BadCall(describe, run, bad.value, bad.forms, **kwargs)


@st.composite
def _get_new_blocks(draw: st.DrawFn, s: PoolSubject, pool: BlockPool, held: Any) -> BadCall:
    too_many = st.integers(pool.get_num_free_blocks() + 1, pool.num_gpu_blocks + 3)
    bad = draw(st.one_of(bad_count(), too_many.map(lambda v: Bad(v, repr(v)))))
    return _call(f"pool.get_new_blocks({bad.label})",
                 lambda s: s.pool.get_new_blocks(bad.value), bad)


@st.composite
def _free_blocks(draw: st.DrawFn, s: PoolSubject, pool: BlockPool, held: Any) -> BadCall:
    kind = draw(st.sampled_from(["bad block", "not iterable", "over-freed", "halfway"]))
    if kind == "not iterable":
        bad = draw(not_iterable())
        return _call(f"pool.free_blocks({bad.label})", lambda s: s.pool.free_blocks(bad.value), bad)
    good = draw(st.lists(st.sampled_from(held), max_size=3, unique_by=id)) if held else []
    if kind == "halfway":
        return _call(f"pool.free_blocks(<iterator of {len(good)} held blocks, then fails>)",
                     lambda s: s.pool.free_blocks(halfway(good)), propagates=HalfwayError)
    if kind == "over-freed" and held:
        block = draw(st.sampled_from(held))
        extra = block.ref_cnt
        listed = good + [block] * (extra + 1 - good.count(block))
        return _call(f"pool.free_blocks([... block {block.block_id} x{len(listed) - len(good)} "
                     f"with ref count {extra}])",
                     lambda s: s.pool.free_blocks(listed), named=(f"block {block.block_id}",))
    bad = draw(bad_block(s, free_is_bad=True))
    position = draw(st.integers(0, len(good)))
    listed = [*good[:position], bad.value, *good[position:]]
    return _call(f"pool.free_blocks([<{len(good)} held blocks> with {bad.label}])",
                 lambda s: s.pool.free_blocks(listed), bad)


@st.composite
def _touch(draw: st.DrawFn, s: PoolSubject, pool: BlockPool, held: Any) -> BadCall:
    kind = draw(st.sampled_from(["bad block", "not iterable", "halfway", "bad group"]))
    if kind == "not iterable":
        bad = draw(not_iterable())
        return _call(f"pool.touch({bad.label})", lambda s: s.pool.touch(bad.value), bad)
    good = draw(st.lists(st.sampled_from(held), max_size=3, unique_by=id)) if held else []
    if kind == "halfway":
        return _call(f"pool.touch((<iterator of {len(good)} held blocks, then fails>,))",
                     lambda s: s.pool.touch((halfway(good),)), propagates=HalfwayError)
    if kind == "bad group":
        bad = draw(not_iterable())
        return _call(f"pool.touch(([...], {bad.label}))",
                     lambda s: s.pool.touch((good, bad.value)), bad)
    bad = draw(bad_block(s, free_is_bad=False).filter(lambda b: b.value is not None or True))
    listed = [*good, bad.value]
    flat = draw(st.booleans())
    arg: Any = listed if flat else (listed,)
    return _call(f"pool.touch({'' if flat else '('}[<{len(good)} held>, {bad.label}]"
                 f"{'' if flat else ',)'})", lambda s: s.pool.touch(arg), bad)


@st.composite
def _evict_blocks(draw: st.DrawFn, s: PoolSubject, pool: BlockPool, held: Any) -> BadCall:
    kind = draw(st.sampled_from(["bad id", "not iterable", "halfway"]))
    if kind == "not iterable":
        bad = draw(not_iterable())
        return _call(f"pool.evict_blocks({bad.label})", lambda s: s.pool.evict_blocks(bad.value),
                     bad)
    good = draw(st.lists(st.integers(0, pool.num_gpu_blocks - 1), max_size=3, unique=True))
    if kind == "halfway":
        return _call(f"pool.evict_blocks(<iterator of {good}, then fails>)",
                     lambda s: s.pool.evict_blocks(halfway(good)), propagates=HalfwayError)
    bad = draw(bad_int(0, pool.num_gpu_blocks - 1))
    ids = [*good, bad.value]  # a list: in a set, 1+0j or True would merge with the id 1
    return _call(f"pool.evict_blocks([<{len(good)} ids>, {bad.label}])",
                 lambda s: s.pool.evict_blocks(ids), bad)


@st.composite
def _get_cached_block(draw: st.DrawFn, s: PoolSubject, pool: BlockPool, held: Any) -> BadCall:
    if draw(st.booleans()):
        bad = draw(not_bytes())
        return _call(f"pool.get_cached_block({bad.label}, [0])",
                     lambda s: s.pool.get_cached_block(bad.value, [0]), bad)
    known = _known_hash(s)
    if draw(st.booleans()):
        bad = draw(not_iterable())
        return _call(f"pool.get_cached_block(<hash>, {bad.label})",
                     lambda s: s.pool.get_cached_block(known, bad.value), bad)
    bad = draw(bad_int(0, 2**32 - 1))
    return _call(f"pool.get_cached_block(<hash>, [0, {bad.label}])",
                 lambda s: s.pool.get_cached_block(known, [0, bad.value]), bad)


def _known_hash(s: PoolSubject) -> bytes:
    for request in s.requests:
        if request.block_hashes:
            return request.block_hashes[0]
    return b"\x00" * 32


@st.composite
def _get_cached_prefix(draw: st.DrawFn, s: PoolSubject, pool: BlockPool, held: Any) -> BadCall:
    known = _known_hash(s)
    which = draw(st.sampled_from(["hashes", "group", "max"]))
    if which == "hashes":
        if draw(st.booleans()):
            bad = draw(not_iterable().filter(lambda b: b.value is not None))
            return _call(f"pool.get_cached_prefix({bad.label}, 0, 2)",
                         lambda s: s.pool.get_cached_prefix(bad.value, 0, 2), bad)
        bad = draw(not_bytes())
        # Like get_cached_block in a loop, the lookup stops at the first miss and reads no
        # further: a malformed hash after a miss is not looked at.
        hit = pool.get_cached_block(known, [0]) is not None
        accepted = "" if hit else ("a malformed hash after the first miss: the lookup stops "
                                   "at the miss, as a get_cached_block loop would")
        return _call(f"pool.get_cached_prefix([<{'cached' if hit else 'missing'} hash>, "
                     f"{bad.label}], 0, 2)",
                     lambda s: s.pool.get_cached_prefix([known, bad.value], 0, 2), bad,
                     accepted=accepted)
    if which == "group":
        bad = draw(bad_int(0, 2**32 - 1))
        return _call(f"pool.get_cached_prefix([<hash>], {bad.label}, 1)",
                     lambda s: s.pool.get_cached_prefix([known], bad.value, 1), bad)
    bad = draw(st.one_of(not_an_int(), st.integers(max_value=-1).map(lambda v: Bad(v, repr(v)))))
    return _call(f"pool.get_cached_prefix([<hash>], 0, {bad.label})",
                 lambda s: s.pool.get_cached_prefix([known], 0, bad.value), bad)


@st.composite
def _cache_full_blocks(draw: st.DrawFn, s: PoolSubject, pool: BlockPool, held: Any) -> BadCall:
    fresh = pool.get_num_free_blocks() >= 2
    # A request with 2 full blocks and, when the pool can spare them, 2 blocks in use for it
    # (the subject is rebuilt for each example, so taking them here is part of the setup).
    request = _request("bad", 3, 2)
    blocks = pool.get_new_blocks(2) if fresh else []
    which = draw(st.sampled_from(["request", "blocks", "counts", "block_size", "group",
                                  "token ids", "lora"]))
    args: dict[str, Any] = {"request": request, "blocks": blocks, "num_cached_blocks": 0,
                            "num_full_blocks": len(blocks), "block_size": BLOCK_SIZE,
                            "kv_cache_group_id": 0}
    if which == "request":
        bad = draw(st.sampled_from([Bad(None, "None"), Bad(Opaque(), "Opaque()")]))
        args["request"] = bad.value
    elif which == "blocks":
        # A free block may be keyed (it becomes a cached free block, as the spec allows).
        bad = draw(st.one_of(bad_block(s, free_is_bad=False), not_iterable()))
        args["blocks"] = bad.value if bad.value is None or not blocks else [blocks[0], bad.value]
        args["num_full_blocks"] = 2
    elif which == "counts":
        name = draw(st.sampled_from(["num_cached_blocks", "num_full_blocks"]))
        bad = draw(bad_int(0, len(blocks)))
        args[name] = bad.value
        if name == "num_cached_blocks" and type(bad.value) is int and bad.value >= 0:
            args["num_full_blocks"] = bad.value + 1  # a range to key, past the blocks
    elif which == "block_size":
        bad = draw(st.one_of(bad_positive(), st.sampled_from([Bad(3, "3")])))
        args["block_size"] = bad.value
    elif which == "group":
        bad = draw(bad_int(0, 2**32 - 1))
        args["kv_cache_group_id"] = bad.value
    elif which == "token ids":
        bad = draw(st.sampled_from([Bad(None, "None"), Bad(range(3), "range(0, 3)"),
                                    Bad(["a", "b", "c", "d", "e"], "['a', ...]", ("'a'",))]))
        request.all_token_ids = bad.value
        request._all_token_ids = bad.value
    else:
        bad = Bad(Opaque(), "a lora_request without adapter_id", ("Opaque()",))
        request.lora_request = bad.value
    if which in ("token ids", "lora") and not (
            pool.enable_kv_cache_events and pool.enable_caching and blocks):
        return _call(f"pool.cache_full_blocks(<{which}: {bad.label}>)",
                     lambda s: s.pool.cache_full_blocks(**args), bad,
                     accepted="the pool reads the token ids and the LoRA only to build the "
                              "BlockStored event: with events off, or nothing to key, it does not "
                              "read them")
    return _call(f"pool.cache_full_blocks(<{which}: {bad.label}>)",
                 lambda s: s.pool.cache_full_blocks(**args), bad)


@st.composite
def _blocks_index(draw: st.DrawFn, s: PoolSubject, pool: BlockPool, held: Any) -> BadCall:
    bad = draw(st.one_of(bad_int(-pool.num_gpu_blocks, pool.num_gpu_blocks - 1)
                         .filter(lambda b: not isinstance(b.value, list))))
    return _call(f"pool.blocks[{bad.label}]", lambda s: s.pool.blocks[bad.value], bad)


_POOL_CALLS: dict[str, Any] = {
    "get_new_blocks": _get_new_blocks,
    "free_blocks": _free_blocks,
    "touch": _touch,
    "evict_blocks": _evict_blocks,
    "get_cached_block": _get_cached_block,
    "get_cached_prefix": _get_cached_prefix,
    "cache_full_blocks": _cache_full_blocks,
    "blocks[]": _blocks_index,
}


@given(st.data())
def test_block_pool_refuses_bad_calls_and_changes_nothing(data: st.DataObject) -> None:
    subject = data.draw(pools())
    call = data.draw(pool_bad_calls(subject))
    check(subject, pool_snapshot, call)


# ---------------------------------------------------------------------- constructor


@given(st.data())
def test_block_pool_constructor_refuses_bad_arguments(data: st.DataObject) -> None:
    which = data.draw(st.sampled_from(["num_gpu_blocks", "hash_block_size", "enable_caching",
                                       "enable_kv_cache_events", "metrics_collector"]))
    args: dict[str, Any] = {"num_gpu_blocks": 4, "enable_caching": True, "hash_block_size": 2,
                            "enable_kv_cache_events": False, "metrics_collector": None}
    if which == "num_gpu_blocks":
        bad = data.draw(bad_positive(MAX_NUM_GPU_BLOCKS))
    elif which == "hash_block_size":
        bad = data.draw(bad_positive())
    elif which == "metrics_collector":
        bad = data.draw(st.sampled_from([Bad(Opaque(), "Opaque()"), Bad(1.0, "1.0")]))
    else:
        bad = data.draw(st.sampled_from([Bad(None, "None"), Bad(1, "1"), Bad("yes", "'yes'")]))
    args[which] = bad.value
    check(None, lambda _: None, _call(f"BlockPool({which}={bad.label})",
                                       lambda _: BlockPool(**args), bad))


def test_block_pool_of_2_64_blocks_is_a_typed_refusal() -> None:
    """Block ids are int32 in vLLM's block tables: a pool of more than 2**31 blocks is refused,
    typed and naming the value, never with Python's bare OverflowError or MemoryError."""
    for num_blocks in (2**31 + 1, 2**32, 2**63, 2**64):
        with pytest.raises(InvalidBlockCountError, match=str(num_blocks)):
            BlockPool(num_gpu_blocks=num_blocks, enable_caching=True, hash_block_size=2)


def test_block_pool_takes_numpy_integers_as_ints() -> None:
    """impl's one rule for integers: a numpy integer is taken as the int it holds, once, where
    the pool takes ints (a bool or a float is still refused)."""
    pool = BlockPool(np.int64(6), True, np.int32(2), max_pending_kv_events=np.uint8(8))
    assert (pool.num_gpu_blocks, pool.hash_block_size, pool.max_pending_kv_events) == (6, 2, 8)
    assert type(pool.num_gpu_blocks) is int and type(pool.hash_block_size) is int
    blocks = pool.get_new_blocks(np.int64(2))
    assert len(blocks) == 2 and pool.blocks[np.int16(blocks[0].block_id)] is blocks[0]  # type: ignore[call-overload]
    request = type("R", (), {"block_hashes": [b"h0", b"h1"], "all_token_ids": [1, 2, 3, 4],
                             "lora_request": None})()
    pool.cache_full_blocks(request, blocks, np.int64(0), np.int64(2), np.int64(2), np.int64(0))
    assert pool.get_cached_block(b"h0", [np.int64(0)]) == [blocks[0]]
    hashes: list[Any] = [b"h0", b"h1"]
    assert pool.get_cached_prefix(hashes, np.int8(0), np.int64(5)) == blocks
    pool.evict_blocks([np.int64(blocks[1].block_id)])
    assert blocks[1].block_hash is None
    with pytest.raises(InvalidBlockCountError):
        pool.get_new_blocks(np.float64(1.0))  # type: ignore[arg-type]
    pool.check_representation()


# ---------------------------------------------------------------------- free queue


@dataclass
class QueueSubject:
    queue: FreeKVCacheBlockQueue
    members: list[KVCacheBlock]
    outside: list[KVCacheBlock]


@st.composite
def queues(draw: st.DrawFn) -> QueueSubject:
    blocks = [KVCacheBlock(i) for i in range(draw(st.integers(0, 8)))]
    queue = FreeKVCacheBlockQueue(list(blocks))
    taken = queue.popleft_n(draw(st.integers(0, len(blocks))))
    return QueueSubject(queue, queue.get_all_free_blocks(), taken + [KVCacheBlock(99)])


def queue_snapshot(subject: QueueSubject) -> object:
    queue = subject.queue
    return (tuple(b.block_id for b in queue.get_all_free_blocks()), queue.num_free_blocks)


@st.composite
def queue_bad_calls(draw: st.DrawFn, subject: QueueSubject) -> BadCall:
    queue = subject.queue
    operation = draw(st.sampled_from(["popleft", "popleft_n", "remove", "append", "append_n"]))
    if operation == "popleft":
        if queue.num_free_blocks:
            queue.popleft_n(queue.num_free_blocks)
        return _call("queue.popleft() on an empty queue", lambda s: s.queue.popleft(),
                     named=("No free blocks",), operation=operation)
    if operation == "popleft_n":
        bad = draw(bad_count(queue.num_free_blocks))
        return _call(f"queue.popleft_n({bad.label})", lambda s: s.queue.popleft_n(bad.value),
                     bad, operation=operation)
    if operation == "remove":
        bad = draw(st.sampled_from([Bad(None, "None"), Bad(Opaque(), "Opaque()")]
                                   + [Bad(b, f"block {b.block_id} (not queued)",
                                          (f"block {b.block_id}",)) for b in subject.outside]))
        return _call(f"queue.remove({bad.label})", lambda s: s.queue.remove(bad.value), bad,
                     operation=operation)
    queued = [Bad(b, f"block {b.block_id} (queued)", (f"block {b.block_id}",))
              for b in subject.members]
    bad = draw(st.sampled_from([Bad(None, "None"), Bad(3, "3"), Bad(Opaque(), "Opaque()"),
                                *queued]))
    if operation == "append":
        return _call(f"queue.append({bad.label})", lambda s: s.queue.append(bad.value), bad,
                     operation=operation)
    kind = draw(st.sampled_from(["bad block", "halfway", "duplicate"]))
    if kind == "halfway":
        fresh = [KVCacheBlock(50), KVCacheBlock(51)]
        return _call("queue.append_n(<iterator of 2 blocks, then fails>)",
                     lambda s: s.queue.append_n(halfway(fresh)), propagates=HalfwayError,
                     operation=operation)
    if kind == "duplicate":
        twice = KVCacheBlock(60)
        return _call("queue.append_n([block 60, block 60])",
                     lambda s: s.queue.append_n([twice, twice]), named=("block 60",),
                     operation=operation)
    return _call(f"queue.append_n([block 70, {bad.label}])",
                 lambda s: s.queue.append_n([KVCacheBlock(70), bad.value]), bad,
                 operation=operation)


@given(st.data())
def test_free_queue_refuses_bad_calls_and_changes_nothing(data: st.DataObject) -> None:
    subject = data.draw(queues())
    call = data.draw(queue_bad_calls(subject))
    check(subject, queue_snapshot, call)


# ---------------------------------------------------------------------- hash map and blocks


def map_snapshot(cache_map: BlockHashToBlockMap) -> object:
    return tuple((key, tuple(b.block_id for b in found)) for key, found in cache_map.items())


@given(st.data())
def test_hash_map_refuses_bad_keys_and_changes_nothing(data: st.DataObject) -> None:
    cache_map = BlockHashToBlockMap()
    block = KVCacheBlock(1)
    cache_map.insert(b"hash" + bytes(4), block)
    operation = data.draw(st.sampled_from(["get_one_block", "insert", "pop"]))
    bad = data.draw(st.one_of(not_bytes(), st.sampled_from([Bad(b"abc", "b'abc'")])))
    runs = {
        "get_one_block": lambda m: m.get_one_block(bad.value),
        "insert": lambda m: m.insert(bad.value, KVCacheBlock(2)),
        "pop": lambda m: m.pop(bad.value, 1),
    }
    check(cache_map, map_snapshot, _call(f"cache_map.{operation}({bad.label}, ...)",
                                         runs[operation], bad, operation=operation))


@given(st.data())
def test_pool_blocks_refuse_writes(data: st.DataObject) -> None:
    subject = data.draw(pools())
    block = subject.pool.blocks[subject.pool.num_gpu_blocks - 1]
    which = data.draw(st.sampled_from(["ref_cnt", "block_hash", "reset_hash"]))
    runs = {
        "ref_cnt": lambda s: setattr(block, "ref_cnt", 5),
        "block_hash": lambda s: setattr(block, "block_hash", b"x" * 8),
        "reset_hash": lambda s: block.reset_hash(),
    }
    check(subject, pool_snapshot, _call(f"pool.blocks[-1].{which} = ...", runs[which],
                                        named=(f"block {block.block_id}",), operation=which))


@given(st.data())
def test_standalone_blocks_refuse_bad_fields(data: st.DataObject) -> None:
    """A block made directly (vLLM's dataclass fields): the right type for each field."""
    which = data.draw(st.sampled_from(["block_id", "ref_cnt", "_block_hash", "prev_free_block",
                                       "is_null", "set ref_cnt", "set block_hash",
                                       "set next_free_block", "hash twice"]))
    block = KVCacheBlock(7)
    if which == "hash twice":
        block.block_hash = b"h" * 8
        call = _call("block.block_hash = b'x' * 8 (a second hash)",
                     lambda b: setattr(b, "block_hash", b"x" * 8), named=("block 7",))
    elif which.startswith("set "):
        field_name = which.removeprefix("set ")
        bad = data.draw(not_bytes() if field_name == "block_hash" else
                        st.one_of(not_an_int(), st.just(Bad(3, "3"))) if field_name ==
                        "next_free_block" else not_an_int())
        if field_name == "next_free_block" and bad.value is None:
            bad = Bad(3, "3")
        call = _call(f"block.{field_name} = {bad.label}",
                     lambda b: setattr(b, field_name, bad.value), bad)
    else:
        bad = data.draw(not_bytes().filter(lambda b: b.value is not None)
                        if which == "_block_hash" else not_an_int().filter(
                            lambda b: which != "prev_free_block" or b.value is not None)
                        if which != "is_null" else st.sampled_from(
                            [Bad(None, "None"), Bad(1, "1"), Bad("yes", "'yes'")]))
        args = {which: bad.value}
        block_id = args.pop("block_id", 7)
        call = _call(f"KVCacheBlock({which}={bad.label})",
                     lambda b: KVCacheBlock(block_id, **args), bad)

    def snapshot(b: KVCacheBlock) -> object:
        return (b.block_id, b.ref_cnt, b.block_hash, b.prev_free_block, b.next_free_block,
                b.is_null)
    check(block, snapshot, call)
