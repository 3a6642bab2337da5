"""The prefix-cache map, as an executable model (BlockHashToBlockMap, vllm/v1/core/block_pool.py).

vLLM's ``BlockHashToBlockMap`` maps a key (``BlockHashWithGroupId``: a block hash followed by
the 4-byte group id) to the blocks cached under it. The same content may be cached in
several blocks (block tables are append-only, so there is no de-duplication), and
``get_one_block`` answers with the first of them still there. Its API:

* ``insert(key, block)``: the block joins the key's blocks, last;
* ``get_one_block(key)``: the first block under the key, or None;
* ``pop(key, block_id)``: the block with that id leaves the key's blocks and is returned,
  or None when the key does not hold it (not a refusal: vLLM returns None);
* ``len(map)``: the number of keys that hold blocks.

kvspec's contract, modelled here, refuses what would break the map's invariants or is not a
key: a key that is not bytes of at least 4 bytes, a block id that is not an int, and a
block that is already in the map (under this key or another: a block has one key, and the
pool evicts it before keying it again). vLLM's map accepts all of these (a dict keyed by
block id under a hashable key); the audit reports it.

State is `MapState`: ``(key, blocks)`` pairs, blocks first inserted first, keys in the order
they were first inserted. A target's view (`view_of`) is a dict, key -> block ids.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

BlockId = int
Key = bytes
MapView = dict[object, tuple[BlockId, ...]]
KEY_SUFFIX_BYTES = 4  # the group id, big-endian, after the block hash


# --- Refusals ----------------------------------------------------------------------------------


class HashMapError(Exception):
    """A call the map must refuse; the map is unchanged."""


class BadKey(HashMapError, ValueError):
    """A key that is not bytes of at least 4 bytes (hash + group id)."""


class BadBlockId(HashMapError, LookupError):
    """A block id that is not an int, or names none of the program's blocks."""


class AlreadyMapped(HashMapError, ValueError):
    """Inserting a block that the map already holds, under this key or another."""


# --- State -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MapState:
    num_blocks: int  # the block objects a program may insert: ids 0 .. num_blocks - 1
    entries: tuple[tuple[object, tuple[BlockId, ...]], ...] = ()  # key -> blocks, in order


def view_of(state: MapState) -> MapView:
    """What a target shows: key -> its block ids, first inserted first."""
    return dict(state.entries)


def from_view(num_blocks: int, view: MapView) -> MapState:
    """A target's view as a state, so that the named invariants can judge it."""
    return MapState(num_blocks, tuple((key, tuple(blocks)) for key, blocks in view.items()))


# --- Commands ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class NewMap:
    """``BlockHashToBlockMap()``, with ``num_blocks`` block objects for the program to insert."""

    num_blocks: int


@dataclass(frozen=True)
class Insert:
    key: object  # a Key; the bad calls pass what is not one
    block_id: BlockId


@dataclass(frozen=True)
class GetOneBlock:
    key: object


@dataclass(frozen=True)
class Pop:
    key: object
    block_id: object  # a BlockId; the bad calls pass what is not one


@dataclass(frozen=True)
class Contain:
    """vLLM 0.33's ``contain(key, block_id)``: whether the key holds that block."""

    key: object
    block_id: object


@dataclass(frozen=True)
class Len:
    pass


Command = NewMap | Insert | GetOneBlock | Pop | Len | Contain


# --- Operations --------------------------------------------------------------------------------


def is_key(key: object) -> bool:
    """A key is bytes: a block hash, then the 4-byte group id."""
    return type(key) is bytes and len(key) >= KEY_SUFFIX_BYTES


def _check_key(key: object) -> Key:
    if not is_key(key):
        raise BadKey(f"a key must be bytes of length >= {KEY_SUFFIX_BYTES} (block hash + "
                     f"group id), got {key!r}")
    return key  # type: ignore[return-value]


def blocks_under(state: MapState, key: object) -> tuple[BlockId, ...]:
    """The blocks under key, first inserted first (none: ())."""
    return dict(state.entries).get(key, ())


def _with_blocks_under(state: MapState, key: object, blocks: tuple[BlockId, ...]) -> MapState:
    """key's blocks replaced; a key left with none leaves the map (no empty entries)."""
    keys = [k for k, _ in state.entries]
    if key in keys:
        entries = [(k, blocks if k == key else v) for k, v in state.entries]
    else:
        entries = [*state.entries, (key, blocks)]
    return MapState(state.num_blocks, tuple((k, v) for k, v in entries if v))


def insert(state: MapState, key: object, block_id: BlockId) -> MapState:
    """The block joins key's blocks, last.

    pre: all(blocks for _, blocks in state.entries)
    raises: HashMapError
    post: blocks_under(__return__, key)[-1] == block_id
    """
    _check_key(key)
    if type(block_id) is not int or not 0 <= block_id < state.num_blocks:
        raise BadBlockId(f"block {block_id!r} is not one of the {state.num_blocks} blocks")
    for mapped_key, blocks in state.entries:
        if block_id in blocks:
            raise AlreadyMapped(f"block {block_id} is already cached under key {mapped_key!r}")
    return _with_blocks_under(state, key, blocks_under(state, key) + (block_id,))


def get_one_block(state: MapState, key: object) -> BlockId | None:
    """The first block still under key, or None.

    raises: HashMapError
    post: __return__ is None or __return__ in blocks_under(state, key)
    """
    _check_key(key)
    blocks = blocks_under(state, key)
    return blocks[0] if blocks else None


def contain(state: MapState, key: object, block_id: object) -> bool:
    """vLLM 0.33: whether key holds the block with that id (the pool asks before keying a
    block, so that a key is never listed twice for one block).

    raises: HashMapError
    post: __return__ == (block_id in blocks_under(state, key))
    """
    _check_key(key)
    if type(block_id) is not int:
        raise BadBlockId(f"a block id must be an int, got {block_id!r}")
    return block_id in blocks_under(state, key)


def pop(state: MapState, key: object, block_id: object) -> tuple[MapState, BlockId | None]:
    """The block with that id leaves key's blocks and is returned; None (and no change) when
    key does not hold it.

    raises: HashMapError
    post: block_id not in blocks_under(__return__[0], key)
    """
    _check_key(key)
    if type(block_id) is not int:
        raise BadBlockId(f"a block id must be an int, got {block_id!r}")
    blocks = blocks_under(state, key)
    if block_id not in blocks:
        return state, None
    return _with_blocks_under(state, key, tuple(b for b in blocks if b != block_id)), block_id


def step(state: MapState | None, command: Command) -> tuple[MapState, object]:
    """One command on the map: the new state and the output in the spec's terms (a block id
    or None for a block, an int for ``len``). A program starts with `NewMap`."""
    if isinstance(command, NewMap):
        if type(command.num_blocks) is not int or command.num_blocks < 0:
            raise BadBlockId(f"a program has a number of blocks >= 0, got "
                             f"{command.num_blocks!r}")
        return MapState(command.num_blocks), None
    if state is None:
        raise TypeError(f"a hash-map program starts with NewMap, not {command!r}")
    if isinstance(command, Insert):
        return insert(state, command.key, command.block_id), None
    if isinstance(command, GetOneBlock):
        return state, get_one_block(state, command.key)
    if isinstance(command, Pop):
        return pop(state, command.key, command.block_id)
    if isinstance(command, Len):
        return state, len(state.entries)
    if isinstance(command, Contain):
        return state, contain(state, command.key, command.block_id)
    raise TypeError(f"not a hash-map command: {command!r}")


# --- Invariants --------------------------------------------------------------------------------


def no_empty_entry(state: MapState) -> bool:
    """Every key in the map holds at least one block (pop removes a key with its last block,
    so that len() counts keys that can hit)."""
    return all(blocks for _, blocks in state.entries)


def no_block_twice(state: MapState) -> bool:
    """No block is under two keys, nor twice under one."""
    listed = [b for _, blocks in state.entries for b in blocks]
    return len(listed) == len(set(listed))


def keys_well_formed(state: MapState) -> bool:
    """Every key is bytes: a block hash and a 4-byte group id."""
    return all(is_key(key) for key, _ in state.entries)


def blocks_within_pool(state: MapState) -> bool:
    """Every mapped block is one of the program's blocks."""
    return all(type(b) is int and 0 <= b < state.num_blocks
               for _, blocks in state.entries for b in blocks)


Invariant = Callable[[MapState], bool]

ALL: tuple[Invariant, ...] = (no_empty_entry, no_block_twice, keys_well_formed,
                              blocks_within_pool)


def violated(state: MapState) -> list[str]:
    """The names of the invariants that do not hold in state."""
    return [inv.__name__ for inv in ALL if not inv(state)]
