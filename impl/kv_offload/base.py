"""The offloading API's shared names, as vLLM 0.33's ``vllm/v1/kv_offload/base.py``.

vLLM 0.33 keys an offloaded block by its block hash and its KV cache group index packed
into bytes (``make_offload_key``), passes every manager call the request's ``ReqContext``,
and answers a lookup per key with a ``LookupResult``. These are the names a caller of
kvspec's ``CPUOffloadingManager`` (``cpu_manager.py``) needs; the manager also accepts
vLLM's own ``ReqContext`` objects (it reads ``req_id`` and uses ``get_state`` /
``set_state``). Pure Python: nothing here imports vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any, NewType, TypeVar

# A block's key: its block hash followed by its group index (4 bytes, big-endian).
OffloadKey = NewType("OffloadKey", bytes)

_GROUP_BYTES = 4

_T = TypeVar("_T")


def make_offload_key(block_hash: bytes, group_idx: int) -> OffloadKey:
    """Pack a block hash and a KV cache group index into one key."""
    return OffloadKey(bytes(block_hash) + group_idx.to_bytes(_GROUP_BYTES, "big", signed=False))


def get_offload_block_hash(key: OffloadKey) -> bytes:
    """The block hash a key was made from."""
    return key[:-_GROUP_BYTES]


def get_offload_group_idx(key: OffloadKey) -> int:
    """The KV cache group index a key was made from."""
    return int.from_bytes(key[-_GROUP_BYTES:], "big", signed=False)


class Medium(Enum):
    """Where an offloading tier keeps its copies."""

    CPU = "CPU"
    STORAGE = "STORAGE"


class LookupResult(Enum):
    """One key's answer to ``lookup``: absent, ready, stored but not yet written, or ask
    again later (kvspec's CPU tier never answers RETRY)."""

    MISS = auto()
    HIT = auto()
    HIT_PENDING = auto()
    RETRY = auto()


class OffloadPolicy(Enum):
    """Which of a request's chunks the connector offers for storing."""

    CHUNK_LEVEL = "chunk_level"
    REQUEST_LEVEL = "request_level"


@dataclass
class RequestOffloadingContext:
    """What ``on_new_request`` tells the connector about a request."""

    policy: OffloadPolicy = OffloadPolicy.CHUNK_LEVEL


@dataclass
class ReqContext:
    """One request, as the connector passes it to every manager call, for its whole life.

    ``get_state`` / ``set_state`` keep per-request scratch values, one per type, so that a
    manager can remember what the request did (kvspec's CPU manager keeps its record of the
    request's accesses there). Positions are accepted for vLLM's shape; kvspec's manager
    does not use them (docs/offload.md).
    """

    req_id: str
    kv_transfer_params: dict[str, Any] | None = None
    _state: dict[type, Any] = field(default_factory=dict, repr=False, init=False)
    _positions: dict[bytes, int] = field(default_factory=dict, repr=False, init=False)

    def set_state(self, val: Any) -> None:
        self._state[type(val)] = val

    def get_state(self, cls: type[_T]) -> _T | None:
        found: _T | None = self._state.get(cls)
        return found

    def set_offload_key_position(self, key: OffloadKey, end_token: int) -> None:
        self._positions[key] = end_token

    def get_offload_key_position(self, key: OffloadKey) -> int | None:
        return self._positions.get(key)


class LoadStoreSpec:
    """Where a worker reads (and possibly writes) blocks."""


@dataclass
class CPULoadStoreSpec(LoadStoreSpec):
    """The CPU tier's chunks a transfer reads or writes, in the keys' order."""

    chunk_ids: list[int]

    @property
    def block_ids(self) -> list[int]:
        return self.chunk_ids

    @staticmethod
    def medium() -> str:
        return Medium.CPU.value


@dataclass
class PrepareStoreOutput:
    """What ``prepare_store`` decided: the keys to write, where, and the keys it evicted."""

    keys_to_store: list[OffloadKey]
    store_spec: LoadStoreSpec
    evicted_keys: list[OffloadKey]


@dataclass
class OffloadingEvent:
    """Keys stored (``removed=False``) in or removed from a medium. A removal that is
    ``metadata_only`` drops keys whose store failed: they were never announced stored."""

    keys: list[OffloadKey]
    medium: Medium
    removed: bool
    locality: Any = None
    ownership: str | None = None
    removal_expected: bool = False
    metadata_only: bool = False
