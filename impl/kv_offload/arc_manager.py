"""kvspec's ARC offloading manager: vLLM 0.13's ``ARCOffloadingManager``, same API.

Adaptive Replacement Cache over the backend's blocks. T1 holds keys seen once (new stores),
T2 keys touched again; B1 and B2 are ghost lists of keys recently evicted from T1 and T2.
A touch of a ghost moves the adaptive target ``p`` (``target_t1_size``) for T1's size:
up for a B1 ghost (recency pays), down for a B2 ghost (frequency pays).

Differences from vLLM 0.13, as vLLM 0.33 fixed them:

* a touch of a pending key keeps it in T1 and moves it to T1's most recent end (0.13
  raised KeyError: it popped the key and then moved it);
* victims are chosen before anything is evicted, so a store that cannot be satisfied
  evicts nothing (0.13 evicted some, then returned None);
* the call's own held keys are never victims (#35846), and when T2 has no candidate left
  T1 is used even below its target (#55461);
* candidates are found with forward-only cursors over T1 and T2, so evicting k keys is
  O(len(T1) + len(T2) + k), not a rescan from the front per victim (#50992).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from kvspec.impl.kv_offload.abstract import (
    BackendLike,
    RefCountingManager,
    as_key_list,
)


class ARCOffloadingManager(RefCountingManager):
    """An offloading manager with the ARC eviction policy."""

    def __init__(self, backend: BackendLike, enable_events: bool = False) -> None:
        super().__init__(backend, enable_events)
        self.target_t1_size: float = 0.0
        # Keys only (their ref counts are in _refs), least recent first.
        self._t1: OrderedDict[Any, None] = OrderedDict()
        self._t2: OrderedDict[Any, None] = OrderedDict()
        self._b1: OrderedDict[Any, None] = OrderedDict()
        self._b2: OrderedDict[Any, None] = OrderedDict()

    def touch(self, block_hashes: Iterable[Any]) -> None:
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        refs = self._refs
        capacity = self.cache_capacity
        # Reversed, so that the first key (a prefix's root) ends up the most recent.
        for key in reversed(as_key_list(block_hashes)):
            if key in t1:
                if refs[key] >= 0:
                    del t1[key]
                    t2[key] = None
                else:
                    # A pending store is not a second use: it stays in T1, as most recent.
                    t1.move_to_end(key)
            elif key in t2:
                t2.move_to_end(key)
            elif key in b1:
                delta = max(1, len(b2) / len(b1))
                self.target_t1_size = float(min(self.target_t1_size + delta, capacity))
                b1.move_to_end(key)
            elif key in b2:
                delta = max(1, len(b1) / len(b2))
                self.target_t1_size = float(max(self.target_t1_size - delta, 0))
                b2.move_to_end(key)

    def _choose_victims(self, need: int, protected: set[Any] | None) -> list[Any] | None:
        refs = self._refs
        # Forward-only cursors: each list is walked at most once for the whole call, and
        # a candidate a cursor finds is always taken at once, so no peeking is needed.
        # enumerate's count is how many keys the cursor has inspected.
        cursor1 = enumerate(self._t1, 1)
        cursor2 = enumerate(self._t2, 1)
        seen1 = seen2 = 0
        done1 = done2 = False  # the cursor is exhausted
        virtual_t1 = len(self._t1)  # T1's size as if the victims chosen so far were gone
        target = int(self.target_t1_size)
        victims: list[Any] = []
        take = victims.append
        for _ in range(need):
            if virtual_t1 >= target and not done1:
                for seen1, key in cursor1:  # noqa: B007 - the count outlives the loop
                    if refs[key] == 0 and (protected is None or key not in protected):
                        take(key)
                        virtual_t1 -= 1
                        break
                else:
                    done1 = True
                if not done1:
                    continue
            if not done2:
                for seen2, key in cursor2:  # noqa: B007
                    if refs[key] == 0 and (protected is None or key not in protected):
                        take(key)
                        break
                else:
                    done2 = True
                if not done2:
                    continue
            # T2 has no candidate left: fall back to T1 even below its target (#55461).
            if not done1:
                for seen1, key in cursor1:  # noqa: B007
                    if refs[key] == 0 and (protected is None or key not in protected):
                        take(key)
                        virtual_t1 -= 1
                        break
                else:
                    done1 = True
                if not done1:
                    continue
            self.eviction_steps += seen1 + seen2
            return None
        self.eviction_steps += seen1 + seen2
        return victims

    def _forget_victims(self, victims: list[Any]) -> None:
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        for key in victims:
            # A resident key is never a ghost, so assignment appends at the MRU end.
            if key in t1:
                del t1[key]
                b1[key] = None
            else:
                del t2[key]
                b2[key] = None
        capacity = self.cache_capacity
        for ghosts in (b1, b2):
            while len(ghosts) > capacity:
                ghosts.popitem(last=False)

    def _insert(self, keys: list[Any]) -> None:
        t1, b1, b2 = self._t1, self._b1, self._b2
        for key in keys:  # item by item: OrderedDict.update is slower per key
            t1[key] = None
        # A stored ghost stops being one; usually few are, so find them in one C pass.
        for ghosts in (b1, b2):
            if ghosts:
                for key in ghosts.keys() & keys:
                    del ghosts[key]

    def _drop_pending(self, key: Any) -> None:
        del self._t1[key]  # a pending key is always in T1 (a touch keeps it there)

    # ------------------------------------------------ views for the checker

    def t1_entries(self) -> list[tuple[Any, int]]:
        """``(key, ref_cnt)`` of T1, least recently used first."""
        refs = self._refs
        return [(key, refs[key]) for key in self._t1]

    def t2_entries(self) -> list[tuple[Any, int]]:
        """``(key, ref_cnt)`` of T2, least recently used first."""
        refs = self._refs
        return [(key, refs[key]) for key in self._t2]

    def b1_keys(self) -> list[Any]:
        """The ghosts evicted from T1, least recent first."""
        return list(self._b1)

    def b2_keys(self) -> list[Any]:
        """The ghosts evicted from T2, least recent first."""
        return list(self._b2)

    def check_representation(self) -> None:
        """Raise AssertionError if the representation invariant does not hold."""
        self._check_counts()
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        capacity = self.cache_capacity
        refs = self._refs
        if len(t1) + len(t2) != len(refs):
            raise AssertionError(f"T1 ({len(t1)}) and T2 ({len(t2)}) do not hold the "
                                 f"{len(refs)} keys")
        for name, resident in (("T1", t1), ("T2", t2)):
            for key in resident:
                if key not in refs:
                    raise AssertionError(f"{name} key {key!r} has no ref count")
        for key in t2:
            if refs[key] < 0:
                raise AssertionError(f"pending key {key!r} is in T2")
        lists: list[tuple[str, OrderedDict[Any, Any]]] = [
            ("T1", t1), ("T2", t2), ("B1", b1), ("B2", b2)]
        for i, (name_a, a) in enumerate(lists):
            for name_b, b in lists[i + 1:]:
                shared = a.keys() & b.keys()
                if shared:
                    raise AssertionError(f"{name_a} and {name_b} share {sorted(map(repr, shared))}")
        if len(t1) + len(t2) > capacity:
            raise AssertionError(f"T1 + T2 hold {len(t1) + len(t2)} keys, capacity {capacity}")
        if len(b1) > capacity or len(b2) > capacity:
            raise AssertionError(f"ghost lists of {len(b1)} and {len(b2)} keys, capacity "
                                 f"{capacity}")
        p = self.target_t1_size
        if not isinstance(p, float) or not 0 <= p <= capacity:
            raise AssertionError(f"target_t1_size {p!r} outside [0, {capacity}]")
