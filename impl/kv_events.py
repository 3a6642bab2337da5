"""KV-cache events on vLLM's wire (``vllm/distributed/kv_events.py``): msgspec structs, vLLM
0.13's array-encoded ones (``BlockStored``, ...), and the aggregator. vLLM 0.33's map-encoded
family (``BlockStoredV033``, ...) and ``event_classes``, which picks a family by profile, are
in ``kvspec.impl.kv_events_033``; they are still importable from here (``__getattr__``).

The block pool queues one ``BlockStored`` per ``cache_full_blocks`` call that caches a block,
one ``BlockRemoved`` per evicted key and one ``AllBlocksCleared`` per successful prefix-cache
reset. Publishers (ZMQ) are out of scope; what matters is the bytes a publisher sends, which
are vLLM's: ``msgspec.msgpack.Encoder().encode(KVEventBatch(...))`` of impl's events gives
exactly the bytes vLLM's encoder gives for the same events, and each side's
``msgspec.msgpack.Decoder(KVEventBatch)`` reads the other's. That takes the same struct
options, the same class names, the same fields in the same order, and the same defaults:

* every struct is ``array_like``: it encodes as a msgpack array of its fields in declaration
  order, not a map (a map is what vLLM's decoder refuses with "Expected `array`, got
  `object`"). msgspec writes every field of an array-like struct, ``omit_defaults`` or not:
  an unset ``data_parallel_rank`` goes out as nil; decoders also accept the array without it;
* events are tagged by class name, the tag first in the array::

      KVEventBatch   [ts, [event, ...], data_parallel_rank]
      BlockStored    ["BlockStored", block_hashes, parent_block_hash, token_ids,
                      block_size, lora_id, medium]
      BlockRemoved   ["BlockRemoved", block_hashes, medium]
      AllBlocksCleared ["AllBlocksCleared"]

  A block hash is an int or bytes (``ExternalBlockHash``) and keeps its msgpack type.

Unlike vLLM's, impl's events are frozen: ``KVEventAggregator`` counts them in a ``Counter``,
so they must not change while counted. Equal fields make equal events, and every event is
hashable (list fields hash as tuples, as in vLLM; vLLM's ``AllBlocksCleared`` is unhashable).

Building an event checks nothing, as msgspec and vLLM's classes do: a ``Struct``'s fields are
checked when it is decoded (``msgspec.msgpack.Decoder(KVEventBatch)`` refuses a hash that is
neither int nor bytes), not when it is made. vLLM's callers rely on that (its own tests build
``BlockStored`` with ``str`` hashes, its LMCache connector passes LMCache's values through),
and checking would tax the pool, which builds one ``BlockRemoved`` per eviction (a field
check in ``__post_init__`` takes a ``BlockRemoved`` from about 65 ns to 230 ns). The pool
checks the hashes and token ids it puts in an event before it builds it, so its events always
decode. What consumes events here, the aggregator, refuses one it cannot count.
"""

from __future__ import annotations

import importlib
from collections import Counter
from typing import Any, SupportsIndex

import msgspec

from kvspec.impl.checks import as_int
from kvspec.impl.errors import (
    InvalidEventsError,
    InvalidWorkerCountError,
)
from kvspec.impl.hashing import ExternalBlockHash

__all__ = [
    "MEDIUM_GPU",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "InvalidEventsError",
    "InvalidWorkerCountError",
    "KVCacheEvent",
    "KVEventAggregator",
    "KVEventBatch",
]

# vLLM 0.33's family and the table of both, where they were before they had their own module
# (kvspec.impl.kv_events_033, which imports this one: so they are looked up there on use).
MOVED_TO_KV_EVENTS_033 = frozenset({
    "EVENT_CLASSES", "AllBlocksClearedV033", "BlockRemovedV033", "BlockStoredV033",
    "EventClasses", "KVCacheEventV033", "KVEventBatchV033", "event_classes"})


def __getattr__(name: str) -> object:
    """PEP 562, called only for a name this module lacks: vLLM 0.33's names, from
    ``kvspec.impl.kv_events_033``."""
    if name in MOVED_TO_KV_EVENTS_033:
        return getattr(importlib.import_module("kvspec.impl.kv_events_033"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

MEDIUM_GPU = "GPU"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Events published together, stamped with a time and optionally a data-parallel rank.

    ``events`` is untyped here, as in vLLM: decoding a plain ``EventBatch`` gives each event
    as its raw array; ``KVEventBatch`` decodes them into event structs.
    """

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


# gc=False: events hold only ints, bytes, strings and lists of them, never a cycle, so the
# garbage collector need not track the one the pool builds per eviction. Subclasses inherit
# every option; they repeat frozen=True only for type checkers (dataclass_transform).
class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True,
                   frozen=True):
    """Base class of every KV-cache event; each subclass is tagged with its class name."""


class BlockStored(KVCacheEvent, frozen=True):
    """Blocks newly cached by one ``cache_full_blocks`` call, in chain order."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None

    def __hash__(self) -> int:
        return hash((
            tuple(self.block_hashes),
            self.parent_block_hash,
            tuple(self.token_ids),
            self.block_size,
            self.lora_id,
            self.medium,
        ))


class BlockRemoved(KVCacheEvent, frozen=True):
    """Keys evicted from the prefix cache (one per eviction in the pool)."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None

    def __hash__(self) -> int:
        return hash((tuple(self.block_hashes), self.medium))


class AllBlocksCleared(KVCacheEvent, frozen=True):
    """The whole prefix cache was reset."""


class KVEventBatch(EventBatch):
    """A batch of the KV-cache events the block pool emits."""

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class KVEventAggregator:
    """Counts events reported by several workers; an event all of them reported is common."""

    __slots__ = ("_event_counter", "_num_workers")

    def __init__(self, num_workers: SupportsIndex) -> None:
        workers = _check_worker_count(num_workers, "num_workers")
        self._event_counter: Counter[KVCacheEvent] = Counter()
        self._num_workers = workers

    def add_events(self, events: list[KVCacheEvent]) -> None:
        """Count one worker's events (all or nothing)."""
        if not isinstance(events, list):
            raise InvalidEventsError(f"events must be a list of KVCacheEvent, got {events!r}")
        for event in events:
            if not isinstance(event, KVCacheEvent):
                raise InvalidEventsError(f"not a KVCacheEvent: {event!r}")
        try:  # counted apart first: an event that cannot be hashed leaves the counts as they were
            counted = Counter(events)
        except TypeError:
            unhashable = next(e for e in events if not _hashable(e))
            raise InvalidEventsError(
                f"an event whose fields cannot be hashed cannot be counted: {unhashable!r}"
            ) from None
        self._event_counter.update(counted)

    def get_common_events(self) -> list[KVCacheEvent]:
        """Events every worker has reported, in first-seen order."""
        needed = self._num_workers
        return [event for event, count in self._event_counter.items() if count == needed]

    def get_all_events(self) -> list[KVCacheEvent]:
        """Every event reported, as often as it was reported, grouped in first-seen order.

        With the repeats, one aggregator's events can be added to another (vLLM's connectors
        combine per-worker aggregators that way) and still be counted right.
        """
        return list(self._event_counter.elements())

    def clear_events(self) -> None:
        self._event_counter.clear()

    def increment_workers(self, count: SupportsIndex = 1) -> None:
        increment = _check_worker_count(count, "worker increment")
        self._num_workers += increment

    def reset_workers(self) -> None:
        self._num_workers = 1

    def get_number_of_workers(self) -> int:
        return self._num_workers

    def __repr__(self) -> str:
        return (
            f"KVEventAggregator(num_workers={self._num_workers}, "
            f"events={dict(self._event_counter)})"
        )


def _hashable(event: object) -> bool:
    try:
        hash(event)
    except TypeError:
        return False
    return True


def _check_worker_count(count: object, what: str) -> int:
    """``count`` as a plain int > 0 (an int or a numpy integer, never a bool)."""
    number = as_int(count)
    if number is None or number <= 0:
        raise InvalidWorkerCountError(f"{what} must be an int > 0, got {count!r}")
    return number
