"""Mutants of the events, metrics, stats and planning checks, and of the pool's event bound.

The first group brings back a failure the hostile-input suite exists to catch in
tests/hostile/test_events_metrics_plan.py (an untyped error, a refusal that changes state, a
silent acceptance, an event that does not decode). The second breaks the bound on pending
events (impl/block_pool.py, Bounded events), and the pool conformance machine kills it with
the invariant it breaks.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from kvspec.impl import block_pool as bp, host_types, kv_cache_metrics as metrics, kv_events
from kvspec.impl.hashing import BlockHash, maybe_convert_block_hash
from kvspec.impl.kv_events import MEDIUM_GPU, BlockRemoved
from kvspec.impl.stats import PrefixCacheStats
from kvspec.models import plan
from tests.mutants import Mutant, replace

HOSTILE = "tests/hostile/test_events_metrics_plan.py"
MACHINE = "tests/test_pool_machine.py"


# --- hostile input ----------------------------------------------------------------------------


def aggregator_counts_as_it_goes() -> None:
    """add_events counts straight into its Counter: an event that cannot be hashed, after good
    ones, leaves those counted and raises Python's bare TypeError."""
    def add_events(self: kv_events.KVEventAggregator, events: Any) -> None:
        if not isinstance(events, list):
            raise kv_events.InvalidEventsError(f"events must be a list, got {events!r}")
        for event in events:
            if not isinstance(event, kv_events.KVCacheEvent):
                raise kv_events.InvalidEventsError(f"not a KVCacheEvent: {event!r}")
        counter: Counter[Any] = self._event_counter
        for event in events:
            counter[event] += 1
    replace(kv_events.KVEventAggregator, "add_events", add_events)


def metrics_batch_draws_while_reading() -> None:
    """on_blocks_allocated draws and samples as it reads the ids: an iterator that fails
    halfway leaves blocks tracked and the random source advanced."""
    def on_blocks_allocated(self: metrics.KVCacheMetricsCollector, block_ids: Any) -> None:
        for block_id in block_ids:
            metrics._check_block_id(block_id)
            if self._random() < self.sample_rate:
                self.block_metrics[block_id] = metrics.BlockMetricsState(self._clock)
    replace(metrics.KVCacheMetricsCollector, "on_blocks_allocated", on_blocks_allocated)


def metrics_hook_trusts_its_block() -> None:
    """on_block_allocated reads block.block_id unchecked (as vLLM does): None gets Python's
    AttributeError, and a stand-in with block_id '1' is tracked under a string."""
    def on_block_allocated(self: metrics.KVCacheMetricsCollector, block: Any) -> None:
        if self._random() < self.sample_rate:
            self.block_metrics[block.block_id] = metrics.BlockMetricsState(self._clock)
    replace(metrics.KVCacheMetricsCollector, "on_block_allocated", on_block_allocated)


def stats_record_adds_as_it_checks() -> None:
    """PrefixCacheStats.record adds each value as it goes: a bad num_hits after the request
    and its tokens are counted leaves them counted."""
    def record(self: PrefixCacheStats, num_tokens: Any, num_hits: Any, preempted: Any) -> None:
        self.requests += 1
        self.queries += num_tokens
        if type(num_hits) is not int or not 0 <= num_hits <= num_tokens:
            raise ValueError(f"bad num_hits {num_hits!r}")
        self.hits += num_hits
    replace(PrefixCacheStats, "record", record)


def parse_memory_reads_any_digits() -> None:
    """parse_memory hands int() as many digits as it is given: past 4,300 it raises Python's
    own ValueError, which names nothing and which kvspec plan does not catch (a traceback)."""
    replace(plan, "_MAX_MEMORY_DIGITS", 10**6)


def plan_counts_unbounded() -> None:
    """The planner takes any positive int: 2**64 blocks, a 10**400-token request."""
    replace(plan, "MAX_PLAN_INT", 10**10_000)


def pool_event_hash_as_hex() -> None:
    """The pool's BlockRemoved events carry the hash as a hex string, which vLLM's typed
    decoder refuses (a hash is an int or bytes)."""
    def removed(block_hashes: list[Any], medium: str | None) -> BlockRemoved:
        as_hex: list[Any] = [h.hex() if isinstance(h, bytes) else f"{h:x}" for h in block_hashes]
        return BlockRemoved(as_hex, medium)
    replace(host_types, "BlockRemoved", removed)


# --- the bound on pending events -------------------------------------------------------------


def _collapse(keep_cleared: bool, keep_last: bool) -> Any:
    """BlockPool._bound_kv_events, with the snapshot's AllBlocksCleared or its last cached
    block left out."""
    def bound_kv_events(self: bp.BlockPool) -> None:
        queue, key_of = self.kv_event_queue, self._key_of
        bound = self.max_pending_kv_events
        if bound is None or len(queue) <= bound or len(queue) < 2 * (len(key_of) + 1):
            return
        snapshot: list[Any] = [host_types.AllBlocksCleared()] if keep_cleared else []
        blocks = sorted(key_of, key=lambda b: b.block_id)
        for block in blocks if keep_last else blocks[:-1]:
            snapshot.append(host_types.BlockStored(
                block_hashes=[maybe_convert_block_hash(BlockHash(key_of[block]))],
                parent_block_hash=None, token_ids=[],
                block_size=self._stored_block_sizes.get(self._group_of.get(block, 0), 2),
                lora_id=None, medium=MEDIUM_GPU))
        queue[:] = snapshot
        self.num_kv_event_collapses += 1
    return bound_kv_events


def snapshot_forgets_cleared() -> None:
    """A collapse replaces the pending events by a BlockStored per cached block but no
    AllBlocksCleared first: a consumer keeps what it replayed before and counts blocks twice."""
    replace(bp.BlockPool, "_bound_kv_events", _collapse(keep_cleared=False, keep_last=True))


def snapshot_drops_a_block() -> None:
    """The snapshot leaves out one cached block (an off-by-one over the sorted blocks): a
    consumer that replays it no longer knows that block is cached."""
    replace(bp.BlockPool, "_bound_kv_events", _collapse(keep_cleared=True, keep_last=False))


def events_never_collapse() -> None:
    """The bound is taken and counted nowhere: pending events grow without bound again."""
    def bound_kv_events(self: bp.BlockPool) -> None:
        return None
    replace(bp.BlockPool, "_bound_kv_events", bound_kv_events)


def _mutant(name: str, plant: Any, checker: str, killed_by: str = "") -> Mutant:
    description = " ".join((plant.__doc__ or "").split())
    return Mutant(name, description, plant, (checker,), killed_by)


MUTANTS: list[Mutant] = [
    _mutant("hostile_aggregator_counts_as_it_goes", aggregator_counts_as_it_goes, HOSTILE),
    _mutant("hostile_metrics_batch_draws_while_reading", metrics_batch_draws_while_reading,
            HOSTILE),
    _mutant("hostile_metrics_hook_trusts_its_block", metrics_hook_trusts_its_block, HOSTILE),
    _mutant("hostile_stats_record_adds_as_it_checks", stats_record_adds_as_it_checks, HOSTILE),
    # Named by the test that kills them: the file's tests before it cost seconds of every run.
    _mutant("hostile_parse_memory_reads_any_digits", parse_memory_reads_any_digits,
            f"{HOSTILE}::test_parse_memory_refuses_bad_sizes"),
    _mutant("hostile_plan_counts_unbounded", plan_counts_unbounded,
            f"{HOSTILE}::test_plan_memory_refuses_bad_arguments"),
    _mutant("hostile_pool_event_hash_as_hex", pool_event_hash_as_hex, HOSTILE,
            "test_what_the_pool_builds_always_decodes"),
    _mutant("event_snapshot_forgets_cleared", snapshot_forgets_cleared, MACHINE,
            "pending events: target"),
    _mutant("event_snapshot_drops_a_block", snapshot_drops_a_block, MACHINE,
            "event_stream_holds_every_copy"),  # the router's count, checked first by name
    _mutant("events_never_collapse", events_never_collapse, MACHINE,
            "pending_events_within_bound"),
]
