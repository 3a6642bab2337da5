"""The offloading manager's interface, as vLLM 0.13's ``vllm/v1/kv_offload/abstract.py``.

An offloading manager runs in the scheduler and tracks which KV blocks have a copy in a
slower medium (CPU memory, ...) and where. vLLM's OffloadingConnector drives it through the
seven methods of ``OffloadingManager``; the shapes here are vLLM 0.13's so that the
connector can use kvspec's managers unchanged. What differs is the refusals: where vLLM
asserts (or corrupts its state and goes on), kvspec raises one of the typed errors below,
before anything changes.

Each key has a ref count: -1 while its store is pending, 0 when it is ready and evictable,
n > 0 while n loads hold it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

# The refusals live with every other typed error of impl/ (impl/errors.py); re-exported here.
from kvspec.impl.errors import (
    DuplicateOffloadKey,
    NotPinned,
    StoreNotComplete,
    StoreNotPending,
    UnknownOffloadKey,
)

# A block's key: vLLM passes its BlockHash (bytes); any hashable value works.
OffloadKey = Hashable


# ---------------------------------------- the backend (duck-typed, as vLLM's Backend)


class BlockStatusLike(Protocol):
    """What a backend's block is to the manager: vLLM's ``BlockStatus`` (a ctypes struct)."""

    ref_cnt: int


class BackendLike(Protocol):
    """vLLM 0.13's ``vllm.v1.kv_offload.backend.Backend``, as the managers use it."""

    block_size: int
    medium: str

    def get_num_free_blocks(self) -> int: ...

    def allocate_blocks(self, block_hashes: list[Any]) -> Sequence[Any]: ...

    def free(self, block: Any) -> None: ...

    def get_load_store_spec(self, block_hashes: Iterable[Any],
                            blocks: Iterable[Any]) -> Any: ...


# ---------------------------------------- vLLM 0.13's data classes


class LoadStoreSpec(ABC):
    """Where a worker reads (and possibly writes) blocks: made by the backend."""

    @staticmethod
    @abstractmethod
    def medium() -> str:
        """The medium's name (``"CPU"``, ...)."""


@dataclass
class PrepareStoreOutput:
    """What ``prepare_store`` decided: the keys to write, where, and the keys it evicted."""

    block_hashes_to_store: list[Any]
    store_spec: Any
    block_hashes_evicted: list[Any]


@dataclass
class OffloadingEvent:
    """Keys stored (``removed=False``) in or evicted (``removed=True``) from a medium."""

    block_hashes: list[Any]
    block_size: int
    medium: str
    removed: bool


class OffloadingManager(ABC):
    """vLLM 0.13's manager interface (the connector calls exactly these)."""

    @abstractmethod
    def lookup(self, block_hashes: Iterable[Any]) -> int:
        """How many leading keys are offloaded and ready to read."""

    @abstractmethod
    def prepare_load(self, block_hashes: Iterable[Any]) -> Any:
        """Pin the keys for reading; returns the backend's spec of where they are."""

    def touch(self, block_hashes: Iterable[Any]) -> None:  # noqa: B027 - vLLM's default
        """Mark the keys as recently used (the first key most recently)."""

    def complete_load(self, block_hashes: Iterable[Any]) -> None:  # noqa: B027
        """Unpin keys that ``prepare_load`` pinned."""

    @abstractmethod
    def prepare_store(self, block_hashes: Iterable[Any]) -> PrepareStoreOutput | None:
        """Make room for and allocate the keys not yet held; None when there is no room."""

    def complete_store(self, block_hashes: Iterable[Any],  # noqa: B027
                       success: bool = True) -> None:
        """Mark pending stores as done (readable), or drop them when ``success`` is False."""

    def take_events(self) -> Iterable[OffloadingEvent]:
        """The events collected since the last call, oldest first."""
        return ()


# ---------------------------------------- shared by the managers


def as_key_list(block_hashes: Iterable[Any]) -> list[Any]:
    """The keys as a list (a call may pass any iterable, including a one-shot one)."""
    return block_hashes if isinstance(block_hashes, list) else list(block_hashes)


def check_no_duplicates(keys: list[Any]) -> None:
    """Raise DuplicateOffloadKey naming the first key listed twice."""
    if len(keys) > 1 and len(set(keys)) != len(keys):
        seen: set[Any] = set()
        for key in keys:
            if key in seen:
                raise DuplicateOffloadKey(f"key {key!r} is listed twice in one call")
            seen.add(key)


class RefCountingManager(OffloadingManager):
    """What the LRU and ARC managers share: ref counts, refusals, events, the store skeleton.

    ``_refs`` (a plain dict) maps every held key (pending or ready) to its ref count and
    ``_blocks`` to its backend block; the policy subclasses keep their own order over the
    same keys (the LRU manager's ``_blocks`` is its ordered list) and choose victims.

    Why so: the ref counts change on every load and store, and an ``OrderedDict``'s setitem
    costs a second lookup, so they are in a plain dict. Not one ``[ref, block]`` record per
    key: a record is a container the garbage collector tracks, and a million of them made
    every collection walk them (storing 100,000 keys ran 2.5x slower); ints are not
    tracked. Not the backend's ``BlockStatus.ref_cnt`` either (a ctypes field, slower to
    read and write); the backend never reads it, so it stays at -1.
    """

    def __init__(self, backend: BackendLike, enable_events: bool = False) -> None:
        self.backend = backend
        # The backend is the manager's alone, so its free count at birth is the capacity.
        self.cache_capacity: int = int(backend.get_num_free_blocks())
        self.events: list[OffloadingEvent] | None = [] if enable_events else None
        self._refs: dict[Any, int] = {}
        self._blocks: dict[Any, Any] = {}
        # Keys with ref count 0: a store needing more victims than this fails in O(1).
        self._evictable = 0
        # Keys inspected by victim selection since construction (a structural measure of
        # eviction cost for tests; one add per call).
        self.eviction_steps = 0

    # ------------------------------------------------ policy hooks

    def _choose_victims(self, need: int, protected: set[Any] | None) -> list[Any] | None:
        """``need`` keys with ref count 0 not in ``protected``, in eviction order; None if
        there are not that many. Must not change anything."""
        raise NotImplementedError

    def _forget_victims(self, victims: list[Any]) -> None:
        """Take the victims out of the policy's lists (before ``_refs`` drops them)."""
        raise NotImplementedError

    def _insert(self, keys: list[Any]) -> None:
        """Add new pending keys (``_refs`` already holds them) to the policy's lists."""
        raise NotImplementedError

    def _drop_pending(self, key: Any) -> None:
        """Take a key whose store failed out of the policy's lists (no ghost)."""
        raise NotImplementedError

    # ------------------------------------------------ the interface

    def lookup(self, block_hashes: Iterable[Any]) -> int:
        get = self._refs.get
        hits = 0
        for key in block_hashes:
            ref = get(key)
            if ref is None or ref < 0:
                break
            hits += 1
        return hits

    def _held(self, keys: list[Any]) -> list[int]:
        """The ref counts of ``keys``, refusing a duplicate or an unknown key."""
        check_no_duplicates(keys)
        found: list[int | None] = list(map(self._refs.get, keys))
        if None in found:
            key = keys[found.index(None)]
            raise UnknownOffloadKey(f"key {key!r} is not offloaded")
        return cast("list[int]", found)  # no None left

    def prepare_load(self, block_hashes: Iterable[Any]) -> Any:
        keys = as_key_list(block_hashes)
        found = self._held(keys)
        if found and min(found) < 0:
            for key, ref in zip(keys, found, strict=True):
                if ref < 0:
                    raise StoreNotComplete(f"key {key!r} cannot be loaded: its store is "
                                           "pending")
        refs = self._refs
        for key, ref in zip(keys, found, strict=True):
            refs[key] = ref + 1
        self._evictable -= found.count(0)
        blocks = self._blocks
        return self.backend.get_load_store_spec(keys, [blocks[key] for key in keys])

    def complete_load(self, block_hashes: Iterable[Any]) -> None:
        keys = as_key_list(block_hashes)
        found = self._held(keys)
        if found and min(found) <= 0:
            for key, ref in zip(keys, found, strict=True):
                if ref <= 0:
                    state = "its store is pending" if ref < 0 else "no load holds it"
                    raise NotPinned(f"key {key!r} cannot complete a load: {state}")
        refs = self._refs
        for key, ref in zip(keys, found, strict=True):
            refs[key] = ref - 1
        self._evictable += found.count(1)

    def prepare_store(self, block_hashes: Iterable[Any]) -> PrepareStoreOutput | None:
        keys = as_key_list(block_hashes)
        check_no_duplicates(keys)
        refs = self._refs
        backend = self.backend
        to_store = [key for key in keys if key not in refs]
        if not to_store:
            return PrepareStoreOutput([], backend.get_load_store_spec([], []), [])
        need = len(to_store) - backend.get_num_free_blocks()
        victims: list[Any] = []
        if need > 0:
            if need > self._evictable:
                return None
            # The call's own held keys are never victims (vLLM #35846): a key the caller
            # was just told is offloaded must still be there. With every key new there
            # is nothing to protect.
            protected = None if len(to_store) == len(keys) else set(keys)
            chosen = self._choose_victims(need, protected)
            if chosen is None:
                return None  # nothing was changed: selection is a pure read
            victims = chosen
            self._forget_victims(victims)
            free = backend.free
            held_blocks = self._blocks
            for key in victims:
                del refs[key]
                free(held_blocks.pop(key))
            self._evictable -= need
            if self.events is not None:
                self.events.append(OffloadingEvent(victims, backend.block_size,
                                                   backend.medium, True))
        blocks = backend.allocate_blocks(to_store)
        if len(blocks) != len(to_store):
            # A broken backend, not a bad call: nothing can be rolled back here.
            raise RuntimeError(f"the backend allocated {len(blocks)} blocks for "
                               f"{len(to_store)} keys")
        # Item by item: OrderedDict.update is some 3x slower per key than setitem.
        for key in to_store:
            refs[key] = -1
        held_blocks = self._blocks
        for key, block in zip(to_store, blocks, strict=True):
            held_blocks[key] = block
        self._insert(to_store)
        return PrepareStoreOutput(to_store, backend.get_load_store_spec(to_store, blocks),
                                  victims)

    def complete_store(self, block_hashes: Iterable[Any], success: bool = True) -> None:
        keys = as_key_list(block_hashes)
        found = self._held(keys)
        if found and max(found) >= 0:
            for key, ref in zip(keys, found, strict=True):
                if ref >= 0:
                    raise StoreNotPending(f"key {key!r} has no pending store to complete")
        if success:
            # Assignment keeps each key's place in an ordered map (the LRU list).
            refs = self._refs
            for key in keys:
                refs[key] = 0
            self._evictable += len(keys)
            if self.events is not None and keys:
                backend = self.backend
                self.events.append(OffloadingEvent(list(keys), backend.block_size,
                                                   backend.medium, False))
        else:
            # No event: the pending key was never announced (vLLM 0.13 emits none).
            refs, blocks = self._refs, self._blocks
            free = self.backend.free
            for key in keys:
                self._drop_pending(key)
                del refs[key]
                free(blocks.pop(key))

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self.events is None:
            return
        # Detach first: a consumer that stops early does not see these events again.
        events, self.events = self.events, []
        yield from events

    # ------------------------------------------------ the representation invariant

    def _check_counts(self) -> None:
        """Ref counts in range, the evictable count true, the backend's free count matching."""
        evictable = 0
        for key, ref in self._refs.items():
            if not isinstance(ref, int) or ref < -1:
                raise AssertionError(f"key {key!r} has ref count {ref!r}")
            if ref == 0:
                evictable += 1
        if evictable != self._evictable:
            raise AssertionError(f"evictable count {self._evictable} but {evictable} "
                                 "keys have ref count 0")
        if self._refs.keys() != self._blocks.keys():
            raise AssertionError("the keys with a ref count are not the keys with a block")
        if len(self._refs) > self.cache_capacity:
            raise AssertionError(f"{len(self._refs)} keys held, capacity "
                                 f"{self.cache_capacity}")
        free = self.backend.get_num_free_blocks()
        if len(self._refs) + free != self.cache_capacity:
            raise AssertionError(f"{len(self._refs)} keys held and {free} blocks free, "
                                 f"capacity {self.cache_capacity}")
        if self.events is not None and not isinstance(self.events, list):
            raise AssertionError("events is neither a list nor None")
