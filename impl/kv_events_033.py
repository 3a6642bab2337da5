"""vLLM 0.33's KV-cache events on the wire (``vllm/distributed/kv_events.py`` of 0.33.x), and
the table of both releases' event families (``event_classes``).

vLLM 0.33 (PR #42892) dropped ``array_like`` from ``KVCacheEvent``: each event is a msgpack
map ``{"type": tag, name: value, ...}``, written with ``omit_defaults`` (a field still at its
default None is left out). ``BlockStored`` gained a required ``lora_name`` and eight optional
fields, ``BlockRemoved`` three; the batch itself stays an array. These classes give vLLM
0.33's bytes (``spec.events.encode_batch`` under the vllm-0.33 profile states them), and
``KVEventBatchV033`` decodes vLLM 0.33's. They subclass 0.13's ``KVCacheEvent``
(``kvspec.impl.kv_events``, where 0.13's family lives) with ``array_like`` turned off, so the
aggregator counts them; their tags are vLLM's class names.

vLLM 0.33's pool (``kvspec.impl.block_pool_033``) builds these next to any vLLM but 0.33, and
vLLM's own classes inside a vLLM 0.33 process. Like 0.13's, building an event checks nothing
(``kvspec.impl.kv_events`` says why).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from kvspec.impl.errors import InvalidEventsError
from kvspec.impl.hashing import ExternalBlockHash
from kvspec.impl.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVCacheEvent,
    KVEventBatch,
)

__all__ = [
    "EVENT_CLASSES",
    "AllBlocksClearedV033",
    "BlockRemovedV033",
    "BlockStoredV033",
    "EventClasses",
    "KVCacheEventV033",
    "KVEventBatchV033",
    "event_classes",
]


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


# --------------------------------------------------------------------- both families, by profile


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
