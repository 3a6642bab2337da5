"""Cache statistics impl reports to its callers (vLLM 0.13's ``vllm/v1/metrics/stats.py``
classes of the same names and fields): prefix-cache lookups and sampled block evictions.

Unlike vLLM's, they refuse bad values with ``InvalidStatsError`` (a ``ValueError``) when made
and when recording, and ``record`` checks all three values before it adds any: a count is an
int >= 0 (hits at most the tokens queried; impl's integer rule, impl/checks.py: an int or a
numpy integer, never a bool), a duration a real number of seconds >= 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import SupportsIndex

from kvspec.impl.checks import Flag, as_int
from kvspec.impl.errors import InvalidStatsError as InvalidStatsError

__all__ = ["InvalidStatsError", "KVCacheEvictionEvent", "PrefixCacheStats"]


def _check_count(name: str, value: object) -> int:
    count = value if type(value) is int else as_int(value)
    if count is None or count < 0:
        raise InvalidStatsError(f"{name} must be an int >= 0, got {value!r}")
    return count


def _check_seconds(name: str, value: object) -> None:
    if (isinstance(value, bool) or not isinstance(value, int | float)
            or not 0 <= value < math.inf):
        raise InvalidStatsError(f"{name} must be a finite number of seconds >= 0, got {value!r}")


@dataclass
class PrefixCacheStats:
    """Prefix-cache lookups since the last ``make_prefix_cache_stats``: requests, tokens
    queried and tokens hit, counted apart for requests that were preempted before."""

    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def __post_init__(self) -> None:
        if type(self.reset) is not bool:
            raise InvalidStatsError(f"reset must be a bool, got {self.reset!r}")
        for field in fields(self)[1:]:
            setattr(self, field.name, _check_count(field.name, getattr(self, field.name)))

    def record(self, num_tokens: SupportsIndex, num_hits: SupportsIndex,
               preempted: Flag) -> None:
        tokens = _check_count("num_tokens", num_tokens)
        hits = _check_count("num_hits", num_hits)
        if hits > tokens:
            raise InvalidStatsError(f"num_hits {num_hits!r} is more than num_tokens {num_tokens!r}")
        if type(preempted) is not bool:
            raise InvalidStatsError(f"preempted must be a bool, got {preempted!r}")
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += tokens
            self.preempted_hits += hits
        else:
            self.requests += 1
            self.queries += tokens
            self.hits += hits


@dataclass(frozen=True, slots=True)
class KVCacheEvictionEvent:
    """What one sampled block did between allocation and eviction (all in seconds)."""

    lifetime_seconds: float
    idle_seconds: float
    reuse_gaps_seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        _check_seconds("lifetime_seconds", self.lifetime_seconds)
        _check_seconds("idle_seconds", self.idle_seconds)
        gaps = self.reuse_gaps_seconds
        if type(gaps) is not tuple:
            raise InvalidStatsError(f"reuse_gaps_seconds must be a tuple, got {gaps!r}")
        for gap in gaps:
            _check_seconds("a reuse gap", gap)
