"""Cache statistics impl reports to its callers (vLLM 0.13's ``vllm/v1/metrics/stats.py``
classes of the same names and fields): prefix-cache lookups and sampled block evictions."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KVCacheEvictionEvent", "PrefixCacheStats"]


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

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits


@dataclass(frozen=True, slots=True)
class KVCacheEvictionEvent:
    """What one sampled block did between allocation and eviction (all in seconds)."""

    lifetime_seconds: float
    idle_seconds: float
    reuse_gaps_seconds: tuple[float, ...]
