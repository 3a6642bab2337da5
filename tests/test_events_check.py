"""``kvspec events check``: every rule of spec/event_stream.py caught on a planted stream, and
kvspec's own events, published by a real process over real ZMQ sockets in vLLM's protocol,
checked live (with replay) and from a capture file."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvspec.cli import main
from kvspec.conformance.events_check import (
    CAPTURE_MAGIC,
    CaptureFormatError,
    parse_message,
    parse_replay_message,
    read_capture,
    write_capture,
)
from kvspec.spec.event_stream import (
    RULES,
    Origin,
    Record,
    StreamFold,
    check_stream,
    replay_comparable,
    replay_findings,
)
from kvspec.spec.events import (
    WireCleared,
    WireEvent,
    WireRemoved,
    WireStored,
    encode_batch,
)
from kvspec.spec.pool import Profile
from tests.kv_event_publisher import as_033, workload_batches

REPO_ROOT = Path(__file__).resolve().parent.parent
BATCHES = workload_batches()


def batch(*events: WireEvent, profile: Profile = Profile.V0_13) -> bytes:
    return encode_batch(1.0, list(events), None, profile)


def stored(*hashes: int, parent: int | None = None, tokens: int | None = None,
           block_size: int = 2, medium: str = "GPU", group: int | None = None) -> WireStored:
    count = len(hashes) * block_size if tokens is None else tokens
    return WireStored(tuple(hashes), parent, tuple(range(count)), block_size, None, medium,
                      group_idx=group)


def removed(*hashes: int, medium: str = "GPU", group: int | None = None) -> WireRemoved:
    return WireRemoved(tuple(hashes), medium, group_idx=group)


def records(*payloads: bytes) -> list[Record]:
    return [Record(seq, payload) for seq, payload in enumerate(payloads)]


def rules(report: Any) -> dict[str, int]:
    return dict(report.findings_per_rule)


def only(report: Any, rule: str) -> Any:
    assert rules(report) == {rule: 1}, report.findings
    return report.findings[0]


# --- Every rule on a planted stream -------------------------------------------------------------


def test_kvspecs_own_stream_conforms_in_both_encodings() -> None:
    for payloads, shape in ((BATCHES, "array"), ([as_033(b) for b in BATCHES], "map")):
        report = check_stream(records(*payloads))
        assert report.conforms, report.findings
        assert dict(report.encodings) == {shape: report.events} and report.events > 100
        assert report.from_start and (report.first_seq, report.last_seq) == (0, 59)
        [partition] = report.partitions
        assert (partition.group_idx, partition.medium) == (None if shape == "array" else 0, "GPU")
        assert partition.clears == 1 and partition.removes > 50


def test_undecodable_batch() -> None:
    finding = only(check_stream(records(batch(stored(1)), b"\x91\x01")), "undecodable_batch")
    assert (finding.seq, finding.batch_index) == (1, 1)
    assert "not a KVEventBatch" in finding.message


def test_removed_never_stored() -> None:
    report = check_stream(records(batch(stored(1, 2)), batch(removed(2)), batch(removed(9))))
    finding = only(report, "removed_never_stored")
    assert (finding.seq, finding.event_index, finding.medium) == (2, 0, "GPU")
    assert "hash 9" in finding.message and finding.event == removed(9)


def test_remove_exceeds_stores_for_a_key_stored_twice() -> None:
    """Two copies of hash 5 (two stores), three removes: the third is one too many."""
    report = check_stream(records(batch(stored(5)), batch(stored(5)),
                                  batch(removed(5), removed(5)), batch(removed(5))))
    finding = only(report, "remove_exceeds_stores")
    assert finding.seq == 3 and "hash 5" in finding.message
    assert report.partitions[0].held_copies == 0


def test_parent_chain_loops_but_an_unseen_parent_is_legal() -> None:
    finding = only(check_stream(records(batch(stored(3, 4, parent=4)))), "parent_chain")
    assert "parent 4" in finding.message
    assert check_stream(records(batch(stored(3, 4, parent=77)))).conforms  # finding R2


def test_whole_blocks_and_its_legal_exceptions() -> None:
    finding = only(check_stream(records(batch(stored(1, 2, tokens=3)))), "whole_blocks")
    assert "3 tokens for 2 hashes of block_size 2" in finding.message
    legal = records(
        batch(stored(1, tokens=0)),  # a snapshot's key-only BlockStored
        batch(stored(2, tokens=6)),  # null blocks' tokens: more blocks than hashes (R1)
        batch(stored(3, tokens=5, block_size=5)))  # a 0.33 partial entry: its own span
    assert check_stream(legal).conforms


def test_sequence_gap_duplicate_and_regression() -> None:
    payloads = [batch(stored(i)) for i in range(8)]
    gap = check_stream([Record(s, p) for s, p in enumerate(payloads) if s != 5])
    finding = only(gap, "sequence_gap")
    assert finding.seq == 6 and "seq 5..5" in finding.message and "not filled" in finding.message
    dup = [Record(s, p) for s, p in enumerate(payloads)]
    dup.insert(6, Record(5, payloads[5]))
    assert only(check_stream(dup), "duplicate_batch").seq == 5
    back = [*records(*payloads), Record(5, batch(stored(99)))]
    assert only(check_stream(back), "sequence_regressed").seq == 5


def test_a_filled_gap_is_reported_as_filled() -> None:
    fold = StreamFold()
    payloads = [batch(stored(i)) for i in range(4)]
    for seq in (0, 1):
        fold.feed(Record(seq, payloads[seq]))
    assert fold.missing_before(3) == range(2, 3)
    fold.feed(Record(2, payloads[2], Origin.FILL))
    fold.feed(Record(3, payloads[3]))
    finding = only(fold.report(), "sequence_gap")
    assert "replay filled it" in finding.message and fold.report().last_seq == 3


def test_replay_differs_and_replay_reproduces_state() -> None:
    payloads = [batch(stored(i)) for i in range(5)]
    fold = StreamFold()
    for record in records(*payloads):
        fold.feed(record)
    same = [Record(s, p, Origin.REPLAY) for s, p in enumerate(payloads)]
    assert replay_comparable(fold, same) and replay_findings(fold, same) == []
    differs = [*same[:2], Record(2, batch(stored(42)), Origin.REPLAY), *same[3:]]
    found = {f.rule: f for f in replay_findings(fold, differs)}
    assert found["replay_differs"].seq == 2
    assert "hash 2: live 1, replay 0" in found["replay_reproduces_state"].message
    short = [r for r in same if r.seq != 3]
    missing, state = replay_findings(fold, short)
    assert missing.rule == state.rule == "replay_reproduces_state"
    assert "gave seqs 0..2, 4, not 0..4" in missing.message and missing.seq == 3
    assert "hash 3: live 1, replay 0" in state.message
    fill_differs = StreamFold()
    fill_differs.feed(Record(0, payloads[0]))
    fill_differs.feed(Record(0, payloads[1], Origin.FILL))
    assert only(fill_differs.report(), "replay_differs").seq == 0


def test_all_blocks_cleared_resets_the_gpu_groups_only() -> None:
    report = check_stream(records(
        batch(stored(1, group=0), stored(1, group=1), stored(7, medium="CPU", group=0),
              profile=Profile.V0_33),
        batch(WireCleared(), profile=Profile.V0_33),
        batch(removed(7, medium="CPU", group=0), removed(1, group=1), profile=Profile.V0_33)))
    finding = only(report, "removed_never_stored")
    assert (finding.group_idx, finding.medium, finding.seq) == (1, "GPU", 2)
    held = {(p.group_idx, p.medium): p.held_copies for p in report.partitions}
    assert held == {(0, "GPU"): 0, (1, "GPU"): 0, (0, "CPU"): 0}


def test_a_late_join_does_not_flag_removals_of_what_it_never_saw() -> None:
    report = check_stream([Record(10, batch(removed(3))), Record(11, batch(WireCleared())),
                           Record(12, batch(removed(4)))])
    assert not report.from_start and report.unverifiable_removals == 1
    assert only(report, "removed_never_stored").seq == 12


def test_every_rule_is_planted_here() -> None:
    """Each rule in RULES is asserted by name in this file or the live tests below."""
    text = Path(__file__).read_text()
    assert [rule for rule in RULES if text.count(f'"{rule}"') < 1] == []


# --- Capture files and the command --------------------------------------------------------------


def run(*argv: str) -> tuple[int, str]:
    out = subprocess.run([sys.executable, "-m", "kvspec.cli", "events", *argv],
                         capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    return out.returncode, out.stdout + out.stderr


def test_capture_file_conforms_and_reports(tmp_path: Path) -> None:
    path = tmp_path / "stream.kvev"
    write_capture(path, list(enumerate(BATCHES)))
    assert [r.seq for r in read_capture(path)] == list(range(60))
    code, text = run("check", str(path), "--json", str(tmp_path / "r.json"))
    assert code == 0, text
    assert "verdict: the stream conforms" in text and "seq 0..59" in text
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["conforms"] and report["encodings"] == {"array": report["events"]}


def test_capture_file_with_findings_exits_1(tmp_path: Path) -> None:
    path = tmp_path / "bad.kvev"
    write_capture(path, [(0, BATCHES[0]), (2, BATCHES[2]), (3, batch(removed(123456)))])
    code, text = run("check", str(path), "--json", str(tmp_path / "r.json"))
    assert code == 1, text
    found = {f["rule"]: f for f in json.loads((tmp_path / "r.json").read_text())["findings"]}
    assert found["sequence_gap"]["seq"] == 2
    assert found["removed_never_stored"]["seq"] == 3
    assert "hash 123456" in text


def test_bare_msgpack_file(tmp_path: Path) -> None:
    path = tmp_path / "bare.msgpack"
    path.write_bytes(b"".join(as_033(b) for b in BATCHES))
    assert all(r.seq is None for r in read_capture(path))
    code, text = run("check", str(path))
    assert code == 0, text
    assert "no sequence numbers: no gap, duplicate or replay checks" in text
    assert "map" in text


@pytest.mark.parametrize("content", [CAPTURE_MAGIC + b"\x00\x01", b"\xc1 not msgpack"])
def test_unreadable_files_exit_2(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "broken"
    path.write_bytes(content)
    with pytest.raises(CaptureFormatError, match="broken"):
        read_capture(path)
    assert main(["events", "check", str(path)]) == 2


def test_bad_usage_exits_2(tmp_path: Path) -> None:
    assert main(["events", "check"]) == 2
    assert main(["events", "check", str(tmp_path / "missing")]) == 2
    assert main(["events", "check", "x", "--endpoint", "tcp://127.0.0.1:1"]) == 2
    assert main(["events", "check", "--endpoint", "tcp://127.0.0.1:1", "--batches", "0"]) == 2


def test_message_framing() -> None:
    assert parse_message([b"t", (7).to_bytes(8, "big"), b"p"]) == (7, b"p")
    assert isinstance(parse_message([b"t", b"\x07", b"p"]), str)
    end = (-1).to_bytes(8, "big", signed=True)
    assert parse_replay_message([b"", end, b""]) == (-1, b"")  # vLLM 0.13
    assert parse_replay_message([b"", b"kv", (3).to_bytes(8, "big"), b"p"]) == (3, b"p")  # 0.33


# --- Live: a real publisher process, real ZMQ sockets -------------------------------------------


@pytest.fixture
def sockets() -> Iterator[tuple[str, str]]:
    with tempfile.TemporaryDirectory(prefix="kvev", dir="/tmp") as tmp:
        yield f"ipc://{tmp}/pub", f"ipc://{tmp}/replay"


def live(pub: str, replay: str | None, *argv: str, fault: str | None = None,
         encoding: str = "0.13", json_out: Path | None = None) -> tuple[int, str, Any]:
    command = [sys.executable, "-m", "tests.kv_event_publisher", "--endpoint", pub,
               "--encoding", encoding]
    if replay:
        command += ["--replay-endpoint", replay]
    if fault:
        command += ["--fault", fault]
    publisher = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 cwd=REPO_ROOT, text=True)
    try:
        assert publisher.stdout is not None and publisher.stdout.readline() == "ready\n"
        check = ["check", "--endpoint", pub, "--topic", "kv", "--idle-timeout", "1.5", *argv]
        if replay:
            check += ["--replay-endpoint", replay]
        if json_out is not None:
            check += ["--json", str(json_out)]
        code, text = run(*check)
    finally:
        assert publisher.stdin is not None
        publisher.stdin.close()
        publisher.wait(timeout=30)
    report = json.loads(json_out.read_text()) if json_out and json_out.exists() else None
    return code, text, report


def test_live_stream_with_replay_conforms(sockets: tuple[str, str], tmp_path: Path) -> None:
    code, text, report = live(*sockets, json_out=tmp_path / "r.json")
    assert code == 0, text
    assert report["batches"] == 60 and report["from_start"]
    assert any("compared with the live state" in note for note in report["notes"])


def test_live_033_stream_conforms(sockets: tuple[str, str], tmp_path: Path) -> None:
    code, text, report = live(*sockets, encoding="0.33", json_out=tmp_path / "r.json")
    assert code == 0, text
    assert report["encodings"] == {"map": report["events"]}
    assert report["partitions"][0]["group_idx"] == 0


def test_live_dropped_batch_is_a_gap_replay_fills(sockets: tuple[str, str],
                                                  tmp_path: Path) -> None:
    code, text, report = live(*sockets, fault="drop:5", json_out=tmp_path / "r.json")
    assert code == 1, text
    [finding] = report["findings"]
    assert finding["rule"] == "sequence_gap" and finding["seq"] == 6
    assert "replay filled it" in finding["message"]


def test_live_dropped_batch_without_replay(sockets: tuple[str, str], tmp_path: Path) -> None:
    code, text, report = live(sockets[0], None, fault="drop:5", json_out=tmp_path / "r.json")
    assert code == 1, text
    gap = [f for f in report["findings"] if f["rule"] == "sequence_gap"]
    assert gap[0]["seq"] == 6 and "not filled" in gap[0]["message"]


def test_live_duplicated_batch(sockets: tuple[str, str], tmp_path: Path) -> None:
    code, text, report = live(*sockets, fault="dup:5", json_out=tmp_path / "r.json")
    assert code == 1, text
    assert [(f["rule"], f["seq"]) for f in report["findings"]] == [("duplicate_batch", 5)]


def test_live_replay_that_differs(sockets: tuple[str, str], tmp_path: Path) -> None:
    code, text, report = live(*sockets, fault="replay-differs:5", json_out=tmp_path / "r.json")
    assert code == 1, text
    assert ("replay_differs", 5) in [(f["rule"], f["seq"]) for f in report["findings"]]


def test_live_capture_then_check(sockets: tuple[str, str], tmp_path: Path) -> None:
    out = tmp_path / "cap.kvev"
    code, text, _ = live(sockets[0], None, "--batches", "60")
    assert code == 0, text
    publisher = subprocess.Popen([sys.executable, "-m", "tests.kv_event_publisher",
                                  "--endpoint", sockets[0]], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, cwd=REPO_ROOT, text=True)
    try:
        assert publisher.stdout is not None and publisher.stdout.readline() == "ready\n"
        code, text = run("capture", "--endpoint", sockets[0], "--topic", "kv", "--batches",
                         "60", "--out", str(out))
        assert code == 0 and "captured 60 batches" in text, text
    finally:
        assert publisher.stdin is not None
        publisher.stdin.close()
        publisher.wait(timeout=30)
    code, text = run("check", str(out))
    assert code == 0 and "seq 0..59" in text, text


def test_malformed_message(sockets: tuple[str, str], tmp_path: Path) -> None:
    """A publisher that is not vLLM's: a two-frame message is a finding, not a crash."""
    import threading

    import zmq

    ctx: Any = zmq.Context.instance()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(sockets[0])

    checked = threading.Event()

    def send() -> None:
        # Once the checker (a fresh Python, slow to start on a loaded machine) subscribes.
        while not checked.is_set():
            if pub.poll(100):
                pub.recv()
                pub.send_multipart([b"kv", b"no seq"])
                pub.send_multipart([b"kv", (0).to_bytes(8, "big"), BATCHES[0]])
                return

    thread = threading.Thread(target=send)
    thread.start()
    try:
        code, text = run("check", "--endpoint", sockets[0], "--topic", "kv",
                         "--idle-timeout", "1", "--json", str(tmp_path / "r.json"))
    finally:
        checked.set()
        thread.join()
        pub.close()
    assert code == 1, text
    report = json.loads((tmp_path / "r.json").read_text())
    assert [f["rule"] for f in report["findings"]] == ["malformed_message"]


def test_unreachable_endpoint_exits_2(sockets: tuple[str, str]) -> None:
    code, text = run("check", "--endpoint", sockets[0], "--idle-timeout", "0.5")
    assert code == 2 and "no batch from" in text, text
