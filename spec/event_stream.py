"""A published KV-event stream, checked the way a KV-aware router relies on it.

vLLM's ``ZmqEventPublisher`` numbers each ``KVEventBatch`` it sends (a sequence number from
0, one per batch) and keeps the last batches for replay. A router folds the batches, in
sequence order, into what it believes each cache holds. ``StreamFold`` is that fold, over
records of (sequence number or None, payload bytes, origin), kept per (group_idx, medium):
vLLM 0.33's events name their KV-cache group (0.13's do not: group None) and every event
names its medium (GPU, or CPU for an offload tier). Each event is decoded by
``spec.events.read_event`` (0.13's arrays and 0.33's maps both) and folded by
``spec.event_consumer.fold_event``; the per-event predicates are ``spec.event_consumer``'s.

The fold yields ``Finding``s, each under a rule (``RULES``):

* ``undecodable_batch``: a payload that is not a KVEventBatch of either release.
* ``removed_never_stored``: a BlockRemoved of a hash never stored in its (group, medium)
  since the last clear (vLLM #55092, #48933: a remove while another copy is resident, seen
  from the other side).
* ``remove_exceeds_stores``: a BlockRemoved of a hash stored before but with every copy
  already removed: the per-copy count would go negative (ai-dynamo/dynamo#8012).
* ``parent_chain``: a BlockStored whose parent is one of its own blocks (a loop). A parent
  the router never saw is legal (``spec.event_consumer``, finding R2).
* ``whole_blocks``: a BlockStored's tokens are not whole blocks, one at least per hash
  (``spec.event_consumer.stored_covers_whole_blocks``: null blocks, snapshots, partial
  entries allowed for).
* ``sequence_gap``: a sequence number the live stream skipped (llm-d/llm-d-router#1737,
  vLLM #45174); the finding says whether a replay filled it.
* ``duplicate_batch``: a live batch whose sequence number was already folded, same payload.
* ``sequence_regressed``: a live batch whose sequence number was already passed, with a
  payload that differs from (or was never) the one folded under it.
* ``replay_differs``: a replayed batch whose payload differs from the live one's.
* ``replay_reproduces_state``: folding a replay from the stream's first sequence number
  does not give the live fold's state (``replay_findings``).

AllBlocksCleared carries no group or medium; vLLM sends it only from the GPU block pool's
``reset_prefix_cache``, so it clears every group of the GPU medium (``CLEARED_MEDIA``) and
leaves an offload tier's state alone.

A stream that does not start at sequence number 0 was joined late: the router cannot know
what was stored before. Until a clear, removals of hashes it does not hold are counted
(``StreamReport.unverifiable_removals``), not reported.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from kvspec.spec.event_consumer import (
    CachedBlock,
    RouterView,
    fold_event,
    stored_covers_whole_blocks,
    stored_parent_outside_its_blocks,
)
from kvspec.spec.events import (
    MEDIUM_GPU,
    WireCleared,
    WireError,
    WireEvent,
    WireRemoved,
    WireStored,
    decode_batch,
    read_event,
    to_pool_event,
)
from kvspec.spec.pool import Removed, Stored

# --- The rules ----------------------------------------------------------------------------------

RULES: dict[str, str] = {
    "undecodable_batch": "a router cannot read the batch at all: every event in it is lost",
    "removed_never_stored": "a router that trusts the remove drops a key it never had, or "
                            "its count of a key another copy holds",
    "remove_exceeds_stores": "more removes than stores for one copy: a counting router goes "
                             "negative, a set-based one evicts a resident copy",
    "parent_chain": "a block that is its own ancestor loops a router's prefix walk",
    "whole_blocks": "a router splits tokens by block size: a partial block misaligns every "
                    "block after it",
    "sequence_gap": "a batch the router never saw: its stores and removes are missing",
    "duplicate_batch": "a batch applied twice double-counts its stores and removes",
    "sequence_regressed": "the sequence went back with new content: the publisher restarted "
                          "or reordered, and the router's state is stale",
    "replay_differs": "a replay that is not what was published rebuilds a different cache",
    "replay_reproduces_state": "a router that rebuilds from replay must reach the live state",
    "malformed_message": "a message that is not [topic, 8-byte seq, payload]: unreadable",
}

# Media an AllBlocksCleared clears: it comes from the GPU pool; 0.13's medium may be unset.
CLEARED_MEDIA: frozenset[str | None] = frozenset({MEDIUM_GPU, None})

Partition = tuple[int | None, str | None]  # (group_idx, medium)


class Origin(Enum):
    """Where a record came from."""

    LIVE = "live"  # the publisher's stream, as received or as captured
    FILL = "fill"  # replayed on request to fill a gap the live stream left
    REPLAY = "replay"  # replayed on request, to compare with the live stream


@dataclass(frozen=True)
class Record:
    """One published batch: its sequence number (None for a bare payload), its bytes."""

    seq: int | None
    payload: bytes
    origin: Origin = Origin.LIVE


@dataclass(frozen=True)
class Finding:
    """One broken rule, where it broke (partition, batch) and with what values."""

    rule: str
    group_idx: int | None
    medium: str | None
    seq: int | None
    batch_index: int  # the record's position in the stream fed to the fold
    event_index: int | None  # the event's position in its batch; None for a batch finding
    event: WireEvent | None
    message: str


@dataclass(frozen=True)
class PartitionSummary:
    """The end state of one (group_idx, medium): what a router holds there."""

    group_idx: int | None
    medium: str | None
    held_copies: int  # stores less removes, over every hash
    held_hashes: int
    stores: int  # hashes stored, over the whole stream
    removes: int
    clears: int


@dataclass(frozen=True)
class StreamReport:
    """What a fold found, and how much it read."""

    findings: tuple[Finding, ...]
    findings_per_rule: tuple[tuple[str, int], ...]  # every finding counted, kept or not
    partitions: tuple[PartitionSummary, ...]
    batches: int
    events: int
    sequenced: bool
    from_start: bool
    first_seq: int | None
    last_seq: int | None
    encodings: tuple[tuple[str, int], ...]  # events per encoding ("array", "map")
    unverifiable_removals: int

    @property
    def conforms(self) -> bool:
        return not self.findings_per_rule


# --- Sequence numbers ---------------------------------------------------------------------------


def missing_between(expected: int, seq: int) -> range:
    """The sequence numbers skipped when ``seq`` arrives while ``expected`` is next.

    post: len(__return__) == max(0, seq - expected)
    """
    return range(expected, max(expected, seq))


def sequence_status(seq: int, next_seq: int | None, folded: bool) -> str:
    """What a sequence number is to a fold whose next expected number is ``next_seq``:
    ``"next"``, ``"ahead"`` (a gap before it), ``"seen"`` (folded before) or ``"behind"``
    (already passed, never folded).

    post: (__return__ == "ahead") == (next_seq is not None and seq > next_seq)
    """
    if next_seq is None or seq == next_seq:
        return "next"
    if seq > next_seq:
        return "ahead"
    return "seen" if folded else "behind"


# --- The fold -----------------------------------------------------------------------------------


@dataclass
class _PartitionState:
    counts: Counter[int] = field(default_factory=Counter)
    blocks: dict[int, CachedBlock] = field(default_factory=dict)
    ever_stored: set[int] = field(default_factory=set)  # since the last clear
    known: bool = True  # False while a late-joined stream has not seen a clear here
    stores: int = 0
    removes: int = 0
    clears: int = 0


def _shape(raw: Any) -> str:
    return "array" if isinstance(raw, list) else "map" if isinstance(raw, dict) else "other"


class StreamFold:
    """The router's fold of a stream, record by record (``feed``), with what it found.

    ``assume_from_start`` says whether a bare (unsequenced) stream starts at the publisher's
    beginning; a sequenced one starts there when its first sequence number is 0.
    ``keep_per_rule`` bounds the findings kept per rule (all are counted)."""

    def __init__(self, assume_from_start: bool = True, keep_per_rule: int = 50) -> None:
        self.assume_from_start = assume_from_start
        self.keep_per_rule = keep_per_rule
        self.findings: list[Finding] = []
        self.rule_counts: Counter[str] = Counter()
        self.partitions: dict[Partition, _PartitionState] = {}
        self.payloads: dict[int, bytes] = {}  # folded sequence numbers and their payloads
        self.next_seq: int | None = None
        self.first_seq: int | None = None
        self.last_live_seq: int | None = None
        self.from_start: bool | None = None
        self.sequenced = False
        self.batches = 0
        self.events = 0
        self.encodings: Counter[str] = Counter()
        self.cleared_media: set[str | None] = set()
        self.unverifiable_removals = 0

    # -- findings

    def _find(self, rule: str, partition: Partition, seq: int | None, batch_index: int,
              event_index: int | None, event: WireEvent | None, message: str) -> None:
        self.rule_counts[rule] += 1
        if self.rule_counts[rule] <= self.keep_per_rule:
            self.findings.append(Finding(rule, partition[0], partition[1], seq, batch_index,
                                         event_index, event, message))

    def add(self, finding: Finding) -> None:
        """Count and keep a finding made outside the fold (a replay's, a malformed message)."""
        self._find(finding.rule, (finding.group_idx, finding.medium), finding.seq,
                   finding.batch_index, finding.event_index, finding.event, finding.message)

    # -- records

    def missing_before(self, seq: int) -> range:
        """The sequence numbers a live ``seq`` would skip: what a replay should fill first."""
        if self.next_seq is None:
            return range(0)
        return missing_between(self.next_seq, seq)

    def feed(self, record: Record) -> None:
        """Fold one record, sequence checks first."""
        index = self.batches
        self.batches += 1
        stream: Partition = (None, None)
        if record.seq is None:
            self._start(None)
            self._fold_payload(record, index)
            return
        self.sequenced = True
        seq = record.seq
        status = sequence_status(seq, self.next_seq, seq in self.payloads)
        if record.origin is Origin.LIVE:
            self._check_live_order(seq, index)
        if status == "seen":
            same = self.payloads[seq] == record.payload
            if record.origin is Origin.LIVE:
                if same:
                    self._find("duplicate_batch", stream, seq, index, None, None,
                               f"batch seq {seq} received again with the same "
                               f"{len(record.payload)}-byte payload")
                else:
                    self._find("sequence_regressed", stream, seq, index, None, None,
                               f"batch seq {seq} received again with a different payload "
                               f"({len(record.payload)} bytes, was "
                               f"{len(self.payloads[seq])}); next expected {self.next_seq}")
            elif not same:
                self._find("replay_differs", stream, seq, index, None, None,
                           f"{record.origin.value} of seq {seq} differs from the live batch "
                           f"({len(record.payload)} bytes against "
                           f"{len(self.payloads[seq])})")
            return
        if status == "behind":
            if record.origin is Origin.LIVE:
                self._find("sequence_regressed", stream, seq, index, None, None,
                           f"batch seq {seq} arrived after seq {self.last_live_seq}; "
                           f"next expected {self.next_seq}")
            return  # a replay of what came before this fold began: nothing to compare
        self._start(seq)
        self.next_seq = seq + 1
        self.payloads[seq] = record.payload
        self._fold_payload(record, index)

    def _check_live_order(self, seq: int, index: int) -> None:
        last = self.last_live_seq
        if last is not None and seq > last + 1:
            gap = missing_between(last + 1, seq)
            filled = all(s in self.payloads for s in gap)
            self._find("sequence_gap", (None, None), seq, index, None, None,
                       f"seq {gap.start}..{gap.stop - 1} ({len(gap)} batches) missing "
                       f"before seq {seq}; "
                       + ("replay filled it" if filled else "not filled: the state after it "
                          "may be wrong, and findings after it may follow from it"))
        if last is None or seq > last:
            self.last_live_seq = seq

    def _start(self, seq: int | None) -> None:
        if self.from_start is not None:
            return
        self.first_seq = seq
        self.from_start = self.assume_from_start if seq is None else seq == 0

    # -- events

    def _fold_payload(self, record: Record, index: int) -> None:
        shapes: list[str] = []

        def reader(raw: Any) -> WireEvent:
            shapes.append(_shape(raw))
            return read_event(raw)

        try:
            _, events, _ = decode_batch(record.payload, reader)
        except WireError as error:
            self._find("undecodable_batch", (None, None), record.seq, index, None, None,
                       f"payload of {len(record.payload)} bytes: {error}")
            return
        self.encodings.update(shapes)
        for event_index, event in enumerate(events):
            self.events += 1
            self._fold_event(event, record.seq, index, event_index)

    def _state(self, partition: Partition) -> _PartitionState:
        state = self.partitions.get(partition)
        if state is None:
            state = _PartitionState(known=bool(self.from_start)
                                    or partition[1] in self.cleared_media)
            self.partitions[partition] = state
        return state

    def _fold_event(self, event: WireEvent, seq: int | None, index: int,
                    event_index: int) -> None:
        if isinstance(event, WireCleared):
            self.cleared_media |= CLEARED_MEDIA
            for (_, medium), cleared in self.partitions.items():
                if medium in CLEARED_MEDIA:
                    fold_event(cleared.counts, cleared.blocks, to_pool_event(event))
                    cleared.ever_stored.clear()
                    cleared.known = True
                    cleared.clears += 1
            return
        partition: Partition = (event.group_idx, event.medium)
        state = self._state(partition)
        pool_event = to_pool_event(event)
        where = (partition, seq, index, event_index, event)
        if isinstance(event, WireStored) and isinstance(pool_event, Stored):
            self._check_stored(pool_event, where)
            state.stores += len(pool_event.hashes)
            state.ever_stored.update(pool_event.hashes)
        unheld = fold_event(state.counts, state.blocks, pool_event)
        if isinstance(event, WireRemoved) and isinstance(pool_event, Removed):
            state.removes += len(pool_event.hashes)
            for block_hash in unheld:
                self._check_unheld_removal(state, block_hash, where)

    def _check_stored(self, event: Stored, where: _Where) -> None:
        if not stored_parent_outside_its_blocks(event):
            self._find("parent_chain", *where,
                       f"BlockStored's parent {event.parent} is one of its own blocks "
                       f"{list(event.hashes)}")
        if not stored_covers_whole_blocks(event):
            self._find("whole_blocks", *where,
                       f"BlockStored carries {len(event.token_ids)} tokens for "
                       f"{len(event.hashes)} hashes of block_size {event.block_size}: "
                       f"not whole blocks, at least one per hash")

    def _check_unheld_removal(self, state: _PartitionState, block_hash: int,
                              where: _Where) -> None:
        partition = where[0]
        if not state.known:
            self.unverifiable_removals += 1
        elif block_hash in state.ever_stored:
            self._find("remove_exceeds_stores", *where,
                       f"BlockRemoved of hash {block_hash} in group {partition[0]} medium "
                       f"{partition[1]}: every stored copy was already removed")
        else:
            self._find("removed_never_stored", *where,
                       f"BlockRemoved of hash {block_hash} in group {partition[0]} medium "
                       f"{partition[1]}: never stored there since the last clear")

    # -- results

    def views(self) -> dict[Partition, RouterView]:
        """Per partition, the router's view now (``spec.event_consumer.RouterView``)."""
        return {partition: RouterView(tuple(sorted(state.counts.items())),
                                      tuple(sorted(state.blocks.items())))
                for partition, state in self.partitions.items()}

    def report(self) -> StreamReport:
        partitions = tuple(
            PartitionSummary(group, medium, sum(state.counts.values()), len(state.counts),
                             state.stores, state.removes, state.clears)
            for (group, medium), state in sorted(self.partitions.items(), key=_partition_key))
        return StreamReport(
            findings=tuple(self.findings),
            findings_per_rule=tuple(sorted(self.rule_counts.items())),
            partitions=partitions, batches=self.batches, events=self.events,
            sequenced=self.sequenced, from_start=bool(self.from_start),
            first_seq=self.first_seq,
            last_seq=None if self.next_seq is None else self.next_seq - 1,
            encodings=tuple(sorted(self.encodings.items())),
            unverifiable_removals=self.unverifiable_removals)


_Where = tuple[Partition, int | None, int, int | None, WireEvent | None]


def _partition_key(item: tuple[Partition, Any]) -> tuple[int, int, str]:
    (group, medium), _ = item
    return (group is not None, -1 if group is None else group, medium or "")


def check_stream(records: Iterable[Record], assume_from_start: bool = True) -> StreamReport:
    """The fold of a whole stream (a capture), and what it found."""
    fold = StreamFold(assume_from_start)
    for record in records:
        fold.feed(record)
    return fold.report()


# --- Replay -------------------------------------------------------------------------------------


def replay_findings(live: StreamFold, replayed: Sequence[Record]) -> list[Finding]:
    """The ``replay_reproduces_state`` and ``replay_differs`` findings of a replay requested
    from the live fold's first sequence number: every replayed batch the live fold also folded
    must be byte-identical, and folding the replay up to the live fold's last sequence number
    must give the live fold's state in every partition. A replay that starts after the live
    fold's first sequence number (the publisher's buffer no longer holds it) is not compared
    (``replay_comparable``)."""
    findings: list[Finding] = []
    if live.first_seq is None or live.next_seq is None:
        return findings
    last = live.next_seq - 1
    rebuilt = StreamFold(live.assume_from_start)
    wanted = [r for r in replayed if r.seq is not None and live.first_seq <= r.seq <= last]
    for position, record in enumerate(wanted):
        if record.seq in live.payloads and live.payloads[record.seq] != record.payload:
            findings.append(Finding(
                "replay_differs", None, None, record.seq, position, None, None,
                f"replayed seq {record.seq} differs from the live batch "
                f"({len(record.payload)} bytes against {len(live.payloads[record.seq])})"))
        rebuilt.feed(Record(record.seq, record.payload, Origin.LIVE))
    got = [r.seq for r in wanted]
    expected = list(range(live.first_seq, last + 1))
    if got != expected:
        missing = sorted(set(expected) - set(got))
        findings.append(Finding(
            "replay_reproduces_state", None, None, missing[0] if missing else None, 0, None,
            None, f"replay from seq {live.first_seq} gave seqs {_ranges(got)}, not "
                  f"{_ranges(expected)}"))
    ours, theirs = live.views(), rebuilt.views()
    for group, medium in sorted(set(ours) | set(theirs),
                                key=lambda p: _partition_key((p, None))):
        a = ours.get((group, medium), RouterView())
        b = theirs.get((group, medium), RouterView())
        if a.counts != b.counts or a.blocks != b.blocks:
            findings.append(Finding(
                "replay_reproduces_state", group, medium, last, 0, None, None,
                f"replay from seq {live.first_seq} to {last} rebuilds group {group} "
                f"medium {medium} differently: {_view_difference(a, b)}"))
    return findings


def replay_comparable(live: StreamFold, replayed: Sequence[Record]) -> bool:
    """Whether a replay reaches back to the live fold's first sequence number."""
    seqs = [r.seq for r in replayed if r.seq is not None]
    return live.first_seq is not None and bool(seqs) and min(seqs) <= live.first_seq


def _view_difference(live: RouterView, replay: RouterView) -> str:
    a, b = dict(live.counts), dict(replay.counts)
    differing = sorted(h for h in set(a) | set(b) if a.get(h, 0) != b.get(h, 0))
    if differing:
        shown = ", ".join(f"hash {h}: live {a.get(h, 0)}, replay {b.get(h, 0)}"
                          for h in differing[:5])
        more = f" (and {len(differing) - 5} more)" if len(differing) > 5 else ""
        return f"{len(differing)} hashes held differently ({shown}{more})"
    return "the same hashes, with different block contents"


def _ranges(seqs: Sequence[int | None]) -> str:
    """``0..4, 6..9`` for a list of sequence numbers."""
    numbers = [s for s in seqs if s is not None]
    if not numbers:
        return "none"
    parts: list[str] = []
    start = prev = numbers[0]
    for n in numbers[1:]:
        if n != prev + 1:
            parts.append(f"{start}..{prev}" if start != prev else f"{start}")
            start = n
        prev = n
    parts.append(f"{start}..{prev}" if start != prev else f"{start}")
    return ", ".join(parts)

