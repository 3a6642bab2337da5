"""Workload c1 (docs/benchmarks.md): the prefix-caching workload through the KVCacheManager.

10,000 requests over 1,000 distinct prefixes of 32 blocks (Zipf s=1 popularity), each with
1..128 random suffix tokens; block size 16; an 8,192-block pool; at most 32 requests
running. Each request is admitted with ``get_computed_blocks`` then ``allocate_slots`` for
its whole prompt; when 32 are running, or when ``allocate_slots`` says the pool is too small,
the oldest running request is freed (``free``) first. Requests (and their block hashes) are
built before the clock starts: only the three manager calls are timed.

kvspec's ``impl.kv_cache_manager.KVCacheManager`` and, when ``import vllm`` works in this
interpreter (``VLLM_TARGET_DEVICE=cpu``), vLLM's own, on identical requests in one process,
alternating, best of several repetitions. Both must see the same hits.

``blocks/s`` counts the blocks each request holds once admitted (cache hits plus new
blocks) per second of manager time. ``ratio`` = kvspec blocks/s / vLLM blocks/s.

Run: ``python -m benchmarks.bench_manager [--quick]`` from the repo root, or, for the side by
side run, ``PYTHONPATH=. .venv-vllm-0.13.0/bin/python -m benchmarks.bench_manager``.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

BLOCK_SIZE = 16
NUM_BLOCKS = 8192
NUM_PREFIXES = 1000
PREFIX_BLOCKS = 32
MAX_RUNNING = 32
MAX_MODEL_LEN = 1024
VOCAB = 32000


def make_prompts(num_requests: int, seed: int = 0) -> list[list[int]]:
    """The prompts of workload c1: a Zipf-popular prefix plus 1..128 random tokens."""
    rng = np.random.default_rng(seed)
    prefixes = rng.integers(0, VOCAB, size=(NUM_PREFIXES, PREFIX_BLOCKS * BLOCK_SIZE))
    weights = 1.0 / np.arange(1, NUM_PREFIXES + 1)
    choices = rng.choice(NUM_PREFIXES, size=num_requests, p=weights / weights.sum())
    suffix_lengths = rng.integers(1, 129, size=num_requests)
    return [
        prefixes[c].tolist() + rng.integers(0, VOCAB, size=int(n)).tolist()
        for c, n in zip(choices, suffix_lengths, strict=True)
    ]


class Side:
    """One implementation's manager factory and request factory."""

    def __init__(self, name: str, make_manager: Callable[[], Any],
                 make_requests: Callable[[list[list[int]]], list[Any]]) -> None:
        self.name = name
        self.make_manager = make_manager
        self.make_requests = make_requests


def impl_side() -> Side:
    from kvspec.impl.hashing import get_request_block_hasher, sha256
    from kvspec.impl.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )
    from kvspec.impl.kv_cache_manager import KVCacheManager, Request

    def make_manager() -> Any:
        spec = FullAttentionSpec(BLOCK_SIZE, 8, 128, "bfloat16")
        config = KVCacheConfig(
            NUM_BLOCKS, (KVCacheTensor(spec.page_size_bytes * NUM_BLOCKS, ("layer.0",)),),
            (KVCacheGroupSpec(("layer.0",), spec),),
        )
        return KVCacheManager(config, max_model_len=MAX_MODEL_LEN, hash_block_size=BLOCK_SIZE)

    def make_requests(prompts: list[list[int]]) -> list[Any]:
        hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
        return [Request(f"r{i}", p, block_hasher=hasher) for i, p in enumerate(prompts)]

    return Side("kvspec", make_manager, make_requests)


def vllm_side(num_blocks: int = NUM_BLOCKS, max_model_len: int = MAX_MODEL_LEN) -> Side | None:
    """vLLM's KVCacheManager (of num_blocks blocks of BLOCK_SIZE tokens, one full-attention
    group), or None when vLLM does not import here."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    try:
        import torch
        from vllm import SamplingParams
        from vllm.utils.hashing import sha256 as vllm_sha256
        from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            KVCacheTensor,
        )
        from vllm.v1.request import Request as VllmRequest
    except Exception:  # vLLM absent or half-installed: measure kvspec alone
        return None
    init_none_hash(vllm_sha256)

    def make_manager() -> Any:
        spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=8, head_size=128,
                                 dtype=torch.bfloat16)
        config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[KVCacheTensor(spec.page_size_bytes * num_blocks, ["layer.0"])],
            kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
        )
        return VllmManager(config, max_model_len=max_model_len, hash_block_size=BLOCK_SIZE)

    def make_requests(prompts: list[list[int]]) -> list[Any]:
        hasher = get_request_block_hasher(BLOCK_SIZE, vllm_sha256)
        params = SamplingParams(max_tokens=1)
        return [VllmRequest(f"r{i}", p, params, None, None, block_hasher=hasher)
                for i, p in enumerate(prompts)]

    return Side("vllm", make_manager, make_requests)


def run_workload(manager: Any, requests: list[Any]) -> tuple[float, int, int, int]:
    """Seconds in manager calls, blocks held once admitted, hit tokens, prompt tokens."""
    running: deque[Any] = deque()
    get_computed_blocks = manager.get_computed_blocks
    allocate_slots = manager.allocate_slots
    free = manager.free
    perf_counter = time.perf_counter
    blocks_total = hit_tokens = prompt_tokens = 0
    elapsed = 0.0
    for request in requests:
        start = perf_counter()
        if len(running) >= MAX_RUNNING:
            free(running.popleft())
        hits, num_hit = get_computed_blocks(request)
        num_tokens = request.num_tokens
        new = allocate_slots(request, num_tokens - num_hit, num_hit, hits)
        while new is None:
            free(running.popleft())
            new = allocate_slots(request, num_tokens - num_hit, num_hit, hits)
        elapsed += perf_counter() - start
        running.append(request)
        blocks_total += len(hits.blocks[0]) + len(new.blocks[0])
        hit_tokens += num_hit
        prompt_tokens += num_tokens
    start = perf_counter()
    while running:
        free(running.popleft())
    elapsed += perf_counter() - start
    return elapsed, blocks_total, hit_tokens, prompt_tokens


def run(quick: bool = False) -> list[dict[str, Any]]:
    """Workload c1 for kvspec and, when importable, vLLM: one row per implementation."""
    num_requests = 2000 if quick else 10_000
    repeats = 2 if quick else 5
    prompts = make_prompts(num_requests)
    sides = [impl_side()]
    other = vllm_side()
    if other is not None:
        sides.append(other)
    best: dict[str, float] = {}
    stats: dict[str, tuple[int, int, int]] = {}
    for _ in range(repeats):
        for side in sides:
            manager = side.make_manager()
            requests = side.make_requests(prompts)
            gc.collect()
            seconds, blocks, hits, tokens = run_workload(manager, requests)
            best[side.name] = min(best.get(side.name, float("inf")), seconds)
            stats[side.name] = (blocks, hits, tokens)
    if len(stats) == 2 and stats["kvspec"] != stats["vllm"]:
        raise AssertionError(f"kvspec and vLLM saw different hits: {stats}")
    blocks, hits, tokens = stats["kvspec"]
    rows = []
    impl_rate = blocks / best["kvspec"]
    vllm_rate = blocks / best["vllm"] if "vllm" in best else None
    for side in sides:
        rate = blocks / best[side.name]
        rows.append({
            "workload": "c1. prefix workload, KVCacheManager",
            "implementation": side.name,
            "requests": num_requests,
            "seconds": round(best[side.name], 4),
            "blocks_per_s": round(rate),
            "token_hit_rate": round(hits / tokens, 3),
            "ratio": None if vllm_rate is None else round(impl_rate / vllm_rate, 3),
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2,000 requests, 2 repetitions")
    args = parser.parse_args(argv)
    rows = run(quick=args.quick)
    print(f"{'implementation':15s} {'requests':>9s} {'seconds':>9s} {'blocks/s':>12s} "
          f"{'hit rate':>9s} {'kvspec/vLLM':>12s}")
    for row in rows:
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}x"
        print(f"{row['implementation']:15s} {row['requests']:9d} {row['seconds']:9.3f} "
              f"{row['blocks_per_s']:12,d} {row['token_hit_rate']:9.3f} {ratio:>12s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
