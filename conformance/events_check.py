"""The KV-event stream oracle of ``kvspec events check``: capture files, vLLM's message
framing, and the report, checked against ``spec.event_stream`` (docs/events-check.md).

What vLLM's ``ZmqEventPublisher`` sends (``vllm/distributed/kv_events.py``, 0.13 and 0.33):

* on its PUB socket, one multipart message per ``KVEventBatch``: ``[topic, seq, payload]``,
  ``seq`` the batch's sequence number (from 0) as 8 bytes big-endian, ``payload`` the
  batch's msgpack;
* on its ROUTER replay socket, to a request ``[empty, start_seq as 8 bytes big-endian]``
  (a DEALER's frames), every buffered batch with ``seq >= start_seq`` in order, as
  ``[empty, seq, payload]`` (0.13) or ``[empty, topic, seq, payload]`` (0.33), then the end
  marker: the same with ``seq`` = -1 (8 bytes, signed) and an empty payload.

`parse_message` and `parse_replay_message` read those frames; reading them off live sockets
(pyzmq) is the campaign layer's (`kvspec.campaign.live_events`), which feeds what it receives
to the same fold and reports here.

A capture file (``write_capture``, ``read_capture``) is ``CAPTURE_MAGIC`` followed by one
record per batch: ``seq`` (8 bytes big-endian, as on the wire), the payload's length (4 bytes
big-endian) and the payload. A file without the magic is read as bare msgpack batches,
one after the other (no sequence numbers: no gap, duplicate or replay checks).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from kvspec.spec.event_stream import Record, StreamFold, StreamReport
from kvspec.spec.events import WireError, split_documents

CAPTURE_MAGIC = b"kvspec-events/1\n"
END_SEQ = -1  # the replay's end marker, as vLLM sends it (8 bytes, signed)


class EventsCheckError(ValueError):
    """Bad usage or input of ``kvspec events``: the message names the value."""


class CaptureFormatError(EventsCheckError):
    """A capture file that cannot be read: cut short, or neither framing."""


@dataclass
class CheckResult:
    """A checked stream: the fold's report, and notes on how it was read."""

    report: StreamReport
    notes: list[str] = field(default_factory=list)


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


# --- vLLM's messages ----------------------------------------------------------------------------


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


# --- Checking a file ----------------------------------------------------------------------------


def check_file(path: Path, assume_from_start: bool = True) -> CheckResult:
    """Fold a capture file (or bare msgpack batches) as a router does."""
    fold = StreamFold(assume_from_start)
    records = read_capture(path)
    for record in records:
        fold.feed(record)
    notes = []
    if records and records[0].seq is None:
        notes.append("bare msgpack batches, no sequence numbers: no gap, duplicate or replay "
                     "checks")
    return CheckResult(fold.report(), notes)


# --- Reports ------------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def report_json(source: str, result: CheckResult) -> dict[str, Any]:
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


def print_report(source: str, result: CheckResult, out: TextIO) -> None:
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
