"""Eviction policies on multi-turn, agent-like traces: token hit rate and blocks/s per policy.

Two traces, built before the clock starts, each served one request at a time through the
whole ``KVCacheManager`` (``get_computed_blocks``, ``allocate_slots`` for the prompt,
``free`` of the oldest when ``MAX_RUNNING`` run or the pool is short), with the clock
(``advance_clock``) at the request's index:

- ``agent``: 4 agents, each with a 64-block system prompt (tools included); 48 long
  conversations (6 to 10 turns; a turn adds 48 to 128 tokens of tool output and the previous
  answer) that come back after a pause of 20 to 120 requests, during which one-off requests
  (unique 384- to 768-token documents, 45% of the traffic) stream through.
- ``chat``: one 8-block system prompt; 300 users whose chats (2 to 8 turns of 16 to 64
  tokens) resume after a heavy-tailed think time (Pareto); one-off retrieval requests with
  unique 256- to 512-token contexts (35% of the traffic).

The pool (block size 16) holds a fraction of the working set, so the policy decides what
survives a pause. Hints, as an agent framework would give them:

- ``priority``: system prompt priority 90 (no expiry); a conversation's history 60 for 150
  requests (about its expected return); a one-off request 10 (it will not come back).
- ``pinned``: each system prompt is pinned once cached (cap: a quarter of the pool).
- ``lru`` (vLLM 0.13) and ``lru-lifo-unhashed`` (vLLM 0.33) read no hints.

``hit rate`` = prompt tokens found cached / prompt tokens. ``blocks/s`` = blocks each request
holds once admitted, per second of manager time (best of the repetitions). vLLM 0.13's own
manager runs the ``lru`` row side by side when ``import vllm`` works (its hit rate must equal
kvspec's ``lru``).

Run: ``python -m benchmarks.bench_policies [--quick]``, or, side by side with vLLM,
``PYTHONPATH=. .venv-vllm-0.13.0/bin/python -m benchmarks.bench_policies``.
"""

from __future__ import annotations

import argparse
import functools
import gc
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import bench_manager

BLOCK_SIZE = bench_manager.BLOCK_SIZE  # vLLM's side is bench_manager's
MAX_RUNNING = 8
MAX_MODEL_LEN = 4096
VOCAB = 32000
POLICIES = ("lru", "lru-lifo-unhashed", "priority", "pinned")


@dataclass
class TraceRequest:
    prompt: list[int]
    system_len: int  # tokens of shared system prompt at its head
    one_off: bool


@dataclass
class Trace:
    name: str
    num_blocks: int
    requests: list[TraceRequest] = field(default_factory=list)


@dataclass
class _Conversation:
    system: int  # which system prompt
    left: int  # turns left
    due: int  # when its next turn arrives
    history: list[int] = field(default_factory=list)


def _tokens(rng: np.random.Generator, n: int) -> list[int]:
    return [int(t) for t in rng.integers(0, VOCAB, size=n)]


def make_trace(name: str, quick: bool = False, seed: int = 0) -> Trace:
    """The ``agent`` or ``chat`` trace (module docstring)."""
    rng = np.random.default_rng(seed)
    scale = 4 if quick else 1
    if name == "agent":
        systems = [_tokens(rng, 64 * BLOCK_SIZE) for _ in range(4)]
        num_convs, turns, pause, one_off_share = 48 // scale, (6, 11), (20, 121), 0.45
        one_off_len, turn_len, num_blocks = (384, 769), (48, 129), 1200 // scale
    else:
        systems = [_tokens(rng, 8 * BLOCK_SIZE)]
        num_convs, turns, pause, one_off_share = 300 // scale, (2, 9), (0, 0), 0.35
        one_off_len, turn_len, num_blocks = (256, 513), (16, 65), 700 // scale
    trace = Trace(name, num_blocks)
    convs = [_Conversation(int(rng.integers(len(systems))), int(rng.integers(*turns)),
                           int(rng.integers(0, 50 * num_convs // 4 + 1)))
             for _ in range(num_convs)]
    now = 0
    while any(c.left for c in convs):
        ready = [c for c in convs if c.left and c.due <= now]
        if ready and rng.random() >= one_off_share:
            conv = ready[int(rng.integers(len(ready)))]
            system = systems[conv.system]
            conv.history += _tokens(rng, int(rng.integers(*turn_len)))
            prompt = (system + conv.history)[-(MAX_MODEL_LEN - 64):]
            trace.requests.append(TraceRequest(prompt, len(system), False))
            conv.history += _tokens(rng, 32)  # the answer, part of the next turn
            conv.left -= 1
            think = (int(rng.integers(*pause)) if name == "agent"
                     else int(10 * rng.pareto(1.2)) + 1)
            conv.due = now + think
        else:
            trace.requests.append(TraceRequest(_tokens(rng, int(rng.integers(*one_off_len))),
                                               0, True))
        now += 1
    return trace


def impl_manager(num_blocks: int, policy: str) -> Any:
    """kvspec's KVCacheManager for the traces: one full-attention group of ``num_blocks``
    blocks, evicting by ``policy`` (a name ``make_policy`` knows)."""
    from kvspec.impl.eviction import make_policy
    from kvspec.impl.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )
    from kvspec.impl.kv_cache_manager import KVCacheManager

    spec = FullAttentionSpec(BLOCK_SIZE, 8, 128, "bfloat16")
    config = KVCacheConfig(
        num_blocks, (KVCacheTensor(spec.page_size_bytes * num_blocks, ("layer.0",)),),
        (KVCacheGroupSpec(("layer.0",), spec),))
    return KVCacheManager(config, max_model_len=MAX_MODEL_LEN, hash_block_size=BLOCK_SIZE,
                          eviction_policy=make_policy(policy))


def impl_requests(trace: Trace, policy: str) -> list[Any]:
    """``trace``'s requests as kvspec's ``Request``, with the retention hints ``policy``
    reads (the priority policy's; none for the others)."""
    from kvspec.impl.eviction import TokenRangeRetention
    from kvspec.impl.hashing import get_request_block_hasher, sha256
    from kvspec.impl.request import Request

    hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
    made = []
    for i, r in enumerate(trace.requests):
        hints: list[Any] = []
        if policy == "priority":
            hints = ([TokenRangeRetention(0, None, 10)] if r.one_off else
                     [TokenRangeRetention(0, r.system_len, 90),
                      TokenRangeRetention(r.system_len, None, 60, 150)])
        made.append(Request(f"r{i}", r.prompt, block_hasher=hasher, kv_retention=hints))
    return made


def serve(manager: Any, requests: list[Any], trace: Trace,
          pin: bool = False) -> tuple[float, int, int, int]:
    """Seconds in manager calls, blocks held once admitted, hit tokens, prompt tokens."""
    running: deque[Any] = deque()
    clock = getattr(manager, "advance_clock", None)
    pinned: set[int] = set()
    blocks_total = hit_tokens = prompt_tokens = 0
    elapsed = 0.0
    perf_counter = time.perf_counter
    for index, (request, info) in enumerate(zip(requests, trace.requests, strict=True)):
        start = perf_counter()
        if clock is not None:
            clock(index)
        if len(running) >= MAX_RUNNING:
            manager.free(running.popleft())
        hits, num_hit = manager.get_computed_blocks(request)
        num_tokens = request.num_tokens
        new = manager.allocate_slots(request, num_tokens - num_hit, num_hit, hits)
        while new is None:
            manager.free(running.popleft())
            new = manager.allocate_slots(request, num_tokens - num_hit, num_hit, hits)
        elapsed += perf_counter() - start
        held = len(hits.blocks[0]) + len(new.blocks[0])
        if pin and info.system_len and info.prompt[0] not in pinned:
            ids = manager.get_block_ids(request.request_id)[0][:info.system_len // BLOCK_SIZE]
            try:
                manager.pin_blocks(ids)
                pinned.add(info.prompt[0])
            except ValueError:
                pass  # over the cap: this system prompt stays unpinned
        running.append(request)
        blocks_total += held
        hit_tokens += num_hit
        prompt_tokens += num_tokens
    start = perf_counter()
    while running:
        manager.free(running.popleft())
    elapsed += perf_counter() - start
    return elapsed, blocks_total, hit_tokens, prompt_tokens


def run(quick: bool = False, traces: tuple[str, ...] = ("agent", "chat"),
        policies: tuple[str, ...] = POLICIES) -> list[dict[str, Any]]:
    repeats = 1 if quick else 3
    rows: list[dict[str, Any]] = []
    for name in traces:
        trace = make_trace(name, quick)
        vllm = bench_manager.vllm_side(trace.num_blocks, MAX_MODEL_LEN)
        sides: list[tuple[str, str, Callable[[], Any], Callable[[], list[Any]]]] = [
            ("kvspec", p, functools.partial(impl_manager, trace.num_blocks, p),
             functools.partial(impl_requests, trace, p)) for p in policies]
        if vllm is not None and "lru" in policies:
            prompts = [r.prompt for r in trace.requests]
            sides.append(("vllm", "lru", vllm.make_manager,
                          functools.partial(vllm.make_requests, prompts)))
        best: dict[tuple[str, str], float] = {}
        stats: dict[tuple[str, str], tuple[int, int, int]] = {}
        for _ in range(repeats):
            for side, policy, make_manager, make_requests in sides:
                manager, requests = make_manager(), make_requests()
                gc.collect()
                seconds, blocks, hits, tokens = serve(manager, requests, trace,
                                                      pin=policy == "pinned")
                key = (side, policy)
                best[key] = min(best.get(key, float("inf")), seconds)
                stats[key] = (blocks, hits, tokens)
        if ("vllm", "lru") in stats and stats[("vllm", "lru")] != stats[("kvspec", "lru")]:
            raise AssertionError(f"kvspec lru and vLLM saw different hits: {stats}")
        base = stats.get(("kvspec", "lru"))
        for (side, policy), (blocks, hits, tokens) in stats.items():
            vllm_seconds = best.get(("vllm", "lru"))
            rows.append({
                "trace": name, "implementation": side, "policy": policy,
                "requests": len(trace.requests), "pool_blocks": trace.num_blocks,
                "token_hit_rate": round(hits / tokens, 4),
                "hit_rate_vs_lru": None if base is None else round(hits / base[1] - 1, 4),
                "blocks_per_s": round(blocks / best[(side, policy)]),
                "speed_vs_vllm_lru": None if vllm_seconds is None else round(
                    (blocks / best[(side, policy)]) / (stats[("vllm", "lru")][0]
                                                       / vllm_seconds), 3),
            })
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="quarter-size traces, one run")
    parser.add_argument("--trace", choices=["agent", "chat", "all"], default="all")
    args = parser.parse_args(argv)
    traces = ("agent", "chat") if args.trace == "all" else (args.trace,)
    rows = run(args.quick, traces)
    print("| trace | implementation | policy | requests | pool blocks | token hit rate | "
          "hits vs lru | blocks/s | speed vs vLLM lru |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        versus = "-" if r["hit_rate_vs_lru"] is None else f"{r['hit_rate_vs_lru']:+.1%}"
        speed = "-" if r["speed_vs_vllm_lru"] is None else f"{r['speed_vs_vllm_lru']:.2f}x"
        print(f"| {r['trace']} | {r['implementation']} | {r['policy']} | {r['requests']} | "
              f"{r['pool_blocks']} | {r['token_hit_rate']:.3f} | {versus} | "
              f"{r['blocks_per_s']:,} | {speed} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
