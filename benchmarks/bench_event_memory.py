"""Memory of a block pool whose KV-event consumer stalls, with and without a bound.

A 20,000-block pool with prefix caching and KV events on; nobody calls ``take_events``. Each
request keys 8 fresh blocks of 16 tokens and, once the pool has wrapped, evicts 8 cached ones:
one 128-token ``BlockStored`` and 8 ``BlockRemoved`` per request. Without a bound every event
waits (vLLM's behaviour); with ``max_pending_kv_events`` the pending events collapse into a
snapshot of the cache (docs/bounded-events.md). Printed four times a run: pending events,
collapses, resident memory above the empty pool's, seconds.

Run: ``python -m benchmarks.bench_event_memory [--bound N|none] [--requests N]``; each bound
runs in its own process so that one run's memory does not hide another's. impl/ alone: vLLM
has no bound to compare with.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

BLOCK_SIZE, NUM_BLOCKS, BLOCKS_PER_REQUEST = 16, 20_000, 8


@dataclass
class _Request:
    """What the pool reads of a request to key its blocks and build their event."""

    block_hashes: list[bytes]
    all_token_ids: list[int]
    lora_request: object = field(default=None)


def _rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def soak(bound: int | None, num_requests: int) -> None:
    """One run in this process, printing a line at each quarter."""
    from kvspec.impl.block_pool import BlockPool

    pool = BlockPool(NUM_BLOCKS, True, BLOCK_SIZE, True, max_pending_kv_events=bound)
    start_rss = _rss_mib()
    start = time.perf_counter()
    token = 10**6
    for index in range(num_requests):
        hashes = [hashlib.blake2b(f"{index}:{j}".encode(), digest_size=32).digest()
                  for j in range(BLOCKS_PER_REQUEST)]
        tokens = list(range(token, token + BLOCK_SIZE * BLOCKS_PER_REQUEST))
        token += BLOCK_SIZE * BLOCKS_PER_REQUEST
        blocks = pool.get_new_blocks(BLOCKS_PER_REQUEST)
        pool.cache_full_blocks(_Request(hashes, tokens), blocks, 0, BLOCKS_PER_REQUEST,
                               BLOCK_SIZE, 0)
        pool.free_blocks(reversed(blocks))
        if (index + 1) % max(1, num_requests // 4) == 0:
            print(f"bound {bound!s:>7}  requests {index + 1:>9,}  pending "
                  f"{len(pool.kv_event_queue):>10,}  collapses {pool.num_kv_event_collapses:>5}"
                  f"  RSS +{_rss_mib() - start_rss:8.1f} MiB  {time.perf_counter() - start:6.1f} s",
                  flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bound", action="append",
                        help="max_pending_kv_events, or 'none' (default: none and 10000)")
    parser.add_argument("--requests", type=int, default=200_000)
    parser.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    bounds = args.bound or ["none", "10000"]
    if args.in_process:
        [text] = bounds
        soak(None if text == "none" else int(text), args.requests)
        return 0
    for text in bounds:
        subprocess.run([sys.executable, "-m", "benchmarks.bench_event_memory", "--in-process",
                        "--bound", text, "--requests", str(args.requests)],
                       cwd=Path(__file__).resolve().parent.parent, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
