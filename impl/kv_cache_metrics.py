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

Bad input is refused with ``InvalidMetricsArgumentError`` (a ``ValueError``) before anything
changes, and before a random number is drawn: a block is anything with an integer
``block_id`` >= 0 (impl's blocks, vLLM's, a test's stand-in); a batch of ids is read whole
and checked first. Integers follow impl's one rule (impl/checks.py): an int or a numpy
integer, never a bool. A clock is trusted to return int nanoseconds: it is not called to
check it, since that would take a reading from a patched or fake clock.
"""

from __future__ import annotations

import math
import random
import time
from collections import deque
from collections.abc import Callable, Iterable
from itertools import pairwise
from typing import Protocol, SupportsIndex

from kvspec.impl import host_types
from kvspec.impl.checks import BlockLike, as_int
from kvspec.impl.errors import (
    InvalidMetricsArgumentError as InvalidMetricsArgumentError,
    InvalidSampleRateError as InvalidSampleRateError,
)
from kvspec.impl.stats import KVCacheEvictionEvent as KVCacheEvictionEvent

__all__ = [
    "BlockMetricsState",
    "InvalidMetricsArgumentError",
    "InvalidSampleRateError",
    "KVCacheEvictionEvent",
    "KVCacheMetricsCollector",
    "MetricsCollectorLike",
]

_NS_PER_SECOND = 1e9
_ACCESS_HISTORY_LENGTH = 4

Clock = Callable[[], int]


def _not_a_block(block: object) -> InvalidMetricsArgumentError:
    return InvalidMetricsArgumentError(f"not a block with an int block_id >= 0: {block!r}")


def _block_id(block: object) -> int:
    """``block.block_id``, or a typed refusal."""
    try:
        block_id = block.block_id  # type: ignore[attr-defined]
    except AttributeError:
        raise _not_a_block(block) from None
    checked = block_id if type(block_id) is int else as_int(block_id)
    if checked is None or checked < 0:
        raise _not_a_block(block)
    return checked


def _check_block_id(block_id: object) -> int:
    checked = block_id if type(block_id) is int else as_int(block_id)
    if checked is None or checked < 0:
        raise InvalidMetricsArgumentError(f"a block id must be an int >= 0, got {block_id!r}")
    return checked


def _block_ids(block_ids: object) -> list[int]:
    """``block_ids`` read whole into a list and checked (ints >= 0), before anything changes.
    An iterator that fails while read raises its own error."""
    try:
        iterator = iter(block_ids)  # type: ignore[call-overload]
    except TypeError:
        raise InvalidMetricsArgumentError(
            f"block ids must be an iterable of ints, got {block_ids!r}") from None
    ids = list(iterator)
    # A type count and a min at C speed; the loop only finds the culprit.
    if list(map(type, ids)).count(int) != len(ids) or (ids and min(ids) < 0):
        return [_check_block_id(block_id) for block_id in ids]
    return ids


def _check_clock(clock: object) -> Clock:
    if not callable(clock):
        raise InvalidMetricsArgumentError(
            f"clock must be a callable returning int nanoseconds, got {clock!r}")
    return clock


# Not ``time.monotonic_ns`` itself as the default: a default argument binds the function when
# this module is imported, and a later patch of ``time.monotonic_ns`` would not reach it.
def _monotonic_ns() -> int:
    return time.monotonic_ns()


def _shared_random() -> float:
    return random.random()


class MetricsCollectorLike(Protocol):
    """What a block pool calls on its metrics collector (this module's
    ``KVCacheMetricsCollector``, or vLLM's: the pool takes either)."""

    def on_block_allocated(self, block: BlockLike) -> None: ...

    def on_block_accessed(self, block: BlockLike) -> None: ...

    def on_block_evicted(self, block: BlockLike) -> None: ...

    def reset(self) -> None: ...


class BlockMetricsState:
    """Residency of one sampled block: birth, last access, and its last four access times."""

    __slots__ = ("_clock", "access_history", "birth_time_ns", "last_access_ns")

    def __init__(self, clock: Clock = _monotonic_ns) -> None:
        now_ns = _check_clock(clock)()
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
        draw = _shared_random if rng is None else getattr(rng, "random", None)
        if not callable(draw):
            raise InvalidMetricsArgumentError(
                f"rng must be None or a random.Random, got {rng!r}")
        self.sample_rate = float(sample_rate)
        self._random: Callable[[], float] = draw
        self._clock = _check_clock(clock)
        self.block_metrics: dict[int, BlockMetricsState] = {}
        self._eviction_events: list[KVCacheEvictionEvent] = []

    def should_sample_block(self) -> bool:
        return self._random() < self.sample_rate

    def on_block_allocated(self, block: BlockLike) -> None:
        block_id = _block_id(block)
        if self._random() < self.sample_rate:
            self.block_metrics[block_id] = BlockMetricsState(self._clock)

    def on_blocks_allocated(self, block_ids: Iterable[SupportsIndex]) -> None:
        """``on_block_allocated`` for many blocks by id: the same draws, in the same order."""
        ids = _block_ids(block_ids)
        draw = self._random
        rate = self.sample_rate
        for block_id in ids:
            if draw() < rate:
                self.block_metrics[block_id] = BlockMetricsState(self._clock)

    def on_block_accessed(self, block: BlockLike) -> None:
        state = self.block_metrics.get(_block_id(block))
        if state is not None:
            state.record_access()

    def on_blocks_accessed(self, block_ids: Iterable[SupportsIndex]) -> None:
        """``on_block_accessed`` for many blocks by id."""
        ids = _block_ids(block_ids)
        metrics = self.block_metrics
        if not metrics:
            return
        for block_id in ids:
            state = metrics.get(block_id)
            if state is not None:
                state.record_access()

    def on_block_evicted(self, block: BlockLike) -> None:
        self._evicted(_block_id(block))

    def on_block_id_evicted(self, block_id: SupportsIndex) -> None:
        """``on_block_evicted`` by id: stop tracking the block and report its residency."""
        self._evicted(_check_block_id(block_id))

    def _evicted(self, block_id: int) -> None:
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
