"""The free-block queue, as an executable model (vllm/v1/core/kv_cache_utils.py, 0.13).

vLLM keeps the free blocks of a pool in ``FreeKVCacheBlockQueue``: a doubly linked list
threaded through the block objects, head (reused next, least recently freed) first. The
pool is its only caller in vLLM, and the pool never hands it a bad call; kvspec's queue is
also used on its own (vLLM's tests build one from a list of blocks), so its contract is the
stricter one modelled here: **every bad call is refused with a typed error that names the
value, and changes nothing**. The checker runs this model against a target queue one
command at a time (`conformance.free_queue_machine`); where vLLM corrupts its list or
asserts instead, the audit reports the difference.

State is `QueueState`: the pool's size (the block objects the queue's members come from,
ids ``0 .. num_blocks - 1``), the free order as a tuple of block ids, and the count the
queue reports. The count is redundant here (`step` keeps it equal to the order's length) but
a target's state read back in these terms may break that, which `count_matches_entries`
names. Invariants are the named predicates at the bottom, `ALL`, and `violated`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

BlockId = int
QueueView = tuple[tuple[BlockId, ...], int]  # (free order head first, num_free_blocks)


# --- Refusals: every bad call raises one of these, before anything changes. -------------------


class FreeQueueError(Exception):
    """A call the free queue must refuse; the queue is unchanged."""


class NoFreeBlocks(FreeQueueError, ValueError):
    """popleft on an empty queue, or popleft_n of more blocks than are free (vLLM's popleft
    raises ``ValueError("No free blocks available")``)."""


class BadCount(FreeQueueError, ValueError):
    """popleft_n given a count that is negative or not an int."""


class NotQueued(FreeQueueError, LookupError):
    """remove of a block that is not in the queue."""


class AlreadyQueued(FreeQueueError, ValueError):
    """append/append_n of a block that is already queued, or listed twice in one call."""


class OutOfPool(FreeQueueError, LookupError):
    """A block id that names none of the pool's block objects."""


class BadQueue(FreeQueueError, ValueError):
    """A queue that cannot be built: a negative pool size, a block listed twice."""


# --- State -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QueueState:
    num_blocks: int  # the block objects the program may name: ids 0 .. num_blocks - 1
    free: tuple[BlockId, ...]  # the free order: head (next to pop) first
    num_free: int  # what num_free_blocks reports; the spec keeps it len(free)


def view_of(state: QueueState) -> QueueView:
    """What a target shows of its state: the free order and num_free_blocks."""
    return state.free, state.num_free


def from_view(num_blocks: int, view: QueueView) -> QueueState:
    """A target's view as a state, so that the named invariants can judge it."""
    free, num_free = view
    return QueueState(num_blocks, tuple(free), num_free)


# --- Commands: one per call of vLLM's FreeKVCacheBlockQueue API --------------------------------


@dataclass(frozen=True)
class NewQueue:
    """``FreeKVCacheBlockQueue([blocks[i] for i in initial])`` over ``num_blocks`` blocks."""

    num_blocks: int
    initial: tuple[BlockId, ...]


@dataclass(frozen=True)
class PopLeft:
    pass


@dataclass(frozen=True)
class PopLeftN:
    n: int | float | str  # the bad calls pass what is not an int


@dataclass(frozen=True)
class Remove:
    block_id: BlockId


@dataclass(frozen=True)
class Append:
    block_id: BlockId


@dataclass(frozen=True)
class AppendN:
    block_ids: tuple[BlockId, ...]


@dataclass(frozen=True)
class PrependN:
    """vLLM 0.33's ``prepend_n``: blocks to reuse first (freed without a key)."""

    block_ids: tuple[BlockId, ...]


@dataclass(frozen=True)
class GetAllFreeBlocks:
    pass


@dataclass(frozen=True)
class NumFreeBlocks:
    pass


Command = (NewQueue | PopLeft | PopLeftN | Remove | Append | AppendN | GetAllFreeBlocks
           | NumFreeBlocks | PrependN)


# --- Operations: small pure functions ----------------------------------------------------------


def _check_ids(num_blocks: int, block_ids: Iterable[BlockId]) -> None:
    for block in block_ids:
        if type(block) is not int or not 0 <= block < num_blocks:
            raise OutOfPool(f"block {block!r} is not one of the pool's {num_blocks} blocks")


def _check_unlisted(block_ids: tuple[BlockId, ...]) -> None:
    """No block may be handed over twice in one call: the queue would hold it twice."""
    for position, block in enumerate(block_ids):
        if block in block_ids[:position]:
            raise AlreadyQueued(f"block {block} is listed twice in {list(block_ids)}")


def new_queue(num_blocks: int, initial: tuple[BlockId, ...]) -> QueueState:
    """The queue built from the listed blocks, in the order listed (vLLM's constructor).

    pre: 0 <= num_blocks <= 16
    raises: FreeQueueError
    post: __return__.free == initial
    """
    if type(num_blocks) is not int or num_blocks < 0:
        raise BadQueue(f"a pool has a number of blocks >= 0, got {num_blocks!r}")
    _check_ids(num_blocks, initial)
    if len(set(initial)) != len(initial):
        twice = next(b for i, b in enumerate(initial) if b in initial[:i])
        raise BadQueue(f"block {twice} is listed twice in {list(initial)}")
    return QueueState(num_blocks, tuple(initial), len(initial))


def popleft_n(state: QueueState, n: int | float | str) -> tuple[QueueState, tuple[BlockId, ...]]:
    """Take the first n blocks from the head, in order.

    A count that is not an int (``True`` neither) or is negative is refused: vLLM's loop
    would run ``range(n)`` after it has already lowered its count.

    pre: state.num_free == len(state.free)
    raises: FreeQueueError
    post: __return__[1] + __return__[0].free == state.free
    """
    if type(n) is not int or n < 0:
        raise BadCount(f"the number of blocks to pop must be an int >= 0, got {n!r}")
    if n > len(state.free):
        raise NoFreeBlocks(f"cannot pop {n} blocks from a free queue of {len(state.free)}")
    return replace(state, free=state.free[n:], num_free=state.num_free - n), state.free[:n]


def popleft(state: QueueState) -> tuple[QueueState, BlockId]:
    """Take the head block.

    pre: state.num_free == len(state.free)
    raises: FreeQueueError
    post: (__return__[1],) + __return__[0].free == state.free
    """
    if not state.free:
        raise NoFreeBlocks("No free blocks available")
    new_state, taken = popleft_n(state, 1)
    return new_state, taken[0]


def remove(state: QueueState, block_id: BlockId) -> QueueState:
    """Take a queued block out from wherever it is (a prefix-cache hit on a free block).

    pre: state.num_free == len(state.free)
    raises: FreeQueueError
    post: __return__.free == tuple(b for b in state.free if b != block_id)
    """
    _check_ids(state.num_blocks, (block_id,))
    if block_id not in state.free:
        raise NotQueued(f"block {block_id} is not in the free queue")
    free = tuple(b for b in state.free if b != block_id)
    return replace(state, free=free, num_free=state.num_free - 1)


def append_n(state: QueueState, block_ids: tuple[BlockId, ...]) -> QueueState:
    """Put blocks at the tail, in the order given (a finished request's blocks). All or none:
    a queued block, or one listed twice, refuses the whole call.

    pre: state.num_free == len(state.free)
    raises: FreeQueueError
    post: __return__.free == state.free + block_ids
    """
    block_ids = tuple(block_ids)
    _check_ids(state.num_blocks, block_ids)
    _check_unlisted(block_ids)
    for block in block_ids:
        if block in state.free:
            raise AlreadyQueued(f"block {block} is already in the free queue")
    return replace(state, free=state.free + block_ids, num_free=state.num_free + len(block_ids))


def prepend_n(state: QueueState, block_ids: tuple[BlockId, ...]) -> QueueState:
    """vLLM 0.33: put blocks at the head, in the order given (the first given is the next
    popped). All or none, as append_n.

    pre: state.num_free == len(state.free)
    raises: FreeQueueError
    post: __return__.free == tuple(block_ids) + state.free
    """
    block_ids = tuple(block_ids)
    _check_ids(state.num_blocks, block_ids)
    _check_unlisted(block_ids)
    for block in block_ids:
        if block in state.free:
            raise AlreadyQueued(f"block {block} is already in the free queue")
    return replace(state, free=block_ids + state.free, num_free=state.num_free + len(block_ids))


def append(state: QueueState, block_id: BlockId) -> QueueState:
    """Put one block at the tail.

    pre: state.num_free == len(state.free)
    raises: FreeQueueError
    post: __return__.free == state.free + (block_id,)
    """
    return append_n(state, (block_id,))


def step(state: QueueState | None, command: Command) -> tuple[QueueState, object]:
    """One command on the queue: the new state and the command's output in the spec's terms
    (block ids for blocks, None for a call that returns nothing). A program starts with
    `NewQueue`; a refused call raises a `FreeQueueError` and changes nothing."""
    if isinstance(command, NewQueue):
        return new_queue(command.num_blocks, command.initial), None
    if state is None:
        raise TypeError(f"a free-queue program starts with NewQueue, not {command!r}")
    if isinstance(command, PopLeft):
        return popleft(state)
    if isinstance(command, PopLeftN):
        return popleft_n(state, command.n)
    if isinstance(command, Remove):
        return remove(state, command.block_id), None
    if isinstance(command, Append):
        return append(state, command.block_id), None
    if isinstance(command, AppendN):
        return append_n(state, command.block_ids), None
    if isinstance(command, PrependN):
        return prepend_n(state, command.block_ids), None
    if isinstance(command, GetAllFreeBlocks):
        return state, state.free
    if isinstance(command, NumFreeBlocks):
        return state, state.num_free
    raise TypeError(f"not a free-queue command: {command!r}")


# --- Invariants: one named predicate per property ----------------------------------------------


def no_block_twice(state: QueueState) -> bool:
    """No block is in the free order twice (a block is free or not; vLLM's list can link one
    twice when it is appended while queued)."""
    return len(set(state.free)) == len(state.free)


def within_pool(state: QueueState) -> bool:
    """Every queued block is one of the pool's blocks (never a sentinel, id -1)."""
    return all(type(b) is int and 0 <= b < state.num_blocks for b in state.free)


def count_matches_entries(state: QueueState) -> bool:
    """num_free_blocks is the number of blocks in the free order."""
    return state.num_free == len(state.free)


def count_within_pool(state: QueueState) -> bool:
    """0 <= num_free_blocks <= the pool's size."""
    return 0 <= state.num_free <= state.num_blocks


Invariant = Callable[[QueueState], bool]

ALL: tuple[Invariant, ...] = (no_block_twice, within_pool, count_matches_entries,
                              count_within_pool)


def violated(state: QueueState) -> list[str]:
    """The names of the invariants that do not hold in state."""
    return [inv.__name__ for inv in ALL if not inv(state)]
