"""The slot of one token: where the attention kernel writes that token's K and V.

Stated per token, over plain ints and tuples, so that each function reads as its definition
and CrossHair can check the contracts (``crosshair check --analysis_kind=PEP316``).

Terms (vLLM 0.13, vllm/v1/worker/block_table.py, ``BlockTable.compute_slot_mapping``):

* A *row* is the tuple of block ids a request holds, in order: block ``j`` of the row holds
  positions ``[j * block_size, (j + 1) * block_size)``.
* Standard case: ``slot = row[pos // block_size] * block_size + pos % block_size``.
* Context parallelism (CP) over ``world_size`` ranks with interleave ``interleave``: a row
  entry then stands for a *virtual block* of ``block_size * world_size`` positions, spread
  over the ranks in runs of ``interleave`` positions, round robin. Offset ``o`` into the
  virtual block belongs to rank ``(o // interleave) % world_size`` and lands at local offset
  ``(o // (world_size * interleave)) * interleave + o % interleave`` of that rank's physical
  block. A token another rank owns gets the padding slot -1 on this rank.
* Kernel blocks: when the attention kernel uses blocks of ``kernel_block_size`` that divide
  the manager's ``block_size``, manager block ``b`` becomes kernel blocks
  ``b*k .. b*k + k - 1`` (``k = block_size // kernel_block_size``) and the row is stated in
  kernel blocks; without CP every slot stays what it was.
* A batch of ``T`` tokens fills slots ``[0, T)`` of a buffer of ``num_slots``; every slot
  past the batch is the padding slot -1.
"""

from __future__ import annotations

from typing import Final

PAD_SLOT_ID: Final = -1

Row = tuple[int, ...]
Table = tuple[Row, ...]


def owner_rank(position: int, block_size: int, world_size: int, interleave: int) -> int:
    """The CP rank that stores the token at ``position``.

    pre: position >= 0
    pre: 1 <= block_size <= 64
    pre: 1 <= world_size <= 8
    pre: 1 <= interleave <= block_size
    pre: block_size % interleave == 0
    post: 0 <= __return__ < world_size
    post: world_size != 1 or __return__ == 0
    """
    offset = position % (block_size * world_size)
    return (offset // interleave) % world_size


def is_local(position: int, block_size: int, world_size: int, rank: int, interleave: int) -> bool:
    """Whether rank ``rank`` stores the token at ``position``.

    pre: position >= 0
    pre: 1 <= block_size <= 64
    pre: 1 <= world_size <= 8
    pre: 0 <= rank < world_size
    pre: 1 <= interleave <= block_size
    pre: block_size % interleave == 0
    post: __return__ == (owner_rank(position, block_size, world_size, interleave) == rank)
    post: world_size != 1 or __return__
    """
    return owner_rank(position, block_size, world_size, interleave) == rank


def local_offset(position: int, block_size: int, world_size: int, interleave: int) -> int:
    """The offset of ``position`` inside its owner's physical block.

    pre: position >= 0
    pre: 1 <= block_size <= 64
    pre: 1 <= world_size <= 8
    pre: 1 <= interleave <= block_size
    pre: block_size % interleave == 0
    post: 0 <= __return__ < block_size and (world_size != 1 or __return__ == position % block_size)
    """
    offset = position % (block_size * world_size)
    return (offset // (world_size * interleave)) * interleave + offset % interleave


def rank_block_layout(block_size: int, world_size: int, rank: int, interleave: int) -> Row:
    """The local offsets of the positions of one virtual block that ``rank`` stores, in
    position order: they fill the rank's physical block exactly, in order.

    pre: 1 <= block_size <= 8
    pre: 1 <= world_size <= 4
    pre: 0 <= rank < world_size
    pre: 1 <= interleave <= block_size
    pre: block_size % interleave == 0
    post: __return__ == tuple(range(block_size))
    """
    return tuple(
        local_offset(offset, block_size, world_size, interleave)
        for offset in range(block_size * world_size)
        if is_local(offset, block_size, world_size, rank, interleave)
    )


def token_slot(
    row: Row,
    position: int,
    block_size: int,
    world_size: int = 1,
    rank: int = 0,
    interleave: int = 1,
) -> int:
    """The slot of the token at ``position`` of a request whose row is ``row``, on ``rank``.

    pre: position >= 0
    pre: 1 <= block_size <= 64
    pre: 1 <= world_size <= 8
    pre: 0 <= rank < world_size
    pre: 1 <= interleave <= block_size
    pre: block_size % interleave == 0
    pre: position // (block_size * world_size) < len(row)
    pre: all(block >= 0 for block in row)
    post: (__return__ == PAD_SLOT_ID) == (not is_local(position, block_size, world_size, rank, interleave))  and (__return__ == PAD_SLOT_ID or __return__ // block_size == row[position // (block_size * world_size)])  and (world_size != 1 or __return__ == row[position // block_size] * block_size + position % block_size)
    """  # noqa: E501
    if not is_local(position, block_size, world_size, rank, interleave):
        return PAD_SLOT_ID
    block = row[position // (block_size * world_size)]
    return block * block_size + local_offset(position, block_size, world_size, interleave)


def two_token_slots(
    row: Row,
    first: int,
    second: int,
    block_size: int,
    world_size: int,
    rank: int,
    interleave: int,
) -> tuple[int, int]:
    """The slots of two tokens of one request: distinct tokens never share a slot.

    This is the property that keeps one token from overwriting another's KV entry.

    pre: 0 <= first and 0 <= second
    pre: 1 <= block_size <= 64
    pre: 1 <= world_size <= 8
    pre: 0 <= rank < world_size
    pre: 1 <= interleave <= block_size
    pre: block_size % interleave == 0
    pre: first // (block_size * world_size) < len(row)
    pre: second // (block_size * world_size) < len(row)
    pre: all(block >= 0 for block in row)
    pre: len(set(row)) == len(row)
    post: first == second or __return__[0] == PAD_SLOT_ID or __return__[0] != __return__[1]
    """
    return (
        token_slot(row, first, block_size, world_size, rank, interleave),
        token_slot(row, second, block_size, world_size, rank, interleave),
    )


def kernel_row(row: Row, blocks_per_kv_block: int) -> Row:
    """The row in kernel blocks: manager block ``b`` becomes ``b*k .. b*k + k - 1``.

    pre: 1 <= blocks_per_kv_block <= 8
    pre: len(row) <= 4
    pre: all(block >= 0 for block in row)
    post: len(__return__) == len(row) * blocks_per_kv_block
    post: all(__return__[i] == row[i // blocks_per_kv_block] * blocks_per_kv_block + i % blocks_per_kv_block for i in range(len(__return__)))
    """  # noqa: E501
    return tuple(
        block * blocks_per_kv_block + j for block in row for j in range(blocks_per_kv_block)
    )


def expanded_token_slot(
    row: Row,
    position: int,
    block_size: int,
    kernel_block_size: int,
    world_size: int = 1,
    rank: int = 0,
    interleave: int = 1,
) -> int:
    """The slot of a token when the kernel uses ``kernel_block_size`` blocks.

    ``row`` holds manager block ids of ``block_size`` tokens; the table stores the kernel row
    and every slot is computed in kernel blocks. Without CP the slot is unchanged.

    pre: position >= 0
    pre: 1 <= kernel_block_size <= block_size <= 64
    pre: block_size % kernel_block_size == 0
    pre: block_size // kernel_block_size <= 8
    pre: 1 <= world_size <= 8
    pre: 0 <= rank < world_size
    pre: 1 <= interleave <= kernel_block_size
    pre: kernel_block_size % interleave == 0
    pre: position // (kernel_block_size * world_size) < len(row) * (block_size // kernel_block_size)
    pre: len(row) <= 4
    pre: all(block >= 0 for block in row)
    post: world_size != 1 or __return__ == token_slot(row, position, block_size)
    """
    blocks_per_kv_block = block_size // kernel_block_size
    return token_slot(
        kernel_row(row, blocks_per_kv_block), position, kernel_block_size, world_size, rank,
        interleave,
    )


def batch_slot_mapping(
    table: Table,
    req_indices: tuple[int, ...],
    positions: tuple[int, ...],
    block_size: int,
    num_slots: int,
    world_size: int = 1,
    rank: int = 0,
    interleave: int = 1,
) -> tuple[int, ...]:
    """The slot-mapping buffer for a batch: token ``t`` of row ``req_indices[t]`` at
    ``positions[t]``, then padding up to ``num_slots``.

    pre: len(req_indices) == len(positions) <= num_slots
    pre: 1 <= block_size <= 64
    pre: 1 <= world_size <= 8
    pre: 0 <= rank < world_size
    pre: 1 <= interleave <= block_size
    pre: block_size % interleave == 0
    pre: all(0 <= r < len(table) for r in req_indices)
    pre: all(p >= 0 for p in positions)
    pre: all(p // (block_size * world_size) < len(table[r]) for r, p in zip(req_indices, positions))
    pre: all(block >= 0 for row in table for block in row)
    post: len(__return__) == num_slots and all(slot == PAD_SLOT_ID for slot in __return__[len(positions):])
    """  # noqa: E501
    slots = tuple(
        token_slot(table[row], position, block_size, world_size, rank, interleave)
        for row, position in zip(req_indices, positions, strict=True)
    )
    return slots + (PAD_SLOT_ID,) * (num_slots - len(slots))
