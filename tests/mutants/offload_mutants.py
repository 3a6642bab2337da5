"""Offload-tier mutants: bugs of KV offloading managers, planted into kvspec's own
(impl/kv_offload/: the LRU and ARC managers, vLLM 0.13's API) or into vLLM 0.33's
``CPUOffloadingManager`` and its cache policies.

Each check of the offload machine (conformance/offload_machine.py) kills one: the store rules
of ``spec.offload.store_violations`` (judged inside ``store_new_blocks``, before the output is
compared), the bad-call rules (the target must refuse), the connector's own rules (killed by
the lockstep comparison inside the rule or by impl's representation check), and the named
invariants of ``spec.offload.ALL``. Most bugs are real incidents, named in their description.

The impl machine (``TestImplOffloadConforms``) runs impl's ``check_representation`` as its
invariant ``representation_check``, after the spec's named invariants (Hypothesis runs them
in name order), so a bug in the ARC lists, the ghosts, the target or the ref counts is
reported by the named invariant; what only impl's own check sees (the evictable count, the
backend's free blocks) is reported by it. The machine's tiers are mostly tiny (2 to 5 keys,
some 8), so stores into a full tier, and refused ones, are frequent: #35846 is found by the
machine. Two bugs it does not reach within the mutants profile are scored elsewhere: #55461
by finding O4's program run on impl in lock step with the spec (each store judged by
``spec.offload.store_violations``), and untrimmed ghost lists by impl's unit test (more
evictions from one list than the capacity, no ghost re-stored). Two invariants
(ghosts_are_not_resident, refs_well_formed) are also scored on vLLM 0.33's cache policies
and manager, which have no representation check of their own: their checker reruns the
machine under .venv-vllm-0.33.0, which plants the mutant (in an interpreter without vLLM
0.33 planting does nothing). within_capacity cannot come first on a target (each store is
judged by store_evicts_only_what_it_needs before any invariant): its mutant is planted into
the spec and caught by the exhaustive explorer (conformance/offload_explore.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from kvspec.impl.kv_offload import NotPinned, StoreNotComplete
from kvspec.impl.kv_offload.abstract import (
    OffloadingEvent,
    PrepareStoreOutput,
    RefCountingManager,
    as_key_list,
)
from kvspec.impl.kv_offload.arc_manager import ARCOffloadingManager
from kvspec.impl.kv_offload.lru_manager import LRUOffloadingManager
from tests.mutants import Mutant, replace, vllm_033_modules

MACHINE = ("tests/test_offload_machine.py::TestImplOffloadConforms",)
MACHINE_033 = ("tests/test_offload_machine.py::test_vllm_033_offload_within_contract",)
IMPL_033 = ("tests/test_offload_machine.py::TestImplOffloadConforms033",)
# Finding O4's program (#55461) run on impl in lock step with the spec, each store judged by
# the store rules: the machine does not reach the case within the mutants profile.
T1_FALLBACK = ("tests/test_offload_machine.py::test_impl_conforms_where_vllm_does_not"
               "[O4 arc no T1 fallback]",)
SCAN = ("tests/test_arc_manager.py::test_arc_eviction_walks_each_list_once",)
EXPLORER = ("tests/test_offload_explore.py::test_every_reachable_offload_state_keeps_the_rules"
            "[1-lru-vllm-0.13-64-(0, 1, 2, 3)-True]",)

_ORIGINAL_PREPARE_STORE = RefCountingManager.prepare_store
_ORIGINAL_PREPARE_LOAD = RefCountingManager.prepare_load
_ORIGINAL_COMPLETE_STORE = RefCountingManager.complete_store
_ORIGINAL_ARC_TOUCH = ARCOffloadingManager.touch


# --- the store rules ---------------------------------------------------------------------------


def store_evicts_offered_key() -> None:
    """vLLM #35846: a store's victims may be keys the same call offers (already held, ready,
    unpinned): a key the connector was just told is offloaded is gone."""
    for cls in (LRUOffloadingManager, ARCOffloadingManager):
        original = cls._choose_victims

        def choose(self: Any, need: int, protected: set[Any] | None,
                   original: Callable[..., list[Any] | None] = original) -> list[Any] | None:
            return original(self, need, None)
        replace(cls, "_choose_victims", choose)


def arc_partial_eviction() -> None:
    """vLLM #37874: ARC evicts each victim inside its selection loop, so a store that then
    finds too few returns None with the first victims already gone (not all or nothing)."""
    def prepare_store(self: ARCOffloadingManager, block_hashes: Iterable[Any]
                      ) -> PrepareStoreOutput | None:
        keys = as_key_list(block_hashes)
        output = _ORIGINAL_PREPARE_STORE(self, keys)
        if output is None:
            refs = self._refs
            need = sum(k not in refs for k in keys) - self.backend.get_num_free_blocks()
            found = [k for k in (*self._t1, *self._t2) if refs[k] == 0 and k not in keys]
            for key in found[:need]:
                self._forget_victims([key])
                del refs[key]
                self.backend.free(self._blocks.pop(key))
                self._evictable -= 1
        return output
    replace(ARCOffloadingManager, "prepare_store", prepare_store)


def arc_no_t1_fallback() -> None:
    """vLLM #55461: ARC takes victims from T1 only while T1 is at least its target, else from
    T2, and gives up when T2 has none, though T1 still has evictable keys."""
    def choose(self: ARCOffloadingManager, need: int, protected: set[Any] | None
               ) -> list[Any] | None:
        refs, shielded = self._refs, protected or set()
        from_t1 = [k for k in self._t1 if refs[k] == 0 and k not in shielded]
        from_t2 = [k for k in self._t2 if refs[k] == 0 and k not in shielded]
        t1_size, target, victims = len(self._t1), int(self.target_t1_size), []
        for _ in range(need):
            if t1_size >= target and from_t1:
                victims.append(from_t1.pop(0))
                t1_size -= 1
            elif from_t2:
                victims.append(from_t2.pop(0))
            else:
                return None
        return victims
    replace(ARCOffloadingManager, "_choose_victims", choose)


def forced_eviction_of_pinned_keys() -> None:
    """SGLang #27631/#31427: under memory pressure a store that finds too few idle keys
    forces out ready keys a load still reads (ref count >= 0 taken for evictable): their
    blocks are freed and rewritten under the load."""
    def prepare_store(self: RefCountingManager, block_hashes: Iterable[Any]
                      ) -> PrepareStoreOutput | None:
        keys = as_key_list(block_hashes)
        output = _ORIGINAL_PREPARE_STORE(self, keys)
        refs, backend = self._refs, self.backend
        need = sum(k not in refs for k in keys) - backend.get_num_free_blocks()
        if output is not None or need <= 0:
            return output
        order = self._lru if isinstance(self, LRUOffloadingManager) else (
            *self._t1, *self._t2) if isinstance(self, ARCOffloadingManager) else ()
        forced = [k for k in order if refs[k] >= 0 and k not in keys][:need]
        if len(forced) < need:
            return None
        self._forget_victims(forced)
        self._evictable -= sum(refs[k] == 0 for k in forced)
        for key in forced:
            del refs[key]
            backend.free(self._blocks.pop(key))
        if self.events is not None:
            self.events.append(OffloadingEvent(forced, backend.block_size, backend.medium,
                                               True))
        to_store = [k for k in keys if k not in refs]
        blocks = backend.allocate_blocks(to_store)
        for key, block in zip(to_store, blocks, strict=True):
            refs[key] = -1
            self._blocks[key] = block
        self._insert(to_store)
        return PrepareStoreOutput(to_store, backend.get_load_store_spec(to_store, blocks),
                                  forced)
    replace(RefCountingManager, "prepare_store", prepare_store)


def lru_evicts_headroom() -> None:
    """The LRU store evicts one key more than it needs when it can (a low-watermark
    heuristic that keeps a free block spare): a key a later lookup would hit is gone."""
    original = LRUOffloadingManager._choose_victims

    def choose(self: LRUOffloadingManager, need: int, protected: set[Any] | None
               ) -> list[Any] | None:
        more = original(self, need + 1, protected)
        if more is None:
            return original(self, need, protected)
        self._evictable -= 1  # the base class subtracts only what it needed
        return more
    replace(LRUOffloadingManager, "_choose_victims", choose)


# --- bad calls ---------------------------------------------------------------------------------


def double_unpin() -> None:
    """LMCache #2954: complete_load does not check that a load pins the key: a second unpin
    drives the pin count negative (a ready key to -1, a pending one to -2)."""
    def complete_load(self: RefCountingManager, block_hashes: Iterable[Any]) -> None:
        keys = as_key_list(block_hashes)
        found = self._held(keys)
        for key, ref in zip(keys, found, strict=True):
            self._refs[key] = ref - 1
        self._evictable += found.count(1) - found.count(0)
    replace(RefCountingManager, "complete_load", complete_load)


def load_one_key_fast_path() -> None:
    """prepare_load's fast path for a single key skips the pending check: a key whose store
    is still being written is pinned for reading."""
    def prepare_load(self: RefCountingManager, block_hashes: Iterable[Any]) -> Any:
        keys = as_key_list(block_hashes)
        if len(keys) != 1:
            return _ORIGINAL_PREPARE_LOAD(self, keys)
        (ref,) = self._held(keys)
        self._refs[keys[0]] = ref + 1
        self._evictable -= ref == 0
        return self.backend.get_load_store_spec(keys, [self._blocks[keys[0]]])
    replace(RefCountingManager, "prepare_load", prepare_load)


def load_checks_first_key_only() -> None:
    """prepare_load checks only the first key's store (a prefix's root), as if a chain's
    stores completed in order: a ready key and a pending one are both pinned."""
    def prepare_load(self: RefCountingManager, block_hashes: Iterable[Any]) -> Any:
        keys = as_key_list(block_hashes)
        found = self._held(keys)
        if found and found[0] < 0:
            raise StoreNotComplete(f"key {keys[0]!r} cannot be loaded: its store is pending")
        for key, ref in zip(keys, found, strict=True):
            self._refs[key] = ref + 1
        self._evictable -= found.count(0)
        return self.backend.get_load_store_spec(keys, [self._blocks[k] for k in keys])
    replace(RefCountingManager, "prepare_load", prepare_load)


def load_skips_unknown_keys() -> None:
    """prepare_load skips keys it does not hold (a key evicted since the lookup taken for a
    miss): a load of a key the tier never had is accepted and reads nothing."""
    def prepare_load(self: RefCountingManager, block_hashes: Iterable[Any]) -> Any:
        return _ORIGINAL_PREPARE_LOAD(self, [k for k in as_key_list(block_hashes)
                                             if k in self._refs])
    replace(RefCountingManager, "prepare_load", prepare_load)


def complete_store_twice_ignored() -> None:
    """complete_store skips a key whose store already completed (vLLM 0.33's silent
    ``not chunk.is_ready`` filter, finding O9): a second completion is accepted."""
    def complete_store(self: RefCountingManager, block_hashes: Iterable[Any],
                       success: bool = True) -> None:
        keys = as_key_list(block_hashes)
        self._held(keys)
        _ORIGINAL_COMPLETE_STORE(self, [k for k in keys if self._refs[k] < 0], success)
    replace(RefCountingManager, "complete_store", complete_store)


def complete_store_skips_unknown_keys() -> None:
    """complete_store skips keys it does not hold (vLLM 0.33's ``chunk is not None``
    filter): the completion of a store the tier never issued is accepted."""
    def complete_store(self: RefCountingManager, block_hashes: Iterable[Any],
                       success: bool = True) -> None:
        _ORIGINAL_COMPLETE_STORE(self, [k for k in as_key_list(block_hashes)
                                        if k in self._refs], success)
    replace(RefCountingManager, "complete_store", complete_store)


def store_dedups_silently() -> None:
    """prepare_store drops a key listed twice instead of refusing the call: the caller's
    bug (one block offered for two positions) goes unseen."""
    def prepare_store(self: RefCountingManager, block_hashes: Iterable[Any]
                      ) -> PrepareStoreOutput | None:
        return _ORIGINAL_PREPARE_STORE(self, list(dict.fromkeys(as_key_list(block_hashes))))
    replace(RefCountingManager, "prepare_store", prepare_store)


# --- the connector's rules ---------------------------------------------------------------------


def lookup_counts_pending_keys() -> None:
    """lookup counts a key whose store is in flight as a hit (0.33's HIT_PENDING taken for
    HIT): the connector schedules a load of data not yet written."""
    def lookup(self: RefCountingManager, block_hashes: Iterable[Any]) -> int:
        hits = 0
        for key in block_hashes:
            if key not in self._refs:
                break
            hits += 1
        return hits
    replace(RefCountingManager, "lookup", lookup)


def failed_store_leaks_block() -> None:
    """complete_store(success=False) forgets the keys but never frees their blocks: each
    failed store leaks CPU blocks until the tier stores nothing."""
    def complete_store(self: RefCountingManager, block_hashes: Iterable[Any],
                       success: bool = True) -> None:
        keys = as_key_list(block_hashes)
        if success:
            _ORIGINAL_COMPLETE_STORE(self, keys, success)
            return
        self._held(keys)
        for key in keys:
            self._drop_pending(key)
            del self._refs[key]
            self._blocks.pop(key)
    replace(RefCountingManager, "complete_store", complete_store)


def unpin_counts_idle_before() -> None:
    """complete_load counts the keys that were idle before the unpin (ref count 0) as newly
    evictable instead of those that are after it (ref count 1): the evictable count drifts
    low and stores fail with room to spare."""
    def complete_load(self: RefCountingManager, block_hashes: Iterable[Any]) -> None:
        keys = as_key_list(block_hashes)
        found = self._held(keys)
        for key, ref in zip(keys, found, strict=True):
            if ref <= 0:
                raise NotPinned(f"key {key!r} cannot complete a load: no load holds it")
        for key, ref in zip(keys, found, strict=True):
            self._refs[key] = ref - 1
        self._evictable += found.count(0)
    replace(RefCountingManager, "complete_load", complete_load)


def take_events_newest_first() -> None:
    """take_events pops events off the end of its list (a stack): a consumer replays an
    eviction before the store it undoes."""
    def take_events(self: RefCountingManager) -> Iterable[OffloadingEvent]:
        while self.events:
            yield self.events.pop()
    replace(RefCountingManager, "take_events", take_events)


# --- events and the representation -----------------------------------------------------------


def removals_never_published() -> None:
    """LMCache #5076: stores are published, evictions never are: a router keeps sending
    requests to a tier that dropped their blocks."""
    def prepare_store(self: RefCountingManager, block_hashes: Iterable[Any]
                      ) -> PrepareStoreOutput | None:
        before = len(self.events or ())
        output = _ORIGINAL_PREPARE_STORE(self, block_hashes)
        if self.events:
            self.events[before:] = [e for e in self.events[before:] if not e.removed]
        return output
    replace(RefCountingManager, "prepare_store", prepare_store)


def empty_removal_event() -> None:
    """Every store that allocates emits its removal event, also when it evicted nothing: a
    consumer gets empty removals."""
    def prepare_store(self: RefCountingManager, block_hashes: Iterable[Any]
                      ) -> PrepareStoreOutput | None:
        output = _ORIGINAL_PREPARE_STORE(self, block_hashes)
        if (output is not None and output.block_hashes_to_store
                and not output.block_hashes_evicted and self.events is not None):
            self.events.append(OffloadingEvent([], self.backend.block_size,
                                               self.backend.medium, True))
        return output
    replace(RefCountingManager, "prepare_store", prepare_store)


def evictable_decremented_once_per_batch() -> None:
    """LMCache #3130: a batched eviction decrements the evictable counter once per batch, not
    once per victim: the counter runs high, and a later store evicts past busy keys."""
    def prepare_store(self: RefCountingManager, block_hashes: Iterable[Any]
                      ) -> PrepareStoreOutput | None:
        output = _ORIGINAL_PREPARE_STORE(self, block_hashes)
        if output is not None and output.block_hashes_evicted:
            self._evictable += len(output.block_hashes_evicted) - 1
        return output
    replace(RefCountingManager, "prepare_store", prepare_store)


def arc_rescans_per_victim() -> None:
    """vLLM #50992: ARC restarts its candidate scan from the LRU end for every victim (the
    same victims, quadratic in the keys it passes over: 5,000 victims behind 5,000 pinned
    keys inspect some 25M entries)."""
    def choose(self: ARCOffloadingManager, need: int, protected: set[Any] | None
               ) -> list[Any] | None:
        refs, shielded = self._refs, protected or set()
        victims: list[Any] = []
        taken: set[Any] = set()
        t1_size, target = len(self._t1), int(self.target_t1_size)

        def first(entries: Iterable[Any]) -> Any:
            for key in entries:
                self.eviction_steps += 1
                if refs[key] == 0 and key not in shielded and key not in taken:
                    return key
            return None

        for _ in range(need):
            key = first(self._t1) if t1_size >= target else None
            if key is None:
                key = first(self._t2)
            if key is None:
                key = first(self._t1)
            if key is None:
                return None
            if key in self._t1:
                t1_size -= 1
            victims.append(key)
            taken.add(key)
        return victims
    replace(ARCOffloadingManager, "_choose_victims", choose)


# --- the ARC lists, ghosts, target and ref counts (the named invariants) ----------------------


def arc_ghosts_never_trimmed() -> None:
    """ARC's eviction appends each victim to its ghost list and never trims the list to the
    capacity: the ghosts of a long run grow without bound."""
    def forget(self: ARCOffloadingManager, victims: list[Any]) -> None:
        for key in victims:
            if key in self._t1:
                del self._t1[key]
                self._b1[key] = None
            else:
                del self._t2[key]
                self._b2[key] = None
    replace(ARCOffloadingManager, "_forget_victims", forget)


def arc_insert_keeps_ghost_impl() -> None:
    """ARC's insert puts a re-stored key into T1 but leaves it on its ghost list: a stored
    key is resident and a ghost at once."""
    def insert(self: ARCOffloadingManager, keys: list[Any]) -> None:
        for key in keys:
            self._t1[key] = None
    replace(ARCOffloadingManager, "_insert", insert)


def arc_target_unclamped() -> None:
    """A touch of a ghost moves ARC's target T1 size by the ghost-list ratio without
    clamping it to [0, capacity]: repeated ghost hits push it past the capacity (or below
    zero)."""
    original = ARCOffloadingManager.touch

    def touch(self: ARCOffloadingManager, block_hashes: Iterable[Any]) -> None:
        keys = as_key_list(block_hashes)
        b1, b2 = self._b1, self._b2
        # The target as the touch would move it, ghost by ghost, with no clamp.
        target = self.target_t1_size
        for key in reversed(keys):
            if key in self._t1 or key in self._t2:
                continue
            if key in b1:
                target += max(1, len(b2) / len(b1))
            elif key in b2:
                target -= max(1, len(b1) / len(b2))
        original(self, keys)
        self.target_t1_size = float(target)
    replace(ARCOffloadingManager, "touch", touch)


def arc_touch_copies_to_t2() -> None:
    """ARC's touch of a ready T1 key adds it to T2 but never removes it from T1: the key is
    listed twice."""
    original = ARCOffloadingManager.touch

    def touch(self: ARCOffloadingManager, block_hashes: Iterable[Any]) -> None:
        keys = as_key_list(block_hashes)
        copied = [k for k in keys if k in self._t1 and self._refs[k] >= 0]
        original(self, keys)
        for key in copied:
            if key in self._t2 and key not in self._t1:
                self._t1[key] = None
    replace(ARCOffloadingManager, "touch", touch)


def arc_touch_promotes_pending() -> None:
    """ARC's touch moves a T1 key to T2 whatever its ref count (vLLM 0.33's promotion of a
    pending key, finding O10): a key whose store is still being written counts as seen
    twice."""
    def touch(self: ARCOffloadingManager, block_hashes: Iterable[Any]) -> None:
        pending = [k for k in as_key_list(block_hashes)
                   if k in self._t1 and self._refs[k] < 0]
        for key in pending:
            self._refs[key] = 0  # taken for ready by the original touch
        try:
            _ORIGINAL_ARC_TOUCH(self, block_hashes)
        finally:
            for key in pending:
                self._refs[key] = -1
    replace(ARCOffloadingManager, "touch", touch)


def failed_store_decrements_ref() -> None:
    """complete_store(success=False) releases the store's reference (ref count - 1, as an
    unpin) instead of dropping the key: a pending key's count goes to -2 and it stays."""
    def complete_store(self: RefCountingManager, block_hashes: Iterable[Any],
                       success: bool = True) -> None:
        keys = as_key_list(block_hashes)
        if success:
            _ORIGINAL_COMPLETE_STORE(self, keys, success)
            return
        self._held(keys)
        for key in keys:
            self._refs[key] -= 1
    replace(RefCountingManager, "complete_store", complete_store)


# --- a mutant of the spec, for the exhaustive explorer --------------------------------------


def spec_store_one_over_capacity() -> None:
    """Planted into the spec (spec.offload.prepare_store, which step() calls through the
    module global): the store counts one free block more than the tier has, so a store into
    a full tier holds one key too many without evicting; the exhaustive explorer
    (conformance/offload_explore.py) reports within_capacity."""
    from dataclasses import replace as changed

    from kvspec.spec import offload as spec

    original = spec.prepare_store

    def prepare_store(state: Any, req: Any, keys: tuple[Any, ...]) -> Any:
        successor, output = original(changed(state, capacity=state.capacity + 1), req, keys)
        return changed(successor, capacity=state.capacity), output
    replace(spec, "prepare_store", prepare_store)


# --- vLLM 0.33's CPUOffloadingManager and cache policies ---------------------------------------


def _planted_033(plant: Callable[[Any, Any, Any], None]) -> Callable[[], None]:
    def run() -> None:
        modules = vllm_033_modules("v1.kv_offload.cpu.manager",
                                   "v1.kv_offload.cpu.policies.lru",
                                   "v1.kv_offload.cpu.policies.arc")
        if modules is not None:
            plant(*modules)
    run.__name__ = plant.__name__
    run.__doc__ = plant.__doc__
    return run


@_planted_033
def request_finish_ignored(manager: Any, lru: Any, arc: Any) -> None:
    """on_request_finished marks the request finished but never commits its accesses to the
    policy: LRU recency and ARC's promotion to T2 are lost."""
    def on_request_finished(self: Any, req_context: Any) -> None:
        state = req_context.get_state(manager._RequestCacheAccess)
        if state is not None:
            state.finished = True
    replace(manager.CPUOffloadingManager, "on_request_finished", on_request_finished)


@_planted_033
def reset_keeps_pending_count(manager: Any, lru: Any, arc: Any) -> None:
    """reset_cache zeroes the evictable counter but not the pending-store counter (a counter
    added after reset_cache was written): the manager counts stores the reset dropped."""
    original = manager.CPUOffloadingManager.reset_cache

    def reset_cache(self: Any) -> None:
        pending = self._num_write_pending_chunks
        original(self)
        self._num_write_pending_chunks = pending
    replace(manager.CPUOffloadingManager, "reset_cache", reset_cache)


@_planted_033
def arc_insert_keeps_ghost(manager: Any, lru: Any, arc: Any) -> None:
    """ARC's insert puts the key into T1 but leaves it on its ghost list: a stored key is
    resident and a ghost at once."""
    def insert(self: Any, key: Any, chunk: Any, req_context: Any) -> None:
        self.t1[key] = chunk
    replace(arc.ARCCachePolicy, "insert", insert)


@_planted_033
def failed_store_unpins(manager: Any, lru: Any, arc: Any) -> None:
    """complete_store(success=False) releases the store's reference (ref count - 1, as an
    unpin) instead of dropping the key: a pending key's count goes to -2 and it stays."""
    original = manager.CPUOffloadingManager.complete_store

    def complete_store(self: Any, keys: Any, req_context: Any, success: bool = True) -> None:
        if success:
            original(self, keys, req_context, success)
            return
        for key in keys:
            chunk = self._policy.get(key)
            if chunk is not None and not chunk.is_ready:
                chunk.ref_cnt -= 1
                self._num_write_pending_chunks -= 1
    replace(manager.CPUOffloadingManager, "complete_store", complete_store)


def late_completion_accepted() -> None:
    """impl's 0.33 manager forgets generations: a store completion issued before a reset
    marks the key a newer store holds pending as ready, before its data are written
    (what vLLM 0.33's manager does, finding O8; its connector drops such completions)."""
    from kvspec.impl.kv_offload.cpu_manager import CPUOffloadingManager

    replace(CPUOffloadingManager, "_is_late", lambda self, req_context: False)


def _mutant(name: str, plant: Callable[[], None], checker: tuple[str, ...],
            killed_by: str) -> Mutant:
    prefix = ("0.33: " if checker == MACHINE_033 else "spec: " if checker == EXPLORER
              else "offload 0.33: " if checker == IMPL_033 else "offload: ")
    return Mutant(name, prefix + " ".join((plant.__doc__ or "").split()), plant, checker,
                  killed_by=killed_by)


MUTANTS: list[Mutant] = [
    # the store rules
    _mutant("offload_store_evicts_offered_key", store_evicts_offered_key, MACHINE,
            "store_keeps_offered_keys"),
    _mutant("offload_arc_partial_eviction", arc_partial_eviction, MACHINE,
            "store_is_all_or_nothing"),
    _mutant("offload_arc_no_t1_fallback", arc_no_t1_fallback, T1_FALLBACK,
            "store_fails_only_when_full"),
    _mutant("offload_forced_eviction_of_pinned_keys", forced_eviction_of_pinned_keys,
            MACHINE, "store_evicts_only_idle_keys"),
    _mutant("offload_lru_evicts_headroom", lru_evicts_headroom, MACHINE,
            "store_evicts_only_what_it_needs"),
    # bad calls
    _mutant("offload_double_unpin", double_unpin, MACHINE, "unpin_below_zero"),
    _mutant("offload_load_one_key_fast_path", load_one_key_fast_path, MACHINE,
            "load_pending_key"),
    _mutant("offload_load_checks_first_key_only", load_checks_first_key_only, MACHINE,
            "load_ready_and_pending_keys"),
    _mutant("offload_load_skips_unknown_keys", load_skips_unknown_keys, MACHINE,
            "load_unknown_key"),
    _mutant("offload_complete_store_twice_ignored", complete_store_twice_ignored, MACHINE,
            "complete_store_twice"),
    _mutant("offload_complete_store_skips_unknown_keys", complete_store_skips_unknown_keys,
            MACHINE, "complete_store_of_unknown_key"),
    _mutant("offload_store_dedups_silently", store_dedups_silently, MACHINE,
            "store_key_listed_twice"),
    # the connector's rules
    _mutant("offload_lookup_counts_pending_keys", lookup_counts_pending_keys, MACHINE,
            "Lookup("),
    _mutant("offload_failed_store_leaks_block", failed_store_leaks_block, MACHINE,
            "blocks free, capacity"),
    _mutant("offload_unpin_counts_idle_before", unpin_counts_idle_before, MACHINE,
            "evictable count"),
    _mutant("offload_take_events_newest_first", take_events_newest_first, MACHINE,
            "TakeEvents("),
    # events and the representation
    _mutant("offload_removals_never_published", removals_never_published, MACHINE,
            "events_replay_to_ready"),
    _mutant("offload_empty_removal_event", empty_removal_event, MACHINE,
            "events_name_real_changes"),
    _mutant("offload_evictable_decremented_once_per_batch",
            evictable_decremented_once_per_batch, MACHINE, "evictable count"),
    _mutant("offload_arc_rescans_per_victim", arc_rescans_per_victim, SCAN, "eviction_steps"),
    # the ARC lists, ghosts, target and ref counts
    _mutant("offload_arc_ghosts_never_trimmed", arc_ghosts_never_trimmed, MACHINE,
            "ghost_lists_bounded violated"),
    _mutant("offload_arc_insert_keeps_ghost", arc_insert_keeps_ghost_impl, MACHINE,
            "ghosts_are_not_resident violated"),
    _mutant("offload_arc_target_unclamped", arc_target_unclamped, MACHINE,
            "target_within_capacity violated"),
    _mutant("offload_arc_touch_copies_to_t2", arc_touch_copies_to_t2, MACHINE,
            "lists_hold_the_resident_keys violated"),
    _mutant("offload_arc_touch_promotes_pending", arc_touch_promotes_pending, MACHINE,
            "pending_keys_stay_in_t1 violated"),
    _mutant("offload_failed_store_decrements_ref", failed_store_decrements_ref, MACHINE,
            "refs_well_formed violated"),
    # the spec itself, under the exhaustive explorer
    _mutant("spec_offload_store_one_over_capacity", spec_store_one_over_capacity, EXPLORER,
            "within_capacity"),
    # impl's 0.33 manager
    _mutant("offload_033_late_completion_accepted", late_completion_accepted, IMPL_033,
            "in late_completion"),
    # vLLM 0.33
    _mutant("v033_offload_request_finish_ignored", request_finish_ignored, MACHINE_033,
            "view_matches_spec"),
    _mutant("v033_offload_reset_keeps_pending_count", reset_keeps_pending_count, MACHINE_033,
            "pending chunks; 0 have ref count -1"),
    _mutant("v033_offload_arc_insert_keeps_ghost", arc_insert_keeps_ghost, MACHINE_033,
            "ghosts_are_not_resident violated"),
    _mutant("v033_offload_failed_store_unpins", failed_store_unpins, MACHINE_033,
            "refs_well_formed violated"),
]
