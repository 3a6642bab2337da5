"""A router's view of the KV events: what a consumer that sees only the event stream rebuilds.

A KV-aware router (vLLM's, llm-d's indexer) never sees a pool; it folds the events it takes
into a map from block hash to what it knows of the block: its parent in the chain, its token
ids, block size and LoRA. `router_view(events)` is that fold, and the predicates below are
what the router relies on, each checked on the whole stream a pool has emitted (the events
taken and those still pending) as a named invariant of the pool machine:

- `event_stored_covers_whole_blocks`: a BlockStored carries whole blocks of tokens, at least
  one block's worth per hash, so the router can split them by block.
- `event_removed_was_stored`: a BlockRemoved names a hash the router holds.
- `event_stored_parent_outside_its_blocks`: a BlockStored's parent is not one of its own
  blocks, so the chain the router links never loops.
- `event_stream_holds_every_copy`: counting stores less removes, the router holds every
  physical copy the pool has (`spec.events.copies_accounted` under the "full" report mode,
  which holds in both modes: the router sees no difference between a reused block's report
  and a new copy's store, so it must count both, and can only over-count).

The router reads the wire, not the pool: `router_view_of_bytes` decodes published batches
(`spec.events`) of either release, vLLM 0.13's array-encoded events or vLLM 0.33's
map-encoded ones, and folds them. A router that assumes arrays refuses every 0.33 batch
(`spec.events.read_event_array_only`; vLLM #42892 broke several that way).

Each takes a `PoolState` (only its events are read) and returns True when it holds.
Stated precisely, with what the spec (and vLLM) really emit:

- Tokens: a range being cached can hold null blocks (a sliding window's skipped blocks).
  They get no hash, but their tokens are in the event all the same, so a BlockStored can
  carry more whole blocks of tokens than hashes (finding R1 in docs/findings.md). A
  snapshot after a collapse (`spec.pool._bound_events`) carries no tokens at all.
- Parent: the parent is the chain hash of the block before the range, whatever became of
  that block: a null block (a slid-out window position) or an evicted one was never stored
  or is gone, so a router can be handed a parent it never saw (finding R2) and must not
  require one. A snapshot's BlockStored carry no parent.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvspec.spec.events import (
    ReportMode,
    WireEvent,
    copies_accounted,
    decode_batch,
    read_event,
    to_pool_event,
)
from kvspec.spec.pool import Cleared, Event, PoolState, Removed, Stored, external_hash


@dataclass(frozen=True)
class CachedBlock:
    """What a router knows of one cached block."""

    parent: int | None
    token_ids: tuple[int, ...]  # () for a snapshot's key-only BlockStored
    block_size: int
    lora_id: int | None


@dataclass(frozen=True)
class RouterView:
    """Per external hash: how many blocks hold it, and what the last BlockStored said."""

    counts: tuple[tuple[int, int], ...] = ()
    blocks: tuple[tuple[int, CachedBlock], ...] = ()


def fold_event(counts: Counter[int], blocks: dict[int, CachedBlock] | None,
               event: Event) -> tuple[int, ...]:
    """The router's fold of one event, in place: ``counts`` (hash -> blocks holding it, zero
    entries kept out) and, when given, ``blocks`` (what the last BlockStored said of each
    held hash). Returns the hashes a BlockRemoved named that the router did not hold at that
    point (each left at zero: a router cannot hold fewer than none). The one definition of
    the fold: `consume`, `event_removed_was_stored` and `spec.event_stream` all use it."""
    if isinstance(event, Cleared):
        counts.clear()
        if blocks is not None:
            blocks.clear()
        return ()
    unheld: list[int] = []
    if isinstance(event, Stored):
        parent = event.parent
        size = event.block_size
        for index, block_hash in enumerate(event.hashes):
            counts[block_hash] += 1
            if blocks is not None:
                tokens = event.token_ids[index * size:(index + 1) * size] if size > 0 else ()
                blocks[block_hash] = CachedBlock(parent, tuple(tokens), size, event.lora_id)
            parent = block_hash
    elif isinstance(event, Removed):
        for block_hash in event.hashes:
            if counts[block_hash] <= 0:
                unheld.append(block_hash)
            counts[block_hash] -= 1
            if counts[block_hash] <= 0:
                del counts[block_hash]
                if blocks is not None:
                    blocks.pop(block_hash, None)
    return tuple(unheld)


def consume(view: RouterView, event: Event) -> RouterView:
    """The router's view after one event.

    pre: all(n > 0 for _, n in view.counts)
    post: all(n > 0 for _, n in __return__.counts)
    """
    if isinstance(event, Cleared):
        return RouterView()
    counts, blocks = Counter(dict(view.counts)), dict(view.blocks)
    fold_event(counts, blocks, event)
    return RouterView(tuple(sorted(counts.items())), tuple(sorted(blocks.items())))


def router_view(events: Sequence[Event]) -> RouterView:
    """The fold of a whole event stream."""
    view = RouterView()
    for event in events:
        view = consume(view, event)
    return view


def stored_covers_whole_blocks(event: Stored) -> bool:
    """A BlockStored with tokens carries whole blocks of them, at least one per hash (a
    snapshot's key-only BlockStored carries none; null blocks' tokens make more blocks than
    hashes, finding R1; a vLLM 0.33 partial entry's block size is its own span).

    post: __return__ or len(event.token_ids) > 0
    """
    if not event.token_ids:
        return True
    size, n = event.block_size, len(event.token_ids)
    return not (size <= 0 or n % size or n < len(event.hashes) * size)


def stored_parent_outside_its_blocks(event: Stored) -> bool:
    """A BlockStored does not name one of its own blocks as their parent (a parent the router
    never saw is legal, finding R2).

    post: __return__ or event.parent is not None
    """
    return event.parent is None or event.parent not in event.hashes


def event_stored_covers_whole_blocks(state: PoolState) -> bool:
    """Every BlockStored with tokens carries whole blocks of them, at least one per hash (a
    snapshot's key-only BlockStored carries none)."""
    return all(stored_covers_whole_blocks(event) for event in state.events
               if isinstance(event, Stored))


def event_removed_was_stored(state: PoolState) -> bool:
    """Every hash a BlockRemoved names is held by the router at that point of the stream."""
    counts: Counter[int] = Counter()
    return not any(fold_event(counts, None, event) for event in state.events)


def event_stored_parent_outside_its_blocks(state: PoolState) -> bool:
    """No BlockStored names one of its own blocks as their parent: the chain does not loop."""
    return all(stored_parent_outside_its_blocks(event) for event in state.events
               if isinstance(event, Stored))


def _copies(state: PoolState) -> Counter[int]:
    """Each physical copy's external hash: one per key of each block (primary and, under
    vllm-0.33, partial)."""
    copies = Counter(external_hash(key) for key in state.key_of if key is not None)
    copies.update(external_hash(key) for _, keys in state.partial_keys for key in keys)
    return copies


def event_stream_holds_every_copy(state: PoolState) -> bool:
    """A router counting stores less removes (reports of reused blocks included: it cannot
    tell them apart) holds every copy the pool has, and no hash goes below zero."""
    if not state.enable_events:
        return True
    return copies_accounted(state.events, _copies(state), ReportMode.FULL)


def router_view_of_bytes(batches: Sequence[bytes],
                         reader: Callable[[Any], WireEvent] = read_event) -> RouterView:
    """The router's view after the published batches (each a KVEventBatch's bytes), every
    event read by ``reader`` (by default one that reads both releases' encodings)."""
    events: list[Event] = []
    for data in batches:
        events.extend(to_pool_event(e) for e in decode_batch(data, reader)[1])
    return router_view(events)


ALL: tuple[Callable[[PoolState], bool], ...] = (
    event_stored_covers_whole_blocks,
    event_removed_was_stored,
    event_stored_parent_outside_its_blocks,
    event_stream_holds_every_copy,
)


def violated(state: PoolState) -> list[str]:
    """The names of the router's properties the state's events break."""
    return [predicate.__name__ for predicate in ALL if not predicate(state)]
