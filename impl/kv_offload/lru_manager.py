"""kvspec's LRU offloading manager: vLLM 0.13's ``LRUOffloadingManager``, same API.

One ``OrderedDict`` holds every key, least recently used first; eviction walks it from the
front and takes the first keys that no load pins, no store still writes, and the calling
``prepare_store`` does not name. Every refusal is typed and changes nothing
(``abstract.py``); a store that cannot find enough victims evicts nothing.
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


class LRUOffloadingManager(RefCountingManager):
    """An offloading manager that evicts the least recently used ready, unpinned key."""

    def __init__(self, backend: BackendLike, enable_events: bool = False) -> None:
        super().__init__(backend, enable_events)
        # Key -> block, in recency order: the base class's block map is this list, so that
        # adding or dropping a block places or removes its key with no second structure.
        self._lru: OrderedDict[Any, Any] = OrderedDict()
        self._blocks = self._lru

    def touch(self, block_hashes: Iterable[Any]) -> None:
        lru = self._lru
        move = lru.move_to_end
        # Reversed, so that the first key (a prefix's root) ends up the most recent.
        for key in reversed(as_key_list(block_hashes)):
            if key in lru:
                move(key)

    def _choose_victims(self, need: int, protected: set[Any] | None) -> list[Any] | None:
        victims: list[Any] = []
        take = victims.append
        seen = 0  # keys inspected
        refs = self._refs
        for seen, key in enumerate(self._lru, 1):  # noqa: B007
            if refs[key] == 0 and (protected is None or key not in protected):
                take(key)
                if len(victims) == need:
                    break
        self.eviction_steps += seen
        return victims if len(victims) == need else None

    def _forget_victims(self, victims: list[Any]) -> None:
        pass  # the base class pops them from _blocks, which is the LRU list

    def _insert(self, keys: list[Any]) -> None:
        pass  # already appended to _blocks, the LRU list, at its most recent end

    def _drop_pending(self, key: Any) -> None:
        pass  # the base class pops it from _blocks

    # ------------------------------------------------ views for the checker

    def ordered_entries(self) -> list[tuple[Any, int]]:
        """``(key, ref_cnt)`` for every key, least recently used first."""
        refs = self._refs
        return [(key, refs[key]) for key in self._lru]

    def check_representation(self) -> None:
        """Raise AssertionError if the representation invariant does not hold."""
        if self._blocks is not self._lru:
            raise AssertionError("the block map is not the LRU list")
        self._check_counts()
