"""Soak: millions of block operations on a 1M-block pool, watching memory and speed over time.

A leak (keys, events, stale queue entries or request state that outlive their blocks) shows as
memory that keeps growing from interval to interval; a slowdown (a structure that degrades,
such as a free queue filling with stale entries) shows as operations per second that keep
falling. Steady state is the finding: flat memory after the first interval, flat speed.

Shape, on a pool of 1,000,000 blocks (block size 16, prefix caching and KV events on, the
events drained every 100 requests as a serving engine drains them every step):

* requests over 1,000 Zipf-popular prefixes of 64 blocks plus 1..64 blocks of their own;
* each request looks up its cached prefix, touches the hits, allocates the rest and caches
  every new block (**allocate, cache, hit**);
* requests run until the pool is 90% full, then the oldest is freed, tail block first (**free
  reversed**); every 16 requests a KV connector evicts 32 random block ids (**evict**);
* at the end of each interval every request is freed and the prefix cache is reset
  (**reset**, as after a weight update).

The same shape runs through `KVCacheManager` (``get_computed_blocks``, ``allocate_slots``,
``free``, ``evict_blocks``, ``reset_prefix_cache``, ``take_events``), with real requests and
sha256 block hashes. Block operations count blocks: allocated, cached, hit, freed, and ids
handed to ``evict_blocks``.

Memory is read after each interval's reset: resident set size (``/proc/self/statm``) and
the Python heap traced by ``tracemalloc`` (current, and the peak during the interval).
Tracing slows allocation-heavy Python code, so the operations per second are lower than an
untraced run's (``--no-trace``); compare them with each other.

Run: ``python -m benchmarks.bench_soak [--quick] [--only pool|manager] [--no-trace]``, or
``python -m benchmarks.run --only soak``. Not in the default benchmark run: the full soak
takes minutes (docs/benchmarks.md, the soak).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import resource
import sys
import time
import tracemalloc
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

BLOCK_SIZE = 16
NUM_BLOCKS = 1_000_000
TOTAL_OPS = 10_000_000
INTERVALS = 10
NUM_PREFIXES = 1_000
PREFIX_BLOCKS = 64
MAX_OWN_BLOCKS = 64
FULL = 0.9  # requests run until the pool is this full
EVICT_EVERY, EVICT_IDS = 16, 32
DRAIN_EVERY = 100  # requests between two take_events
VOCAB = 32_000


def rss_bytes() -> int:
    """The resident set size now (Linux), or the peak so far where /proc is missing."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass
class Interval:
    """One interval of a soak: its operations and time, and memory after its reset."""

    ops: int
    seconds: float
    rss: int
    traced: int | None  # tracemalloc's current size, None when not tracing
    traced_peak: int | None  # tracemalloc's peak during the interval

    @property
    def ops_per_second(self) -> float:
        return self.ops / self.seconds


@dataclass
class Soak:
    """A soak's result: memory before the first operation, then one entry per interval."""

    name: str
    start_rss: int
    start_traced: int | None
    intervals: list[Interval] = field(default_factory=list)
    hit_blocks: int = 0
    requests: int = 0

    @property
    def ops(self) -> int:
        return sum(interval.ops for interval in self.intervals)

    @property
    def seconds(self) -> float:
        return sum(interval.seconds for interval in self.intervals)


class Counter:
    """Block operations so far, by kind."""

    def __init__(self) -> None:
        self.allocated = self.cached = self.hit = self.freed = self.evicted = 0
        self.held = 0  # blocks running requests hold: the frees still to come

    @property
    def total(self) -> int:
        return self.allocated + self.cached + self.hit + self.freed + self.evicted


def _measure(name: str, total_ops: int, intervals: int, trace: bool,
             build: Callable[[], Any],
             work: Callable[[Any, Counter, int], Iterator[None]],
             reset: Callable[[Any, Counter], None]) -> Soak:
    """Build the subject, then run ``work`` in intervals of ``total_ops / intervals`` block
    operations, the frees of the ``reset`` that ends each interval included; ``work``
    yields after each request."""
    gc.collect()
    if trace:
        tracemalloc.start()
    try:
        subject = build()
        gc.collect()
        soak = Soak(name, rss_bytes(), tracemalloc.get_traced_memory()[0] if trace else None)
        counter = Counter()
        steps = work(subject, counter, total_ops)
        per_interval = total_ops // intervals
        for _ in range(intervals):
            if trace:
                tracemalloc.reset_peak()
            before = counter.total
            start = time.perf_counter()
            while counter.total + counter.held < before + per_interval:  # frees to come count
                next(steps)
            reset(subject, counter)
            seconds = time.perf_counter() - start
            gc.collect()
            traced, peak = tracemalloc.get_traced_memory() if trace else (None, None)
            soak.intervals.append(Interval(counter.total - before, seconds, rss_bytes(),
                                           traced, peak))
        soak.hit_blocks = counter.hit
        return soak
    finally:
        if trace:
            tracemalloc.stop()


# --- the request stream ------------------------------------------------------------------------


class Stream:
    """Requests as (prefix, own blocks): Zipf-popular prefixes, own lengths 1..64 blocks."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        weights = [1.0 / (rank + 1) for rank in range(NUM_PREFIXES)]  # Zipf, s = 1
        self.prefixes = self.rng.choices(range(NUM_PREFIXES), weights=weights, k=100_000)
        self.position = 0

    def next(self) -> tuple[int, int]:
        prefix = self.prefixes[self.position % len(self.prefixes)]
        self.position += 1
        return prefix, self.rng.randint(1, MAX_OWN_BLOCKS)


# --- BlockPool ---------------------------------------------------------------------------------


@dataclass
class _PoolRequest:
    """What BlockPool.cache_full_blocks reads from a request."""

    block_hashes: list[bytes]
    all_token_ids: list[int]
    lora_request: None = None
    blocks: list[Any] = field(default_factory=list)


def pool_soak(num_blocks: int = NUM_BLOCKS, total_ops: int = TOTAL_OPS,
              intervals: int = INTERVALS, trace: bool = True) -> Soak:
    from kvspec.impl.block_pool import BlockPool

    # Prefix block hashes are fixed (so that prefixes hit); a request's own blocks get fresh
    # ones. Token ids only feed the BlockStored events: one shared list is long enough.
    prefix_hashes = [[(p * PREFIX_BLOCKS + i).to_bytes(32, "little") for i in
                      range(PREFIX_BLOCKS)] for p in range(NUM_PREFIXES)]
    tokens = [1] * ((PREFIX_BLOCKS + MAX_OWN_BLOCKS) * BLOCK_SIZE)
    running: deque[_PoolRequest] = deque()

    def build() -> Any:
        return BlockPool(num_blocks, True, BLOCK_SIZE, enable_kv_cache_events=True)

    def free_oldest(pool: Any, counter: Counter) -> None:
        request = running.popleft()
        pool.free_blocks(reversed(request.blocks))
        counter.held -= len(request.blocks)
        counter.freed += len(request.blocks)

    def work(pool: Any, counter: Counter, total_ops: int) -> Iterator[None]:
        stream, rng = Stream(), random.Random(1)
        next_own = NUM_PREFIXES * PREFIX_BLOCKS
        limit = int(FULL * (num_blocks - 1))
        for number in range(1 << 62):
            prefix, own = stream.next()
            hashes = prefix_hashes[prefix] + [(next_own + i).to_bytes(32, "little")
                                              for i in range(own)]
            next_own += own
            request = _PoolRequest(hashes, tokens)
            hits = pool.get_cached_prefix(hashes, 0, PREFIX_BLOCKS)
            if hits:
                pool.touch((hits,))
                counter.hit += len(hits)
            while counter.held + len(hashes) > limit:
                free_oldest(pool, counter)
            new = pool.get_new_blocks(len(hashes) - len(hits))
            request.blocks = hits + new
            pool.cache_full_blocks(request, request.blocks, len(hits), len(hashes),
                                   BLOCK_SIZE, 0)
            counter.allocated += len(new)
            counter.cached += len(new)
            running.append(request)
            counter.held += len(hashes)
            if number % EVICT_EVERY == 0:
                pool.evict_blocks({rng.randrange(1, num_blocks) for _ in range(EVICT_IDS)})
                counter.evicted += EVICT_IDS
            if number % DRAIN_EVERY == 0:
                pool.take_events()
            yield

    def reset(pool: Any, counter: Counter) -> None:
        while running:
            free_oldest(pool, counter)
        if not pool.reset_prefix_cache():
            raise AssertionError("reset_prefix_cache refused with every request freed")
        pool.take_events()

    return _measure("BlockPool", total_ops, intervals, trace, build, work, reset)


# --- KVCacheManager ----------------------------------------------------------------------------


def manager_soak(num_blocks: int = NUM_BLOCKS, total_ops: int = TOTAL_OPS,
                 intervals: int = INTERVALS, trace: bool = True) -> Soak:
    from kvspec.impl.hashing import get_request_block_hasher, sha256
    from kvspec.impl.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )
    from kvspec.impl.kv_cache_manager import KVCacheManager
    from kvspec.impl.request import Request

    rng = random.Random(2)
    prefix_tokens = [[rng.randrange(VOCAB) for _ in range(PREFIX_BLOCKS * BLOCK_SIZE)]
                     for _ in range(NUM_PREFIXES)]
    hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
    running: deque[tuple[Any, int]] = deque()  # (request, blocks it holds)

    def build() -> Any:
        spec = FullAttentionSpec(BLOCK_SIZE, 8, 128, "bfloat16")
        config = KVCacheConfig(
            num_blocks, (KVCacheTensor(spec.page_size_bytes * num_blocks, ("layer.0",)),),
            (KVCacheGroupSpec(("layer.0",), spec),))
        return KVCacheManager(config, max_model_len=(PREFIX_BLOCKS + MAX_OWN_BLOCKS + 1)
                              * BLOCK_SIZE, hash_block_size=BLOCK_SIZE,
                              enable_kv_cache_events=True)

    def free_oldest(manager: Any, counter: Counter) -> None:
        request, blocks = running.popleft()
        manager.free(request)
        counter.held -= blocks
        counter.freed += blocks

    def work(manager: Any, counter: Counter, total_ops: int) -> Iterator[None]:
        stream, evict_rng = Stream(), random.Random(3)
        next_token = VOCAB
        limit = int(FULL * (num_blocks - 1))
        for number in range(1 << 62):
            prefix, own = stream.next()
            # Own tokens never repeat, so a request's own blocks never hit.
            prompt = prefix_tokens[prefix] + list(range(next_token,
                                                        next_token + own * BLOCK_SIZE))
            next_token += own * BLOCK_SIZE
            request = Request(f"r{number}", prompt, block_hasher=hasher)
            hits, num_hit_tokens = manager.get_computed_blocks(request)
            num_hits = len(hits.blocks[0])
            needed = len(prompt) // BLOCK_SIZE
            while counter.held + needed > limit:
                free_oldest(manager, counter)
            new = manager.allocate_slots(request, len(prompt) - num_hit_tokens,
                                         num_hit_tokens, hits)
            while new is None:  # the pool is short after all: free more
                free_oldest(manager, counter)
                new = manager.allocate_slots(request, len(prompt) - num_hit_tokens,
                                             num_hit_tokens, hits)
            request.num_computed_tokens = len(prompt)
            counter.hit += num_hits
            counter.allocated += len(new.blocks[0])
            counter.cached += len(new.blocks[0])  # every block is full: all are cached
            running.append((request, needed))
            counter.held += needed
            if number % EVICT_EVERY == 0:
                manager.evict_blocks({evict_rng.randrange(1, num_blocks)
                                      for _ in range(EVICT_IDS)})
                counter.evicted += EVICT_IDS
            if number % DRAIN_EVERY == 0:
                manager.take_events()
            yield

    def reset(manager: Any, counter: Counter) -> None:
        while running:
            free_oldest(manager, counter)
        if not manager.reset_prefix_cache():
            raise AssertionError("reset_prefix_cache refused with every request freed")
        manager.take_events()

    return _measure("KVCacheManager", total_ops, intervals, trace, build, work, reset)


# --- Reporting ---------------------------------------------------------------------------------

SOAKS: dict[str, Callable[..., Soak]] = {"pool": pool_soak, "manager": manager_soak}


def _mb(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:,.1f}"


def report(soak: Soak) -> str:
    """The soak as a table: memory at the start, after each interval, ops/s per interval."""
    lines = [f"soak, {soak.name}: {soak.ops:,} block operations in {soak.seconds:.1f} s "
             f"({soak.ops / soak.seconds / 1e6:.2f} M/s overall)",
             f"  {'interval':>8} {'block ops':>11} {'seconds':>8} {'M ops/s':>8} "
             f"{'RSS MB':>8} {'traced MB':>10} {'peak MB':>8}",
             f"  {'start':>8} {'':>11} {'':>8} {'':>8} {_mb(soak.start_rss):>8} "
             f"{_mb(soak.start_traced):>10} {'':>8}"]
    for number, interval in enumerate(soak.intervals, 1):
        lines.append(f"  {number:>8} {interval.ops:>11,} {interval.seconds:>8.2f} "
                     f"{interval.ops_per_second / 1e6:>8.2f} {_mb(interval.rss):>8} "
                     f"{_mb(interval.traced):>10} {_mb(interval.traced_peak):>8}")
    return "\n".join(lines)


def rows(soak: Soak) -> list[dict[str, Any]]:
    """Rows for benchmarks.run: start, middle and end memory; first, middle, last speed."""
    middle = soak.intervals[(len(soak.intervals) - 1) // 2]
    first, last = soak.intervals[0], soak.intervals[-1]
    name = f"soak {soak.name}"
    out: list[dict[str, Any]] = []

    def row(workload: str, unit: str, value: float | None) -> None:
        out.append({"workload": f"{name}: {workload}", "unit": unit, "impl": value,
                    "vllm": None, "speedup": None})

    row("block ops, first interval", "M ops/s", first.ops_per_second / 1e6)
    row("block ops, middle interval", "M ops/s", middle.ops_per_second / 1e6)
    row("block ops, last interval", "M ops/s", last.ops_per_second / 1e6)
    for label, rss, traced in (("start", soak.start_rss, soak.start_traced),
                               ("middle", middle.rss, middle.traced),
                               ("end", last.rss, last.traced)):
        row(f"RSS at the {label}", "MB", rss / 2**20)
        row(f"traced heap at the {label}", "MB", None if traced is None else traced / 2**20)
    return out


def run(quick: bool = False, only: tuple[str, ...] = ("pool", "manager"),
        trace: bool = True) -> list[dict[str, Any]]:
    """The soaks for benchmarks.run (quick: 100,000 blocks, 1M operations)."""
    out = []
    for name in only:
        if quick:
            soak = SOAKS[name](num_blocks=100_000, total_ops=1_000_000, trace=trace)
        else:
            soak = SOAKS[name](trace=trace)
        print(report(soak), file=sys.stderr, flush=True)
        out.extend(rows(soak))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="100,000 blocks and 1M operations instead of 1M and 10M")
    parser.add_argument("--only", choices=sorted(SOAKS), help="one soak (default: both)")
    parser.add_argument("--no-trace", action="store_true",
                        help="no tracemalloc: faster, but no traced heap figures")
    args = parser.parse_args(argv)
    from kvspec import impl

    print(f"python {sys.version.split()[0]}; impl/ "
          f"{'compiled with mypyc' if impl.COMPILED else 'pure Python'}")
    for name in (args.only,) if args.only else tuple(SOAKS):
        if args.quick:
            soak = SOAKS[name](num_blocks=100_000, total_ops=1_000_000,
                               trace=not args.no_trace)
        else:
            soak = SOAKS[name](trace=not args.no_trace)
        print(report(soak), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
