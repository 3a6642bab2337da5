"""``kvspec events check`` and ``kvspec events capture``: a KV-event stream a user captured or
is receiving, checked against ``spec.event_stream`` (docs/events-check.md).

What vLLM's ``ZmqEventPublisher`` sends (``vllm/distributed/kv_events.py``, 0.13 and 0.33):

* on its PUB socket, one multipart message per ``KVEventBatch``: ``[topic, seq, payload]``,
  ``seq`` the batch's sequence number (from 0) as 8 bytes big-endian, ``payload`` the
  batch's msgpack;
* on its ROUTER replay socket, to a request ``[empty, start_seq as 8 bytes big-endian]``
  (a DEALER's frames), every buffered batch with ``seq >= start_seq`` in order, as
  ``[empty, seq, payload]`` (0.13) or ``[empty, topic, seq, payload]`` (0.33), then the end
  marker: the same with ``seq`` = -1 (8 bytes, signed) and an empty payload.

A capture file (``write_capture``, ``read_capture``) is ``CAPTURE_MAGIC`` followed by one
record per batch: ``seq`` (8 bytes big-endian, as on the wire), the payload's length (4 bytes
big-endian) and the payload. A file without the magic is read as bare msgpack batches,
one after the other (no sequence numbers: no gap, duplicate or replay checks).

pyzmq is imported only for the live commands.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from kvspec.conformance.arguments import positive_seconds, whole_number
from kvspec.spec.event_stream import (
    RULES,
    Finding,
    Origin,
    Record,
    StreamFold,
    StreamReport,
    replay_comparable,
    replay_findings,
)
from kvspec.spec.events import WireError, split_documents

_SECONDS = positive_seconds()
_BATCHES = whole_number(1, "batches")

EXIT_CONFORMS, EXIT_FINDINGS, EXIT_USAGE = 0, 1, 2
CAPTURE_MAGIC = b"kvspec-events/1\n"
END_SEQ = -1  # the replay's end marker, as vLLM sends it (8 bytes, signed)
DEFAULT_IDLE_TIMEOUT = 10.0
DEFAULT_REPLAY_TIMEOUT = 5.0


class EventsCheckError(ValueError):
    """Bad usage or input of ``kvspec events``: the message names the value."""


class CaptureFormatError(EventsCheckError):
    """A capture file that cannot be read: cut short, or neither framing."""


class EndpointError(LookupError):
    """A live endpoint that gave nothing: no batch, or no replay answer, in time."""


# --- Capture files ------------------------------------------------------------------------------


def frame_record(seq: int, payload: bytes) -> bytes:
    """One capture record: seq (8 bytes big-endian, signed), length (4 bytes), payload."""
    return seq.to_bytes(8, "big", signed=True) + len(payload).to_bytes(4, "big") + payload


def write_capture(path: Path, records: Sequence[tuple[int, bytes]]) -> None:
    """A capture file of (seq, payload) records."""
    path.write_bytes(CAPTURE_MAGIC + b"".join(frame_record(s, p) for s, p in records))


def read_capture(path: Path) -> tuple[Record, ...]:
    """The records of a capture file, or of a file of bare msgpack batches (seq None)."""
    try:
        data = path.read_bytes()
    except OSError as error:
        raise CaptureFormatError(f"cannot read capture {str(path)!r}: {error}") from None
    if not data.startswith(CAPTURE_MAGIC):
        try:
            return tuple(Record(None, doc) for doc in split_documents(data))
        except WireError as error:
            raise CaptureFormatError(
                f"{str(path)!r} is neither a kvspec capture (no {CAPTURE_MAGIC!r} header) nor "
                f"bare msgpack batches: {error}") from None
    return tuple(_framed_records(data, path))


def _framed_records(data: bytes, path: Path) -> Iterator[Record]:
    at = len(CAPTURE_MAGIC)
    while at < len(data):
        if at + 12 > len(data):
            raise CaptureFormatError(
                f"{str(path)!r}: record header at byte {at} cut short ({len(data) - at} bytes)")
        seq = int.from_bytes(data[at:at + 8], "big", signed=True)
        size = int.from_bytes(data[at + 8:at + 12], "big")
        if at + 12 + size > len(data):
            raise CaptureFormatError(
                f"{str(path)!r}: record seq {seq} at byte {at} says {size} payload bytes, "
                f"{len(data) - at - 12} remain")
        yield Record(seq, data[at + 12:at + 12 + size])
        at += 12 + size


# --- Live endpoints -----------------------------------------------------------------------------


@dataclass(frozen=True)
class StopAfter:
    """When a live read stops: N batches, S seconds, or nothing for the idle timeout."""

    batches: int | None = None
    seconds: float | None = None
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT


@dataclass
class LiveResult:
    report: StreamReport
    notes: list[str] = field(default_factory=list)


def _zmq() -> Any:
    try:
        import zmq
    except ImportError:
        raise EventsCheckError("live endpoints need pyzmq (pip install pyzmq)") from None
    return zmq


def parse_message(frames: Sequence[bytes]) -> tuple[int, bytes] | str:
    """(seq, payload) of a PUB message ``[topic, seq, payload]``, or what is wrong with it."""
    if len(frames) != 3 or len(frames[1]) != 8:
        return (f"{len(frames)} frames of {[len(f) for f in frames]} bytes, not "
                f"[topic, 8-byte seq, payload]")
    return int.from_bytes(frames[1], "big", signed=True), frames[2]


def parse_replay_message(frames: Sequence[bytes]) -> tuple[int, bytes] | str:
    """(seq, payload) of a replay answer as a DEALER receives it: ``[empty, seq, payload]``
    (vLLM 0.13) or ``[empty, topic, seq, payload]`` (0.33); seq -1 is the end marker."""
    body = list(frames[1:]) if frames and frames[0] == b"" else list(frames)
    if len(body) == 2:
        body = [b"", *body]
    return parse_message(body)


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
               replay_timeout: float = DEFAULT_REPLAY_TIMEOUT) -> LiveResult:
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
    return LiveResult(fold.report(), notes)


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


def check_file(path: Path, assume_from_start: bool = True) -> LiveResult:
    fold = StreamFold(assume_from_start)
    records = read_capture(path)
    for record in records:
        fold.feed(record)
    notes = []
    if records and records[0].seq is None:
        notes.append("bare msgpack batches, no sequence numbers: no gap, duplicate or replay "
                     "checks")
    return LiveResult(fold.report(), notes)


# --- Reports ------------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def report_json(source: str, result: LiveResult) -> dict[str, Any]:
    """The report as JSON-able values (``--json``)."""
    report = result.report
    return {
        "source": source,
        "conforms": report.conforms,
        "batches": report.batches, "events": report.events, "sequenced": report.sequenced,
        "from_start": report.from_start, "first_seq": report.first_seq,
        "last_seq": report.last_seq, "encodings": dict(report.encodings),
        "unverifiable_removals": report.unverifiable_removals,
        "findings_per_rule": dict(report.findings_per_rule),
        "partitions": [asdict(p) for p in report.partitions],
        "findings": [dict(_plain(asdict(f)),
                          event_type=None if f.event is None else type(f.event).__name__)
                     for f in report.findings],
        "notes": result.notes,
    }


def _where(group: int | None, medium: str | None) -> str:
    if group is None and medium is None:
        return "stream"
    return f"group {'-' if group is None else group}, {medium or '-'}"


def print_report(source: str, result: LiveResult, out: TextIO) -> None:
    report = result.report
    seqs = (f"seq {report.first_seq}..{report.last_seq}" if report.sequenced
            else "no sequence numbers")
    encodings = ", ".join(f"{name} {n}" for name, n in report.encodings) or "none"
    print(f"kvspec events check: {source}", file=out)
    print(f"read {report.batches} batches ({seqs}), {report.events} events; encodings: "
          f"{encodings} (array: vLLM 0.13, map: vLLM 0.33)", file=out)
    if not report.from_start:
        print(f"joined after the stream began: {report.unverifiable_removals} removals of "
              f"hashes stored before it were not checked", file=out)
    for note in result.notes:
        print(f"note: {note}", file=out)
    print(f"{'group':>5}  {'medium':<8}{'held copies':>12}{'hashes':>8}{'stores':>8}"
          f"{'removes':>8}{'clears':>7}", file=out)
    for p in report.partitions:
        print(f"{'-' if p.group_idx is None else p.group_idx:>5}  {p.medium or '-':<8}"
              f"{p.held_copies:>12}{p.held_hashes:>8}{p.stores:>8}{p.removes:>8}"
              f"{p.clears:>7}", file=out)
    for f in report.findings:
        event = "" if f.event_index is None else f", event {f.event_index}"
        print(f"  {f.rule} ({_where(f.group_idx, f.medium)}) seq {f.seq}, batch "
              f"#{f.batch_index}{event}: {f.message}", file=out)
        if f.event is not None:
            print(f"      {f.event!r}"[:300], file=out)
    kept = len(report.findings)
    total = sum(n for _, n in report.findings_per_rule)
    if total > kept:
        print(f"  ... {total - kept} more findings not shown (counted below)", file=out)
    if report.conforms:
        print("verdict: the stream conforms", file=out)
    else:
        counts = ", ".join(f"{rule} {n}" for rule, n in report.findings_per_rule)
        print(f"verdict: the stream does not conform ({total} findings: {counts})", file=out)


# --- The command --------------------------------------------------------------------------------


_EPILOG = f"""\
exit status:
  {EXIT_CONFORMS}  the stream conforms
  {EXIT_FINDINGS}  findings: each named by its rule, with its cache group, medium and seq
  {EXIT_USAGE}  bad usage, an unreadable file, or an endpoint that sent nothing in time

rules: {", ".join(RULES)}"""


def _add_live_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--topic", default="", help="the publisher's topic (default: all)")
    parser.add_argument("--batches", type=_BATCHES, metavar="N",
                        help="stop after N live batches")
    parser.add_argument("--seconds", type=_SECONDS, metavar="S",
                        help="stop after S seconds")
    parser.add_argument("--idle-timeout", type=_SECONDS, metavar="S",
                        default=DEFAULT_IDLE_TIMEOUT,
                        help=f"stop when no batch came for S seconds "
                             f"(default {DEFAULT_IDLE_TIMEOUT:g})")


def add_events_parser(subparsers: Any) -> None:
    """Add ``events`` with ``check`` and ``capture`` to the ``kvspec`` command's subparsers."""
    events = subparsers.add_parser(
        "events", help="check a KV-event stream (captured or live) against the spec",
        description="Check or capture vLLM's KV-event stream (ZmqEventPublisher).")
    events.set_defaults(func=run_events_command)
    commands = events.add_subparsers(dest="events_command", metavar="{check,capture}")
    commands.required = True
    check = commands.add_parser(
        "check", help="check a capture file or a live endpoint",
        description="Fold a KV-event stream as a router does and report every broken rule, "
                    "per cache group and medium (docs/events-check.md).",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    check.add_argument("file", nargs="?", type=Path,
                       help="a capture file (kvspec events capture) or bare msgpack batches")
    check.add_argument("--endpoint", help="a live publisher's PUB endpoint, e.g. "
                                          "tcp://127.0.0.1:5557")
    check.add_argument("--replay-endpoint", help="the publisher's ROUTER replay endpoint")
    _add_live_options(check)
    check.add_argument("--replay-timeout", type=_SECONDS, metavar="S",
                       default=DEFAULT_REPLAY_TIMEOUT,
                       help=f"wait this long for each replay answer "
                            f"(default {DEFAULT_REPLAY_TIMEOUT:g})")
    check.add_argument("--mid-stream", action="store_true",
                       help="a bare file does not start at the publisher's beginning: do not "
                            "check removals of hashes it never stored")
    check.add_argument("--json", type=Path, metavar="FILE", help="also write the report here")
    capture = commands.add_parser(
        "capture", help="record a live endpoint into a capture file",
        description="Record a publisher's batches, with their sequence numbers, into a file "
                    "`kvspec events check FILE` reads.")
    capture.add_argument("--endpoint", required=True)
    _add_live_options(capture)
    capture.add_argument("--out", required=True, type=Path, metavar="FILE")


def run_events_command(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run ``kvspec events check|capture``; returns the exit status (one line on stderr for a
    usage or input error)."""
    out = out or sys.stdout
    try:
        if args.events_command == "capture":
            stop = StopAfter(args.batches, args.seconds, args.idle_timeout)
            written = capture_live(args.endpoint, args.topic, stop, args.out)
            print(f"captured {written} batches from {args.endpoint} into {args.out}", file=out)
            return EXIT_CONFORMS
        return _run_check(args, out)
    except (EventsCheckError, EndpointError) as error:
        print(f"kvspec events: {error}", file=sys.stderr)
        return EXIT_USAGE


def _run_check(args: argparse.Namespace, out: TextIO) -> int:
    if (args.file is None) == (args.endpoint is None):
        raise EventsCheckError("give a capture FILE or --endpoint, one of them")
    if args.replay_endpoint is not None and args.endpoint is None:
        raise EventsCheckError("--replay-endpoint needs --endpoint (a live check)")
    if args.file is not None:
        source = str(args.file)
        result = check_file(args.file, assume_from_start=not args.mid_stream)
    else:
        source = f"{args.endpoint} (topic {args.topic!r})" + (
            f", replay {args.replay_endpoint}" if args.replay_endpoint else "")
        result = check_live(args.endpoint, args.topic, args.replay_endpoint,
                            StopAfter(args.batches, args.seconds, args.idle_timeout),
                            args.replay_timeout)
    print_report(source, result, out)
    if args.json is not None:
        try:
            args.json.write_text(json.dumps(report_json(source, result), indent=1))
        except OSError as error:
            raise EventsCheckError(f"cannot write --json {str(args.json)!r}: {error}") from None
    return EXIT_CONFORMS if result.report.conforms else EXIT_FINDINGS
