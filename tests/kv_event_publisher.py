"""kvspec's KV events from a workload, published as vLLM's ``ZmqEventPublisher`` does.

``workload_batches`` runs kvspec's ``KVCacheManager`` (events on) over requests that share
prefixes, in a pool small enough to evict, with a prefix-cache reset part way: each step's
``take_events()`` is one ``KVEventBatch``, encoded by msgspec as vLLM 0.13 encodes it.
``as_033`` re-encodes a batch as vLLM 0.33 does (map-encoded events, ``spec.events``).

``python -m tests.kv_event_publisher --endpoint EP --replay-endpoint EP`` publishes them:
``[topic, seq as 8 bytes big-endian, payload]`` per batch on an XPUB socket (a PUB that can
see its subscriber, so the first batch is not lost to ZMQ's slow joiner), and answers replay
requests on a ROUTER socket as vLLM 0.13 does. It waits for a subscriber, publishes, then
answers replays until its stdin closes. ``--fault`` plants one stream fault:
``drop:K`` (seq K is not sent live, but is replayable), ``dup:K`` (seq K is sent twice),
``replay-differs:K`` (the replay buffer holds another payload for K).
"""

from __future__ import annotations

import argparse
import select
import sys
import time
from dataclasses import replace
from typing import Any, cast

import msgspec

from kvspec.impl.hashing import get_request_block_hasher, sha256
from kvspec.impl.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from kvspec.impl.kv_cache_manager import KVCacheManager
from kvspec.impl.kv_events import KVEventBatch
from kvspec.impl.request import Request
from kvspec.spec.events import WireRemoved, WireStored, decode_batch, encode_batch
from kvspec.spec.pool import Profile

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def workload_batches(steps: int = 60, seed: int = 0) -> list[bytes]:
    """One encoded KVEventBatch per step that had events."""
    spec = FullAttentionSpec(4, 1, 8, "float16")
    config = KVCacheConfig(24, (KVCacheTensor(24 * spec.page_size_bytes, ("l0",)),),
                           (KVCacheGroupSpec(("l0",), spec),))
    manager = KVCacheManager(config, 64, 4, enable_kv_cache_events=True)
    hasher = get_request_block_hasher(4, sha256)
    encoder = msgspec.msgpack.Encoder()
    batches: list[bytes] = []
    running: list[Request] = []
    for step in range(steps):
        index = step * 7 + seed
        prompt = [index % 5] * 8 + list(range(index, index + 4 + index % 9))
        request = Request(str(step), prompt, block_hasher=hasher)
        hits, num_hits = manager.get_computed_blocks(request)
        if manager.allocate_slots(request, request.num_tokens - num_hits, num_hits,
                                  hits) is not None:
            running.append(request)
        if len(running) > 2 or step % 4 == 0 or step == steps // 2:
            while running:
                manager.free(running.pop(0))
        if step == steps // 2:
            manager.reset_prefix_cache()
        events = manager.take_events()
        if events:
            batches.append(encoder.encode(KVEventBatch(ts=float(step),
                                                       events=cast(Any, events))))
    return batches


def as_033(payload: bytes, group_idx: int = 0) -> bytes:
    """The batch as vLLM 0.33 writes it: map-encoded events, each naming its group."""
    ts, events, rank = decode_batch(payload)
    moved = [replace(e, group_idx=group_idx) if isinstance(e, WireStored | WireRemoved) else e
             for e in events]
    return encode_batch(ts, moved, rank, Profile.V0_33)


def publish(endpoint: str, replay_endpoint: str | None, batches: list[bytes], topic: str,
            fault: str | None, wait_subscriber: float = 300.0) -> None:
    """Publish ``batches`` once a subscriber has come (a checker in a fresh Python, slow to
    start on a loaded machine: waited for up to ``wait_subscriber`` seconds, a hard cap, or
    until stdin closes), then answer replays until stdin closes."""
    import zmq

    kind, _, at = (fault or "").partition(":")
    fault_seq = int(at) if at else -1
    ctx: Any = zmq.Context.instance()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(endpoint)
    router: Any = None
    if replay_endpoint is not None:
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(replay_endpoint)
    print("ready", flush=True)
    waited_until = time.monotonic() + wait_subscriber
    while time.monotonic() < waited_until and not _stdin_closed():
        if pub.poll(100):
            pub.recv()  # the subscription
            break
    buffer: list[tuple[int, bytes]] = []
    for seq, payload in enumerate(batches):
        frames = [topic.encode(), seq.to_bytes(8, "big"), payload]
        if not (kind == "drop" and seq == fault_seq):
            pub.send_multipart(frames)
        if kind == "dup" and seq == fault_seq:
            pub.send_multipart(frames)
        stored = payload + b"\x90" if kind == "replay-differs" and seq == fault_seq else payload
        buffer.append((seq, stored))
        _serve_replay(router, buffer, 0.005)
    # Answer replays until the test closes stdin (or five minutes pass: never linger for ever).
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        _serve_replay(router, buffer, 0.05)
        if _stdin_closed():
            break
    pub.close()
    if router is not None:
        router.close()


def _stdin_closed() -> bool:
    """Whether the test has closed our stdin (it writes nothing else to it)."""
    return bool(select.select([sys.stdin], [], [], 0)[0]) and not sys.stdin.read(1)


def _serve_replay(router: Any, buffer: list[tuple[int, bytes]], wait: float) -> None:
    """Answer waiting replay requests as vLLM 0.13 does: [id, b"", seq, payload]..., end."""
    if router is None:
        time.sleep(wait)
        return
    while router.poll(int(wait * 1000)):
        client, _, start = router.recv_multipart()
        first = int.from_bytes(start, "big")
        for seq, payload in buffer:
            if seq >= first:
                router.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
        router.send_multipart([client, b"", END_SEQ, b""])
        wait = 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--replay-endpoint")
    parser.add_argument("--topic", default="kv")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--encoding", choices=("0.13", "0.33"), default="0.13")
    parser.add_argument("--fault")
    args = parser.parse_args(argv)
    batches = workload_batches(args.steps)
    if args.encoding == "0.33":
        batches = [as_033(b) for b in batches]
    publish(args.endpoint, args.replay_endpoint, batches, args.topic, args.fault)
    return 0


if __name__ == "__main__":
    sys.exit(main())
