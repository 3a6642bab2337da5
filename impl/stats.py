"""Cache statistics impl reports to its callers (vLLM 0.13's ``vllm/v1/metrics/stats.py``
classes of the same names and fields): prefix-cache lookups and sampled block evictions.

Unlike vLLM's, they refuse bad values with ``InvalidStatsError`` (a ``ValueError``) when made
and when recording, and ``record`` checks all three values before it adds any: a count is an
int >= 0 (hits at most the tokens queried), a duration a real number of seconds >= 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

__all__ = ["InvalidStatsError", "KVCacheEvictionEvent", "PrefixCacheStats"]


class InvalidStatsError(ValueError):
    """A count that is not an int >= 0, or a duration that is not a number of seconds >= 0."""


def _check_count(name: str, value: object) -> None:
    if type(value) is not int or value < 0:
        raise InvalidStatsError(f"{name} must be an int >= 0, got {value!r}")


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
            _check_count(field.name, getattr(self, field.name))

    def record(self, num_tokens: int | object, num_hits: int | object,
               preempted: bool | object) -> None:
        _check_count("num_tokens", num_tokens)
        _check_count("num_hits", num_hits)
        if num_hits > num_tokens:  # type: ignore[operator]
            raise InvalidStatsError(f"num_hits {num_hits!r} is more than num_tokens {num_tokens!r}")
        if type(preempted) is not bool:
            raise InvalidStatsError(f"preempted must be a bool, got {preempted!r}")
        tokens: int = num_tokens  # type: ignore[assignment]
        hits: int = num_hits  # type: ignore[assignment]
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
