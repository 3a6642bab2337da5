"""Sampled block-residency metrics, driven by a fake clock and a seeded random source."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any
from unittest.mock import patch

import pytest
from hypothesis import event, given, strategies as st

from kvspec.impl.kv_cache_metrics import (
    BlockMetricsState,
    InvalidSampleRateError,
    KVCacheEvictionEvent,
    KVCacheMetricsCollector,
)

SECOND = 1_000_000_000


class FakeClock:
    def __init__(self) -> None:
        self.now_ns = 0

    def __call__(self) -> int:
        return self.now_ns

    def advance(self, seconds: float) -> None:
        self.now_ns += int(seconds * SECOND)


@dataclass(frozen=True)
class Block:
    block_id: int


@pytest.mark.parametrize("rate", [0, 0.0, -0.5, 1.0000001, 2, float("nan"), float("inf"), "0.5",
                                  None, True])
def test_bad_sample_rate_is_refused(rate: Any) -> None:
    with pytest.raises(InvalidSampleRateError, match="sample rate"):
        KVCacheMetricsCollector(rate)
    assert issubclass(InvalidSampleRateError, ValueError)


def test_default_rate_and_full_sampling() -> None:
    assert KVCacheMetricsCollector().sample_rate == 0.01
    collector = KVCacheMetricsCollector(1.0)
    assert all(collector.should_sample_block() for _ in range(100))


def test_lifetime_idle_and_reuse_gaps() -> None:
    clock = FakeClock()
    collector = KVCacheMetricsCollector(1.0, clock=clock)
    collector.on_block_allocated(Block(3))
    for gap in (1, 2, 3, 4, 5):  # accesses at t = 1, 3, 6, 10, 15; only the last four are kept
        clock.advance(gap)
        collector.on_block_accessed(Block(3))
    clock.advance(5)
    collector.on_block_evicted(Block(3))
    assert collector.drain_events() == [
        KVCacheEvictionEvent(lifetime_seconds=20.0, idle_seconds=5.0,
                             reuse_gaps_seconds=(3.0, 4.0, 5.0))
    ]
    assert collector.drain_events() == []
    assert 3 not in collector.block_metrics


def test_block_without_accesses_has_no_reuse_gaps() -> None:
    clock = FakeClock()
    state = BlockMetricsState(clock)
    clock.advance(2)
    assert state.get_reuse_gaps_seconds() == []
    assert state.get_lifetime_seconds() == state.get_idle_time_seconds() == 2.0
    state.record_access()
    assert state.get_reuse_gaps_seconds() == [] and state.get_idle_time_seconds() == 0.0


def test_untracked_blocks_are_ignored() -> None:
    collector = KVCacheMetricsCollector(1.0)
    collector.on_block_accessed(Block(1))
    collector.on_block_evicted(Block(1))
    assert collector.drain_events() == [] and collector.block_metrics == {}


def test_reset_forgets_blocks_and_events() -> None:
    collector = KVCacheMetricsCollector(1.0)
    collector.on_block_allocated(Block(1))
    collector.on_block_allocated(Block(2))
    collector.on_block_evicted(Block(1))
    collector.reset()
    assert collector.block_metrics == {} and collector.drain_events() == []


def test_reallocation_restarts_tracking() -> None:
    clock = FakeClock()
    collector = KVCacheMetricsCollector(1.0, clock=clock)
    collector.on_block_allocated(Block(4))
    clock.advance(10)
    collector.on_block_evicted(Block(4))
    collector.on_block_allocated(Block(4))
    clock.advance(1)
    collector.on_block_evicted(Block(4))
    assert [e.lifetime_seconds for e in collector.drain_events()] == [10.0, 1.0]


@given(seed=st.integers(0, 2**32), rate=st.floats(0.05, 1.0),
       ids=st.lists(st.integers(0, 30), max_size=40))
def test_batch_hooks_match_per_block_hooks(seed: int, rate: float, ids: list[int]) -> None:
    one = KVCacheMetricsCollector(rate, rng=random.Random(seed), clock=lambda: 0)
    many = KVCacheMetricsCollector(rate, rng=random.Random(seed), clock=lambda: 0)
    for block_id in ids:
        one.on_block_allocated(Block(block_id))
    many.on_blocks_allocated(ids)
    assert one.block_metrics.keys() == many.block_metrics.keys()
    for block_id in ids:
        one.on_block_accessed(Block(block_id))
    many.on_blocks_accessed(ids)
    for block_id in ids:
        one.on_block_evicted(Block(block_id))
        many.on_block_id_evicted(block_id)
    assert one.drain_events() == many.drain_events()
    event(f"tracked: {min(len(one.block_metrics), 3)}")


def test_sampling_follows_the_rate() -> None:
    collector = KVCacheMetricsCollector(0.25, rng=random.Random(1234))
    collector.on_blocks_allocated(range(4000))
    assert 800 < len(collector.block_metrics) < 1200


# --- the default clock and random source are vLLM's, read at call time -------------------------


def test_default_clock_is_time_monotonic_ns_at_call_time() -> None:
    """Patching ``time.monotonic_ns`` (as vLLM's own tests do) moves the collector's clock."""
    collector = KVCacheMetricsCollector(1.0)
    with patch("time.monotonic_ns", return_value=1 * SECOND):
        collector.on_block_allocated(Block(0))
        state = BlockMetricsState()
    with patch("time.monotonic_ns", return_value=3 * SECOND):
        collector.on_block_accessed(Block(0))
    with patch("time.monotonic_ns", return_value=7 * SECOND):
        collector.on_block_evicted(Block(0))
        assert state.get_lifetime_seconds() == 6.0
    assert collector.drain_events() == [
        KVCacheEvictionEvent(lifetime_seconds=6.0, idle_seconds=4.0, reuse_gaps_seconds=())
    ]
    assert state.birth_time_ns == 1 * SECOND


def test_default_sampling_draws_from_the_random_module() -> None:
    """``random.seed`` and a patched ``random.random`` govern sampling, as in vLLM."""
    with patch("random.random", return_value=0.5):
        assert not KVCacheMetricsCollector(0.5).should_sample_block()
        assert KVCacheMetricsCollector(0.50001).should_sample_block()
    state = random.getstate()
    try:
        random.seed(99)
        first = KVCacheMetricsCollector(0.3)
        first.on_blocks_allocated(range(200))
        random.seed(99)
        second = KVCacheMetricsCollector(0.3)
        second.on_blocks_allocated(range(200))
    finally:
        random.setstate(state)
    assert first.block_metrics.keys() == second.block_metrics.keys()
    assert 0 < len(first.block_metrics) < 200
