"""kvspec's CPU offloading manager with vLLM 0.33's API (``vllm/v1/kv_offload/cpu/manager.py``).

``CPUOffloadingManager(num_chunks, cache_policy="lru" | "arc")`` holds up to ``num_chunks``
keys (``base.make_offload_key``) in a pool of CPU chunks. Every call takes the request's
context (``base.ReqContext``, or vLLM's own: only ``req_id``, ``get_state`` and ``set_state``
are used). The ref counts, refusals, victim choice and lists are the 0.13-API managers'
(``lru_manager.py``, ``arc_manager.py``), driven here with 0.33's rules (``spec/offload.py``
under the vllm-0.33 profile):

* recency is per request: a load or a store offer records the keys the request saw (in
  first-seen order), which it inserted and which it reused (ready keys it loaded or offered
  that it had not inserted itself); ``on_request_finished`` commits them once, last key
  first, so that the request's first key ends the most recent. LRU moves each held key to
  the most recent end; ARC keeps a key the request only inserted in its list, and a reused
  key is seen again (T1 to T2; a pending key stays in T1);
* ARC adapts its target on a store miss of a ghost, once per request and key, before the
  insertion drops the ghost, even when the store then fails for want of room;
* a failed store is announced as a ``metadata_only`` removal, filtered at ``take_events``
  to the keys still absent (a retried store may hold one again);
* ``reset_cache`` drops every key and starts a new generation; unlike vLLM 0.33 it
  announces the ready keys removed, so that a consumer of the events stays exact. A
  ``complete_store`` under a context whose accesses belong to an earlier generation (a
  transfer issued before the reset) is late and changes nothing.

Every bad call raises a typed error (``kvspec.impl.errors``) before anything changes; a
store that cannot make room evicts nothing and returns None. Pure Python: nothing here
imports vLLM.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from kvspec.impl.errors import OffloadingError
from kvspec.impl.kv_offload.abstract import check_no_duplicates
from kvspec.impl.kv_offload.arc_manager import ARCOffloadingManager
from kvspec.impl.kv_offload.base import (
    CPULoadStoreSpec,
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    PrepareStoreOutput,
    RequestOffloadingContext,
)
from kvspec.impl.kv_offload.lru_manager import LRUOffloadingManager

CACHE_POLICIES = ("lru", "arc")


class BadOffloadConfig(OffloadingError, ValueError):
    """A manager that cannot be built: fewer than one chunk, or an unknown cache policy."""


class RequestContextLike(Protocol):
    """What the manager reads of a request's context: its id (vLLM's ``ReqContext`` and
    ``base.ReqContext`` also keep per-request state, which the manager uses when present)."""

    req_id: str


# ---------------------------------------- the chunk pool (the policies' backend)


class _ChunkPool:
    """``num_chunks`` CPU chunk ids: fresh ones in order, then freed ones, last freed first."""

    block_size = 1
    medium = Medium.CPU.value

    def __init__(self, num_chunks: int) -> None:
        self.num_chunks = num_chunks
        self._allocated = 0
        self._free: list[int] = []

    def get_num_free_blocks(self) -> int:
        return len(self._free) + self.num_chunks - self._allocated

    def allocate_blocks(self, block_hashes: list[Any]) -> list[int]:
        fresh = min(len(block_hashes), self.num_chunks - self._allocated)
        chunks = list(range(self._allocated, self._allocated + fresh))
        self._allocated += fresh
        free = self._free
        chunks.extend(free.pop() for _ in range(len(block_hashes) - fresh))
        return chunks

    def free(self, block: int) -> None:
        self._free.append(block)

    def get_load_store_spec(self, block_hashes: Iterable[Any],
                            blocks: Iterable[int]) -> CPULoadStoreSpec:
        return CPULoadStoreSpec(list(blocks))


# ---------------------------------------- the policies: 0.13's managers, plus 0.33's commit


class _LRUPolicy(LRUOffloadingManager):
    def ref_count(self, key: Any) -> int | None:
        return self._refs.get(key)

    def commit(self, seen: list[Any], insertion_only: set[Any], reused: set[Any]) -> None:
        """Every held key the request saw to the most recent end, its first key last."""
        self.touch(seen)

    def learn_from_misses(self, keys: list[Any]) -> None:
        pass  # LRU has no ghosts

    def lists(self) -> tuple[list[tuple[Any, int]], list[tuple[Any, int]]]:
        return self.ordered_entries(), []

    def ghosts(self) -> tuple[list[Any], list[Any]]:
        return [], []


class _ARCPolicy(ARCOffloadingManager):
    def ref_count(self, key: Any) -> int | None:
        return self._refs.get(key)

    def commit(self, seen: list[Any], insertion_only: set[Any], reused: set[Any]) -> None:
        """A key the request only inserted keeps its list, as most recent; a reused key is
        seen again, as ``touch`` sees a held key: T1 to T2 (a pending key stays in T1), or to
        T2's most recent end."""
        t1, t2 = self._t1, self._t2
        for key in reversed(seen):
            if key in insertion_only:
                if key in t1:
                    t1.move_to_end(key)
                elif key in t2:
                    t2.move_to_end(key)
            elif key in reused and (key in t1 or key in t2):
                self.touch((key,))

    def learn_from_misses(self, keys: list[Any]) -> None:
        """Store misses of ghosts move the target (the keys are not held: a touch of a key
        that is not held only adapts to its ghost)."""
        self.touch(keys)

    def lists(self) -> tuple[list[tuple[Any, int]], list[tuple[Any, int]]]:
        return self.t1_entries(), self.t2_entries()

    def ghosts(self) -> tuple[list[Any], list[Any]]:
        return self.b1_keys(), self.b2_keys()


_POLICY_CLASSES: dict[str, type[_LRUPolicy] | type[_ARCPolicy]] = {
    "lru": _LRUPolicy, "arc": _ARCPolicy}


# ---------------------------------------- one request's accesses


@dataclass(slots=True)
class _RequestAccess:
    """What one request did to the tier in one generation (kept in its context)."""

    owner: object
    generation: int
    seen: dict[Any, None] = field(default_factory=dict)  # first-seen order
    inserted: set[Any] = field(default_factory=set)
    reused: set[Any] = field(default_factory=set)
    store_missed: set[Any] = field(default_factory=set)
    finished: bool = False


class CPUOffloadingManager:
    """vLLM 0.33's ``CPUOffloadingManager`` API over a pool of ``num_chunks`` CPU chunks,
    with an ``"lru"`` or ``"arc"`` cache policy."""

    def __init__(self, num_chunks: int, cache_policy: str = "lru",
                 enable_events: bool = False) -> None:
        if type(num_chunks) is not int or num_chunks < 1:
            raise BadOffloadConfig(f"a CPU offloading manager holds at least 1 chunk, got "
                                   f"{num_chunks!r}")
        if cache_policy not in _POLICY_CLASSES:
            raise BadOffloadConfig(f"unknown cache policy {cache_policy!r}: use "
                                   f"{' or '.join(CACHE_POLICIES)}")
        self.medium = Medium.CPU
        self.num_chunks = num_chunks
        self.cache_policy = cache_policy
        self.events: list[OffloadingEvent] | None = [] if enable_events else None
        self._policy = self._new_policy()
        self._generation = 0
        # Records of contexts without get_state/set_state, by request id (this generation).
        self._requests: dict[str, _RequestAccess] = {}

    def _new_policy(self) -> _LRUPolicy | _ARCPolicy:
        return _POLICY_CLASSES[self.cache_policy](_ChunkPool(self.num_chunks))

    @property
    def lock(self) -> nullcontext[None]:
        """The manager is entered from one thread: its lock is a no-op (vLLM's default)."""
        return nullcontext()

    @property
    def generation(self) -> int:
        """How many times ``reset_cache`` has run."""
        return self._generation

    # ------------------------------------------------ per-request records

    def _find(self, req_context: RequestContextLike) -> _RequestAccess | None:
        get_state = getattr(req_context, "get_state", None)
        if get_state is None:
            return self._requests.get(req_context.req_id)
        record = get_state(_RequestAccess)
        return record if isinstance(record, _RequestAccess) and record.owner is self else None

    def _access(self, req_context: RequestContextLike) -> _RequestAccess:
        """The request's record for this generation, made anew where there is none."""
        record = self._find(req_context)
        if record is None or record.generation != self._generation:
            record = _RequestAccess(self, self._generation)
            set_state = getattr(req_context, "set_state", None)
            if set_state is None:
                self._requests[req_context.req_id] = record
            else:
                set_state(record)
        return record

    @staticmethod
    def _record(record: _RequestAccess, keys: Iterable[Any], reused: Iterable[Any]) -> None:
        seen = record.seen
        for key in keys:
            if key not in seen:
                seen[key] = None
        inserted = record.inserted
        record.reused.update(key for key in reused if key not in inserted)

    def _is_late(self, req_context: RequestContextLike) -> bool:
        """A transfer issued before the last reset: its request touched the tier in an
        earlier generation."""
        record = self._find(req_context)
        return record is not None and record.generation < self._generation and bool(
            record.seen)

    # ------------------------------------------------ vLLM 0.33's OffloadingManager API

    def on_new_request(self, req_context: RequestContextLike) -> RequestOffloadingContext:
        self._access(req_context)
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: RequestContextLike) -> LookupResult:
        ref = self._policy.ref_count(key)
        if ref is None:
            return LookupResult.MISS
        return LookupResult.HIT_PENDING if ref < 0 else LookupResult.HIT

    def prepare_load(self, keys: Collection[OffloadKey],
                     req_context: RequestContextLike) -> LoadStoreSpec:
        keys = list(keys)
        spec: LoadStoreSpec = self._policy.prepare_load(keys)  # refuses before pinning
        self._record(self._access(req_context), keys, keys)
        return spec

    def touch(self, keys: Collection[OffloadKey], req_context: RequestContextLike) -> None:
        self._policy.touch(list(keys))

    def complete_load(self, keys: Collection[OffloadKey],
                      req_context: RequestContextLike) -> None:
        self._policy.complete_load(list(keys))

    def prepare_store(self, keys: Collection[OffloadKey],
                      req_context: RequestContextLike) -> PrepareStoreOutput | None:
        keys = list(keys)
        check_no_duplicates(keys)
        policy = self._policy
        record = self._access(req_context)
        to_store: list[Any] = []
        ready: list[Any] = []
        offered: list[Any] = []  # the keys recorded: new or ready, not pending
        for key in keys:
            ref = policy.ref_count(key)
            if ref is None:
                to_store.append(key)
                offered.append(key)
            elif ref >= 0:
                ready.append(key)
                offered.append(key)
        missed = record.store_missed
        misses = [key for key in to_store if key not in missed]
        if misses:
            policy.learn_from_misses(misses)
            missed.update(misses)
        self._record(record, offered, ready)
        if not to_store:
            return PrepareStoreOutput([], CPULoadStoreSpec([]), [])
        output = policy.prepare_store(keys)
        if output is None:
            return None
        evicted = list(output.block_hashes_evicted)
        if evicted and self.events is not None:
            self.events.append(OffloadingEvent(evicted, self.medium, removed=True))
        record.inserted.update(to_store)
        return PrepareStoreOutput(list(output.block_hashes_to_store), output.store_spec,
                                  evicted)

    def complete_store(self, keys: Collection[OffloadKey], req_context: RequestContextLike,
                       success: bool = True) -> None:
        if self._is_late(req_context):
            return
        keys = list(keys)
        self._policy.complete_store(keys, success)  # refuses before changing anything
        if keys and self.events is not None:
            if success:
                self.events.append(OffloadingEvent(keys, self.medium, removed=False))
            else:
                self.events.append(OffloadingEvent(keys, self.medium, removed=True,
                                                   metadata_only=True))

    def on_request_finished(self, req_context: RequestContextLike) -> None:
        record = self._find(req_context)
        if record is None or record.generation != self._generation or record.finished:
            return
        record.finished = True
        if not hasattr(req_context, "get_state"):
            del self._requests[req_context.req_id]
        self._policy.commit(list(record.seen), record.inserted - record.reused,
                            record.reused)

    def reset_cache(self) -> None:
        t1, t2 = self._policy.lists()
        ready = [key for key, ref in t1 + t2 if ref >= 0]
        if ready and self.events is not None:
            self.events.append(OffloadingEvent(ready, self.medium, removed=True))
        self._policy = self._new_policy()
        self._generation += 1
        self._requests.clear()

    def take_events(self) -> Iterable[OffloadingEvent]:
        """The events since the last take, oldest first (taken at the call, not lazily)."""
        if self.events is None:
            return []
        events, self.events = self.events, []
        taken: list[OffloadingEvent] = []
        held = self._policy.ref_count
        for item in events:
            if item.metadata_only:
                keys = [key for key in item.keys if held(key) is None]
                if not keys:
                    continue
                item = replace(item, keys=keys)
            taken.append(item)
        return taken

    # ------------------------------------------------ views for the checker

    def ordered_entries(self) -> list[tuple[Any, int]]:
        """``(key, ref_cnt)`` of every held key in eviction order (ARC: T1, then T2)."""
        t1, t2 = self._policy.lists()
        return t1 + t2

    def t1_entries(self) -> list[tuple[Any, int]]:
        """ARC's T1 (LRU: every key), least recent first, with ref counts."""
        return self._policy.lists()[0]

    def t2_entries(self) -> list[tuple[Any, int]]:
        """ARC's T2 (LRU: empty), least recent first, with ref counts."""
        return self._policy.lists()[1]

    def b1_keys(self) -> list[Any]:
        """ARC's ghosts evicted from T1, least recent first (LRU: none)."""
        return self._policy.ghosts()[0]

    def b2_keys(self) -> list[Any]:
        """ARC's ghosts evicted from T2, least recent first (LRU: none)."""
        return self._policy.ghosts()[1]

    @property
    def target_t1_size(self) -> float:
        """ARC's target T1 size (LRU: 0.0)."""
        policy = self._policy
        return policy.target_t1_size if isinstance(policy, _ARCPolicy) else 0.0

    def check_representation(self) -> None:
        """Raise AssertionError if the representation invariant does not hold."""
        self._policy.check_representation()
        if self._policy.cache_capacity != self.num_chunks:
            raise AssertionError(f"the policy holds {self._policy.cache_capacity} chunks, "
                                 f"the manager {self.num_chunks}")
        if self.events is not None and not isinstance(self.events, list):
            raise AssertionError("events is neither a list nor None")
        for req_id, record in self._requests.items():
            if record.generation != self._generation or record.finished:
                raise AssertionError(f"request {req_id!r} keeps a stale record")
