"""KV-cache events with vLLM 0.13's fields (``vllm/distributed/kv_events.py``), no msgspec.

The block pool queues one ``BlockStored`` per ``cache_full_blocks`` call that caches a block,
one ``BlockRemoved`` per evicted key and one ``AllBlocksCleared`` per successful prefix-cache
reset. Events are frozen, slotted dataclasses: equal when their fields are equal, and hashable
(list fields are hashed as tuples) so that ``KVEventAggregator`` can count them across workers.
Publishers (ZMQ) are out of scope.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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

MEDIUM_GPU = "GPU"


class InvalidWorkerCountError(ValueError):
    """A worker count that is not a positive int."""


class InvalidEventsError(TypeError, ValueError):
    """Events handed to the aggregator that are not a list of ``KVCacheEvent``.

    A ``TypeError`` as in vLLM, and a ``ValueError`` like every other bad input here.
    """


@dataclass(frozen=True, slots=True)
class KVCacheEvent:
    """Base class of every KV-cache event."""


# The pool builds one event per eviction: the hand-written __init__ methods below store the
# fields through the slot descriptors, about twice as fast as a frozen dataclass's own __init__
# (which goes through object.__setattr__ per field).


@dataclass(frozen=True, slots=True, init=False)
class BlockStored(KVCacheEvent):
    """Blocks newly cached by one ``cache_full_blocks`` call, in chain order."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None

    def __init__(
        self,
        block_hashes: list[ExternalBlockHash],
        parent_block_hash: ExternalBlockHash | None,
        token_ids: list[int],
        block_size: int,
        lora_id: int | None,
        medium: str | None,
    ) -> None:
        _stored_block_hashes(self, block_hashes)
        _stored_parent_block_hash(self, parent_block_hash)
        _stored_token_ids(self, token_ids)
        _stored_block_size(self, block_size)
        _stored_lora_id(self, lora_id)
        _stored_medium(self, medium)

    def __hash__(self) -> int:
        return hash((
            tuple(self.block_hashes),
            self.parent_block_hash,
            tuple(self.token_ids),
            self.block_size,
            self.lora_id,
            self.medium,
        ))


@dataclass(frozen=True, slots=True, init=False)
class BlockRemoved(KVCacheEvent):
    """Keys evicted from the prefix cache (one per eviction in the pool)."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None

    def __init__(self, block_hashes: list[ExternalBlockHash], medium: str | None) -> None:
        _removed_block_hashes(self, block_hashes)
        _removed_medium(self, medium)

    def __hash__(self) -> int:
        return hash((tuple(self.block_hashes), self.medium))


@dataclass(frozen=True, slots=True)
class AllBlocksCleared(KVCacheEvent):
    """The whole prefix cache was reset."""


def _slot_setter(cls: type, name: str) -> Callable[[object, Any], None]:
    setter: Callable[[object, Any], None] = vars(cls)[name].__set__
    return setter


_stored_block_hashes = _slot_setter(BlockStored, "block_hashes")
_stored_parent_block_hash = _slot_setter(BlockStored, "parent_block_hash")
_stored_token_ids = _slot_setter(BlockStored, "token_ids")
_stored_block_size = _slot_setter(BlockStored, "block_size")
_stored_lora_id = _slot_setter(BlockStored, "lora_id")
_stored_medium = _slot_setter(BlockStored, "medium")
_removed_block_hashes = _slot_setter(BlockRemoved, "block_hashes")
_removed_medium = _slot_setter(BlockRemoved, "medium")


@dataclass(slots=True)
class EventBatch:
    """Events published together, stamped with a time and optionally a data-parallel rank."""

    ts: float
    events: list[KVCacheEvent]
    data_parallel_rank: int | None = None


@dataclass(slots=True)
class KVEventBatch(EventBatch):
    """A batch of the KV-cache events the block pool emits."""


class KVEventAggregator:
    """Counts events reported by several workers; an event all of them reported is common."""

    __slots__ = ("_event_counter", "_num_workers")

    def __init__(self, num_workers: int) -> None:
        _check_worker_count(num_workers)
        self._event_counter: Counter[KVCacheEvent] = Counter()
        self._num_workers = num_workers

    def add_events(self, events: list[KVCacheEvent]) -> None:
        """Count one worker's events (all or nothing)."""
        if not isinstance(events, list):
            raise InvalidEventsError(f"events must be a list of KVCacheEvent, got {events!r}")
        for event in events:
            if not isinstance(event, KVCacheEvent):
                raise InvalidEventsError(f"not a KVCacheEvent: {event!r}")
        self._event_counter.update(events)

    def get_common_events(self) -> list[KVCacheEvent]:
        """Events every worker has reported, in first-seen order."""
        needed = self._num_workers
        return [event for event, count in self._event_counter.items() if count == needed]

    def get_all_events(self) -> list[KVCacheEvent]:
        """Every distinct event reported by any worker, in first-seen order."""
        return list(self._event_counter)

    def clear_events(self) -> None:
        self._event_counter.clear()

    def increment_workers(self, count: int = 1) -> None:
        if type(count) is not int or count < 0:
            raise InvalidWorkerCountError(f"worker increment must be an int >= 0, got {count!r}")
        self._num_workers += count

    def reset_workers(self) -> None:
        self._num_workers = 1

    def get_number_of_workers(self) -> int:
        return self._num_workers

    def __repr__(self) -> str:
        return (
            f"KVEventAggregator(num_workers={self._num_workers}, "
            f"events={dict(self._event_counter)})"
        )


def _check_worker_count(num_workers: object) -> None:
    if type(num_workers) is not int or num_workers <= 0:
        raise InvalidWorkerCountError(f"num_workers must be an int > 0, got {num_workers!r}")
