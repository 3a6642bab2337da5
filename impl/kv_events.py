"""KV-cache events on vLLM's wire (``vllm/distributed/kv_events.py``): msgspec structs, vLLM
0.13's array-encoded ones (``BlockStored``, ...) and vLLM 0.33's map-encoded ones
(``BlockStoredV033``, ..., below; ``event_classes`` picks by profile).

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

from collections import Counter
from typing import Any, NamedTuple, SupportsIndex

import msgspec

from kvspec.impl.checks import as_int
from kvspec.impl.errors import (
    InvalidEventsError,
    InvalidWorkerCountError,
)
from kvspec.impl.hashing import ExternalBlockHash

__all__ = [
    "EVENT_CLASSES",
    "MEDIUM_GPU",
    "AllBlocksCleared",
    "AllBlocksClearedV033",
    "BlockRemoved",
    "BlockRemovedV033",
    "BlockStored",
    "BlockStoredV033",
    "EventBatch",
    "EventClasses",
    "InvalidEventsError",
    "InvalidWorkerCountError",
    "KVCacheEvent",
    "KVCacheEventV033",
    "KVEventAggregator",
    "KVEventBatch",
    "KVEventBatchV033",
    "event_classes",
]

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


# --------------------------------------------------------------------------- vLLM 0.33's wire
#
# vLLM 0.33 (PR #42892) dropped ``array_like`` from ``KVCacheEvent``: each event is a msgpack
# map ``{"type": tag, name: value, ...}``, written with ``omit_defaults`` (a field still at its
# default None is left out). ``BlockStored`` gained a required ``lora_name`` and eight optional
# fields, ``BlockRemoved`` three; the batch itself stays an array. These classes give vLLM
# 0.33's bytes (``spec.events.encode_batch`` under the vllm-0.33 profile states them), and
# ``KVEventBatchV033`` decodes vLLM 0.33's. They subclass ``KVCacheEvent`` (so the aggregator
# counts them) with ``array_like`` turned off; their tags are vLLM's class names.
# ``event_classes`` picks a release's family.


class KVCacheEventV033(KVCacheEvent, array_like=False, frozen=True):
    """Base class of vLLM 0.33's map-encoded events."""


def _frozen(value: Any) -> Any:
    """``value`` with every list a tuple, all the way down: a decoded event's extra keys hold
    lists (msgpack has one array type), which ``hash`` refuses."""
    if isinstance(value, list | tuple):
        return tuple(_frozen(v) for v in value)
    return value


class BlockStoredV033(KVCacheEventV033, tag="BlockStored", frozen=True):
    """vLLM 0.33's ``BlockStored``: 0.13's fields, the LoRA name, and the optional fields."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    # One entry per hash, untagged (``hashing.to_event_extra_keys``).
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    # The L tokens after each block that its hash covers (lookahead hashing); None without.
    lookahead_token_ids: list[list[int]] | None = None

    def __hash__(self) -> int:
        return hash((
            tuple(self.block_hashes), self.parent_block_hash, tuple(self.token_ids),
            self.block_size, self.lora_id, self.medium, self.lora_name,
            _frozen(self.extra_keys), self.group_idx, self.kv_cache_spec_kind,
            self.kv_cache_spec_sliding_window, self.locality, self.ownership, self.session_id,
            _frozen(self.lookahead_token_ids),
        ))


class BlockRemovedV033(KVCacheEventV033, tag="BlockRemoved", frozen=True):
    """vLLM 0.33's ``BlockRemoved``: one per removed key, with its group."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None

    def __hash__(self) -> int:
        return hash((tuple(self.block_hashes), self.medium, self.group_idx, self.locality,
                     self.ownership))


class AllBlocksClearedV033(KVCacheEventV033, tag="AllBlocksCleared", frozen=True):
    """The whole prefix cache was reset (``{"type": "AllBlocksCleared"}``)."""


class KVEventBatchV033(EventBatch):
    """A batch of vLLM 0.33's events (the batch is still an array)."""

    events: list[BlockStoredV033 | BlockRemovedV033 | AllBlocksClearedV033]


class EventClasses(NamedTuple):
    """One release's event classes."""

    BlockStored: type[KVCacheEvent]
    BlockRemoved: type[KVCacheEvent]
    AllBlocksCleared: type[KVCacheEvent]
    KVEventBatch: type[EventBatch]


EVENT_CLASSES: dict[str, EventClasses] = {
    "vllm-0.13": EventClasses(BlockStored, BlockRemoved, AllBlocksCleared, KVEventBatch),
    "vllm-0.33": EventClasses(BlockStoredV033, BlockRemovedV033, AllBlocksClearedV033,
                              KVEventBatchV033),
}


def event_classes(profile: str) -> EventClasses:
    """The event classes of a spec profile (``"vllm-0.13"``: arrays; ``"vllm-0.33"``: maps
    with the new fields); kvspec's own profile, ``"kvspec"``, writes 0.13's arrays."""
    if profile == "kvspec":
        profile = "vllm-0.13"
    try:
        return EVENT_CLASSES[profile]
    except (KeyError, TypeError):
        raise InvalidEventsError(
            f"no event classes for profile {profile!r}; expected one of "
            f"{sorted(EVENT_CLASSES)} or 'kvspec'") from None


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
