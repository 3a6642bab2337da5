"""Live KV-event streams: reading vLLM's ``ZmqEventPublisher`` (its PUB socket and its ROUTER
replay socket) for ``kvspec events check --endpoint`` and ``kvspec events capture``.

The frames and their meaning are the checker's (`conformance.events_check`: the framing,
capture files, the report; ``spec.event_stream``: the fold); this module only talks ZMQ.
pyzmq is imported inside the functions that use it (the ``events`` extra), so reading a file
needs none.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvspec.conformance.events_check import (
    CAPTURE_MAGIC,
    END_SEQ,
    CheckResult,
    EventsCheckError,
    frame_record,
    parse_message,
    parse_replay_message,
)
from kvspec.spec.event_stream import (
    Finding,
    Origin,
    Record,
    StreamFold,
    replay_comparable,
    replay_findings,
)

DEFAULT_IDLE_TIMEOUT = 10.0
DEFAULT_REPLAY_TIMEOUT = 5.0


class EndpointError(LookupError):
    """A live endpoint that gave nothing: no batch, or no replay answer, in time."""


@dataclass(frozen=True)
class StopAfter:
    """When a live read stops: N batches, S seconds, or nothing for the idle timeout."""

    batches: int | None = None
    seconds: float | None = None
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT


def _zmq() -> Any:
    try:
        import zmq
    except ImportError:
        raise EventsCheckError("live endpoints need pyzmq (pip install pyzmq)") from None
    return zmq


def request_replay(endpoint: str, start_seq: int, timeout: float,
                   context: Any = None) -> list[tuple[int, bytes]]:
    """Every batch the publisher's replay socket holds from ``start_seq`` on, in order."""
    zmq = _zmq()
    ctx = context or zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(endpoint)
        dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
        batches: list[tuple[int, bytes]] = []
        while True:
            if not dealer.poll(int(timeout * 1000)):
                raise EndpointError(
                    f"replay endpoint {endpoint!r} did not answer a replay from seq "
                    f"{start_seq} within {timeout:g} s ({len(batches)} batches received)")
            parsed = parse_replay_message(dealer.recv_multipart())
            if isinstance(parsed, str):
                raise EndpointError(f"replay endpoint {endpoint!r} sent {parsed}")
            if parsed[0] == END_SEQ:
                return batches
            batches.append(parsed)
    finally:
        dealer.close(linger=0)


def receive(endpoint: str, topic: str, stop: StopAfter) -> Iterator[list[bytes]]:
    """The PUB socket's messages until a stop condition; raises EndpointError when none came."""
    zmq = _zmq()
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
    try:
        try:
            sub.connect(endpoint)
        except zmq.ZMQError as error:
            raise EventsCheckError(f"cannot connect to {endpoint!r}: {error}") from None
        start = last = time.monotonic()
        count = 0
        while stop.batches is None or count < stop.batches:
            now = time.monotonic()
            wait = last + stop.idle_timeout - now
            if stop.seconds is not None:
                wait = min(wait, start + stop.seconds - now)
            if wait <= 0 or not sub.poll(max(1, int(wait * 1000))):
                break
            frames = sub.recv_multipart()
            last = time.monotonic()
            count += 1
            yield frames
        if count == 0:
            waited = time.monotonic() - start
            raise EndpointError(
                f"no batch from {endpoint!r} (topic {topic!r}) in {waited:.1f} s: is the "
                f"publisher running, and the topic right?")
    finally:
        sub.close(linger=0)


def check_live(endpoint: str, topic: str = "", replay_endpoint: str | None = None,
               stop: StopAfter = StopAfter(),
               replay_timeout: float = DEFAULT_REPLAY_TIMEOUT) -> CheckResult:
    """Check a publisher's stream as it comes. With a replay endpoint: a stream joined late is
    replayed from seq 0 first, a gap is filled from replay (and reported all the same), and at
    the end a replay from the first seq must rebuild the live state."""
    fold = StreamFold()
    notes: list[str] = []
    try:
        for frames in receive(endpoint, topic, stop):
            parsed = parse_message(frames)
            if isinstance(parsed, str):
                fold.add(Finding("malformed_message", None, None, None, fold.batches, None,
                                 None, parsed))
                continue
            seq, payload = parsed
            if replay_endpoint is not None:
                _fill(fold, replay_endpoint, seq, replay_timeout, notes)
            fold.feed(Record(seq, payload, Origin.LIVE))
    except KeyboardInterrupt:
        notes.append("interrupted: the report covers what was read")
    if replay_endpoint is not None and fold.first_seq is not None:
        replayed = [Record(s, p, Origin.REPLAY) for s, p in
                    request_replay(replay_endpoint, fold.first_seq, replay_timeout)]
        if replay_comparable(fold, replayed):
            for finding in replay_findings(fold, replayed):
                fold.add(finding)
            notes.append(f"replay from seq {fold.first_seq}: {len(replayed)} batches, "
                         f"compared with the live state")
        else:
            notes.append(f"replay from seq {fold.first_seq} began at "
                         f"{replayed[0].seq if replayed else 'nothing'}: the publisher's "
                         f"buffer no longer holds the start, state not compared")
    return CheckResult(fold.report(), notes)


def _fill(fold: StreamFold, replay_endpoint: str, seq: int, timeout: float,
          notes: list[str]) -> None:
    """Before folding live ``seq``: replay what the fold lacks (from 0 when joined late)."""
    missing = fold.missing_before(seq) if fold.next_seq is not None else range(0, seq)
    if not missing:
        return
    batches = request_replay(replay_endpoint, missing.start, timeout)
    got = [(s, p) for s, p in batches if s in missing]
    for s, p in got:
        fold.feed(Record(s, p, Origin.FILL))
    what = "joined late" if fold.last_live_seq is None else "gap"
    notes.append(f"{what}: replayed seq {missing.start}..{missing.stop - 1} before seq {seq}, "
                 f"{len(got)} of {len(missing)} batches came back")


def capture_live(endpoint: str, topic: str, stop: StopAfter, out: Path) -> int:
    """Write a capture file of a publisher's stream; returns the batches written."""
    written = 0
    with out.open("wb") as sink:
        sink.write(CAPTURE_MAGIC)
        for frames in receive(endpoint, topic, stop):
            parsed = parse_message(frames)
            if isinstance(parsed, str):
                raise EventsCheckError(f"{endpoint!r} sent {parsed}: not vLLM's publisher?")
            sink.write(frame_record(*parsed))
            written += 1
    return written
