"""BlockPool workloads a, b and c2 (docs/benchmarks.md), for any class with vLLM 0.13's API.

The same workload code drives kvspec's impl/ and, when vLLM is importable in this
interpreter, vLLM's BlockPool, alternating runs in one process; figures are best-of-N and
the ratios are what to compare (absolute numbers drift from machine to machine).
"""

from __future__ import annotations

import gc
import hashlib
import random
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

PoolClass = Callable[..., Any]


def construct_seconds(pool_class: PoolClass, num_blocks: int) -> float:
    """Workload a: time to build a caching pool of num_blocks (gc on, as in a server)."""
    start = time.perf_counter()
    pool = pool_class(num_gpu_blocks=num_blocks, enable_caching=True, hash_block_size=16)
    elapsed = time.perf_counter() - start
    del pool
    gc.collect()
    return elapsed


def construct_bytes_per_block(pool_class: PoolClass, num_blocks: int) -> float:
    """Workload a: Python heap the new pool holds, per block (tracemalloc)."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    pool = pool_class(num_gpu_blocks=num_blocks, enable_caching=True, hash_block_size=16)
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del pool
    gc.collect()
    return (after - before) / num_blocks


def alloc_free_blocks_per_second(pool_class: PoolClass, enable_caching: bool,
                                 num_blocks: int = 16_384, num_requests: int = 150_000,
                                 seed: int = 0) -> float:
    """Workload b: get_new_blocks(k), k in 1..64, to ~90% usage; free random live requests
    (reversed) to make room. Blocks allocated (and later freed) per second."""
    rng = random.Random(seed)
    sizes = [rng.randint(1, 64) for _ in range(num_requests)]
    picks = [rng.random() for _ in range(num_requests)]
    pool = pool_class(num_gpu_blocks=num_blocks, enable_caching=enable_caching,
                      hash_block_size=16)
    limit = int(0.9 * (num_blocks - 1))
    live: list[list[Any]] = []
    used = moved = 0
    get_new_blocks, free_blocks = pool.get_new_blocks, pool.free_blocks
    start = time.perf_counter()
    for size, pick in zip(sizes, picks, strict=True):
        while used + size > limit:
            index = int(pick * len(live))
            victim = live[index]
            live[index] = live[-1]
            live.pop()
            free_blocks(reversed(victim))
            used -= len(victim)
        blocks = get_new_blocks(size)
        live.append(blocks)
        used += size
        moved += size
    return moved / (time.perf_counter() - start)


@dataclass
class _Request:
    """What BlockPool.cache_full_blocks reads from a request."""

    block_hashes: list[bytes]
    all_token_ids: list[int]
    lora_request: None = None
    blocks: list[Any] = field(default_factory=list)


@dataclass
class PrefixWorkload:
    """Workload c: requests over Zipf-popular shared prefixes plus random suffixes."""

    requests: list[_Request]

    @classmethod
    def make(cls, num_requests: int = 10_000, num_prefixes: int = 1_000,
             prefix_blocks: int = 32, block_size: int = 16, seed: int = 0) -> PrefixWorkload:
        rng = random.Random(seed)
        weights = [1.0 / (rank + 1) for rank in range(num_prefixes)]  # Zipf, s = 1
        prefixes = []
        for p in range(num_prefixes):
            tokens = [rng.randrange(32_000) for _ in range(prefix_blocks * block_size)]
            prefixes.append((p, tokens))
        chosen = rng.choices(range(num_prefixes), weights=weights, k=num_requests)
        requests = []
        for p in chosen:
            tokens = prefixes[p][1] + [rng.randrange(32_000)
                                       for _ in range(rng.randint(1, 128))]
            hashes, parent = [], b"kvspec-bench"
            for start in range(0, len(tokens) - block_size + 1, block_size):
                parent = hashlib.sha256(
                    parent + repr(tokens[start:start + block_size]).encode()).digest()
                hashes.append(parent)
            requests.append(_Request(hashes, tokens))
        return cls(requests)


def prefix_blocks_per_second(pool_class: PoolClass, workload: PrefixWorkload,
                             num_blocks: int = 8_192, max_running: int = 32,
                             block_size: int = 16) -> tuple[float, float]:
    """Workload c2: drive BlockPool directly as a scheduler would. Returns (blocks per
    second, token hit rate); blocks counts every block a request holds (hits + new)."""
    pool = pool_class(num_gpu_blocks=num_blocks, enable_caching=True,
                      hash_block_size=block_size)
    get_cached_block, touch = pool.get_cached_block, pool.touch
    get_new_blocks, free_blocks = pool.get_new_blocks, pool.free_blocks
    cache_full_blocks, get_num_free_blocks = pool.cache_full_blocks, pool.get_num_free_blocks
    group_ids = [0]
    running: list[_Request] = []
    blocks_total = hit_tokens = all_tokens = 0
    start = time.perf_counter()
    for request in workload.requests:
        num_tokens = len(request.all_token_ids)
        max_hit_blocks = (num_tokens - 1) // block_size
        hits: list[Any] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            found = get_cached_block(block_hash, group_ids)
            if found is None:
                break
            hits.append(found[0])
        needed = -(-num_tokens // block_size) - len(hits)
        if hits:
            touch((hits,))
        while get_num_free_blocks() < needed or len(running) >= max_running:
            finished = running.pop(0)
            free_blocks(reversed(finished.blocks))
        request.blocks = hits + get_new_blocks(needed)
        cache_full_blocks(request, request.blocks, len(hits), num_tokens // block_size,
                          block_size, 0)
        running.append(request)
        blocks_total += len(request.blocks)
        hit_tokens += len(hits) * block_size
        all_tokens += num_tokens
    for finished in running:
        free_blocks(reversed(finished.blocks))
    elapsed = time.perf_counter() - start
    for request in workload.requests:
        request.blocks = []
    return blocks_total / elapsed, hit_tokens / all_tokens


def best(runs: int, measure: Callable[[], float], higher_is_better: bool = True) -> float:
    values = [measure() for _ in range(runs)]
    return max(values) if higher_is_better else min(values)
