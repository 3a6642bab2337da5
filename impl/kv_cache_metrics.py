"""Sampled block-residency metrics (vLLM's ``kv_cache_metrics.py``, identical in 0.13 and 0.33).

A sampled fraction of allocated blocks is tracked from allocation to eviction: how long it
lived, how long it sat idle since its last access, and the gaps between its last (at most
four) accesses. The block pool calls ``on_block_allocated`` in ``get_new_blocks``,
``on_block_accessed`` in ``touch``, ``on_block_evicted`` at the start of every eviction attempt
and ``reset`` on a successful prefix-cache reset.

The clock and the random source are vLLM's by default, looked up when they are read:
``time.monotonic_ns`` and the ``random`` module's shared generator, so ``random.seed`` and
``unittest.mock.patch("time.monotonic_ns", ...)`` (as vLLM's tests do) act on impl as on
vLLM. Both are also injectable (``clock=``, ``rng=``) for deterministic tests.
"""

from __future__ import annotations

import math
import random
import time
from collections import deque
from collections.abc import Callable, Iterable
from itertools import pairwise
from typing import Protocol

from kvspec.impl import host_types
from kvspec.impl.stats import KVCacheEvictionEvent as KVCacheEvictionEvent

__all__ = [
    "BlockMetricsState",
    "InvalidSampleRateError",
    "KVCacheEvictionEvent",
    "KVCacheMetricsCollector",
]

_NS_PER_SECOND = 1e9
_ACCESS_HISTORY_LENGTH = 4

Clock = Callable[[], int]


class InvalidSampleRateError(ValueError):
    """A sample rate outside (0, 1] (vLLM asserts instead)."""


# Not ``time.monotonic_ns`` itself as the default: a default argument binds the function when
# this module is imported, and a later patch of ``time.monotonic_ns`` would not reach it.
def _monotonic_ns() -> int:
    return time.monotonic_ns()


def _shared_random() -> float:
    return random.random()


class _HasBlockId(Protocol):
    @property
    def block_id(self) -> int: ...


class BlockMetricsState:
    """Residency of one sampled block: birth, last access, and its last four access times."""

    __slots__ = ("_clock", "access_history", "birth_time_ns", "last_access_ns")

    def __init__(self, clock: Clock = _monotonic_ns) -> None:
        now_ns = clock()
        self._clock = clock
        self.birth_time_ns = now_ns
        self.last_access_ns = now_ns
        self.access_history: deque[int] = deque(maxlen=_ACCESS_HISTORY_LENGTH)

    def record_access(self) -> None:
        now_ns = self._clock()
        self.last_access_ns = now_ns
        self.access_history.append(now_ns)

    def get_lifetime_seconds(self) -> float:
        return (self._clock() - self.birth_time_ns) / _NS_PER_SECOND

    def get_idle_time_seconds(self) -> float:
        return (self._clock() - self.last_access_ns) / _NS_PER_SECOND

    def get_reuse_gaps_seconds(self) -> list[float]:
        """Gaps between consecutive recorded accesses (empty with fewer than two)."""
        history = self.access_history
        if len(history) < 2:
            return []
        return [(later - earlier) / _NS_PER_SECOND for earlier, later in pairwise(history)]


class KVCacheMetricsCollector:
    """Tracks a ``sample_rate`` fraction of allocated blocks and reports their evictions."""

    __slots__ = ("_clock", "_eviction_events", "_random", "block_metrics", "sample_rate")

    def __init__(
        self,
        sample_rate: float = 0.01,
        *,
        rng: random.Random | None = None,
        clock: Clock = _monotonic_ns,
    ) -> None:
        if (
            isinstance(sample_rate, bool)
            or not isinstance(sample_rate, int | float)
            or math.isnan(sample_rate)
            or not 0 < sample_rate <= 1.0
        ):
            raise InvalidSampleRateError(f"sample rate must be in (0, 1], got {sample_rate!r}")
        self.sample_rate = float(sample_rate)
        self._random: Callable[[], float] = _shared_random if rng is None else rng.random
        self._clock = clock
        self.block_metrics: dict[int, BlockMetricsState] = {}
        self._eviction_events: list[KVCacheEvictionEvent] = []

    def should_sample_block(self) -> bool:
        return self._random() < self.sample_rate

    def on_block_allocated(self, block: _HasBlockId) -> None:
        if self._random() < self.sample_rate:
            self.block_metrics[block.block_id] = BlockMetricsState(self._clock)

    def on_blocks_allocated(self, block_ids: Iterable[int]) -> None:
        """``on_block_allocated`` for many blocks by id: the same draws, in the same order."""
        draw = self._random
        rate = self.sample_rate
        for block_id in block_ids:
            if draw() < rate:
                self.block_metrics[block_id] = BlockMetricsState(self._clock)

    def on_block_accessed(self, block: _HasBlockId) -> None:
        state = self.block_metrics.get(block.block_id)
        if state is not None:
            state.record_access()

    def on_blocks_accessed(self, block_ids: Iterable[int]) -> None:
        """``on_block_accessed`` for many blocks by id."""
        metrics = self.block_metrics
        if not metrics:
            return
        for block_id in block_ids:
            state = metrics.get(block_id)
            if state is not None:
                state.record_access()

    def on_block_evicted(self, block: _HasBlockId) -> None:
        self.on_block_id_evicted(block.block_id)

    def on_block_id_evicted(self, block_id: int) -> None:
        """``on_block_evicted`` by id: stop tracking the block and report its residency."""
        state = self.block_metrics.pop(block_id, None)
        if state is None:
            return
        self._eviction_events.append(
            host_types.KVCacheEvictionEvent(
                lifetime_seconds=state.get_lifetime_seconds(),
                idle_seconds=state.get_idle_time_seconds(),
                reuse_gaps_seconds=tuple(state.get_reuse_gaps_seconds()),
            )
        )

    def reset(self) -> None:
        """Forget every tracked block and every undrained event."""
        self.block_metrics.clear()
        self._eviction_events.clear()

    def drain_events(self) -> list[KVCacheEvictionEvent]:
        """The eviction events since the last drain (the collector keeps none)."""
        events = self._eviction_events
        self._eviction_events = []
        return events
