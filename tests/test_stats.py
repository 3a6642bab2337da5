"""The cache statistics impl reports (impl/stats.py): what ``PrefixCacheStats.record`` counts,
apart for preempted requests, and what a sampled ``KVCacheEvictionEvent`` holds; each refuses a
bad value naming it, and a refused ``record`` counts nothing. Hostile input to both:
tests/hostile/test_events_metrics_plan.py.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from kvspec.impl.stats import InvalidStatsError, KVCacheEvictionEvent, PrefixCacheStats


def test_record_counts_requests_queries_and_hits_apart_for_preempted_ones() -> None:
    stats = PrefixCacheStats()
    stats.record(16, 8, False)
    stats.record(np.int64(10), 0, False)
    stats.record(32, 32, True)
    assert dataclasses.astuple(stats) == (False, 2, 26, 8, 1, 32, 32)
    assert type(stats.queries) is int
    made = PrefixCacheStats(reset=True, requests=np.int32(1))  # type: ignore[arg-type]
    assert made.requests == 1 and type(made.requests) is int


@pytest.mark.parametrize(("call", "named"), [
    (lambda s: s.record(4, 5, False), "num_hits 5 is more than num_tokens 4"),
    (lambda s: s.record(-1, 0, False), "num_tokens must be an int >= 0, got -1"),
    (lambda s: s.record(4, 1.0, False), "num_hits must be an int >= 0, got 1.0"),
    (lambda s: s.record(4, 1, 1), "preempted must be a bool, got 1"),
])
def test_a_refused_record_names_the_value_and_counts_nothing(call: object, named: str) -> None:
    stats = PrefixCacheStats(requests=3, queries=30, hits=7)
    before = dataclasses.astuple(stats)
    with pytest.raises(InvalidStatsError, match=named):
        call(stats)  # type: ignore[operator]
    assert dataclasses.astuple(stats) == before


def test_stats_refuse_bad_fields_when_made() -> None:
    with pytest.raises(InvalidStatsError, match="reset must be a bool, got 0"):
        PrefixCacheStats(reset=0)  # type: ignore[arg-type]
    with pytest.raises(InvalidStatsError, match="hits must be an int >= 0, got True"):
        PrefixCacheStats(hits=True)


def test_an_eviction_event_holds_seconds() -> None:
    event = KVCacheEvictionEvent(2.5, 0, (0.5, 1))
    assert (event.lifetime_seconds, event.idle_seconds, event.reuse_gaps_seconds) == (
        2.5, 0, (0.5, 1))
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.idle_seconds = 1.0  # type: ignore[misc]
    for bad in (-1.0, math.inf, math.nan, True, "1"):
        with pytest.raises(InvalidStatsError, match="idle_seconds"):
            KVCacheEvictionEvent(1.0, bad, ())  # type: ignore[arg-type]
    with pytest.raises(InvalidStatsError, match=r"reuse_gaps_seconds must be a tuple, got \[1.0\]"):
        KVCacheEvictionEvent(1.0, 1.0, [1.0])  # type: ignore[arg-type]
    with pytest.raises(InvalidStatsError, match="a reuse gap"):
        KVCacheEvictionEvent(1.0, 1.0, (1.0, -2.0))
