"""The worker block table's row operations as pure functions on an immutable table.

A table is a tuple of rows; row ``r`` is the tuple of (manager) block ids request slot ``r``
holds, in order. vLLM 0.13 keeps the rows in a fixed-width int32 matrix plus a count per row
(vllm/v1/worker/block_table.py; seed 003 section 5.2); this model keeps only what a reader
of the table may rely on: the first ``count`` entries of each row. What lies past a row's
count (stale entries ``add_row`` and ``move_row`` leave behind) is not part of the model.

Operations (each returns a new table; a refused call raises and changes nothing):

* ``add_row(r, ids)``: row ``r`` becomes ``ids``.
* ``append_row(r, ids)``: ``ids`` are appended to row ``r``.
* ``move_row(src, tgt)``: row ``tgt`` becomes a copy of row ``src``; ``src`` is kept (0.13).
* ``swap_row(a, b)``: rows ``a`` and ``b`` trade places.
* ``clear_row(r)``: row ``r`` becomes empty.
* ``cleared(table)`` (``BlockTable.clear()``): every entry becomes block 0, lengths kept.

Limits: ``num_rows`` rows; at most ``max_blocks_per_row`` manager blocks a row; block ids in
``[0, num_blocks)`` when the pool size is known, and small enough that every kernel block id
``b * blocks_per_kv_block + j`` fits the table's int32 (a pool larger than that is refused).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

Row = tuple[int, ...]
Table = tuple[Row, ...]

INT32_LIMIT = 2**31


class BlockTableModelError(Exception):
    """A row operation the table refused; the table is unchanged."""


class RowIndexError(BlockTableModelError, IndexError):
    """A row index outside ``[0, num_rows)``."""


class RowCapacityError(BlockTableModelError, ValueError):
    """A row would hold more than ``max_blocks_per_row`` blocks."""


class BlockIdError(BlockTableModelError, ValueError):
    """A block id outside the pool (or too large for an int32 kernel block id)."""


class InvalidLimitsError(BlockTableModelError, ValueError):
    """Limits no table can have: no rows, a negative width, an empty pool, a pool whose
    kernel block ids do not fit int32."""


@dataclass(frozen=True)
class TableLimits:
    num_rows: int
    max_blocks_per_row: int
    num_blocks: int | None = None
    blocks_per_kv_block: int = 1

    def __post_init__(self) -> None:
        if self.num_rows < 1:
            raise InvalidLimitsError(f"num_rows={self.num_rows} must be at least 1")
        if self.max_blocks_per_row < 0:
            raise InvalidLimitsError(
                f"max_blocks_per_row={self.max_blocks_per_row} must not be negative"
            )
        if self.num_blocks is not None and self.num_blocks < 1:
            raise InvalidLimitsError(f"num_blocks={self.num_blocks} must be at least 1")
        if self.blocks_per_kv_block < 1:
            raise InvalidLimitsError(
                f"blocks_per_kv_block={self.blocks_per_kv_block} must be at least 1"
            )
        int32_bound = INT32_LIMIT // self.blocks_per_kv_block
        if self.num_blocks is not None and self.num_blocks > int32_bound:
            raise InvalidLimitsError(
                f"num_blocks={self.num_blocks}: the kernel block ids of at most "
                f"{int32_bound} blocks fit int32"
            )

    @property
    def block_id_limit(self) -> int:
        """One past the largest block id a row may hold."""
        if self.num_blocks is None:
            return INT32_LIMIT // self.blocks_per_kv_block
        return self.num_blocks


# --- invariants ----------------------------------------------------------------------------


def has_one_row_per_slot(table: Table, limits: TableLimits) -> bool:
    """The table has exactly ``num_rows`` rows."""
    return len(table) == limits.num_rows


def rows_within_capacity(table: Table, limits: TableLimits) -> bool:
    """No row holds more than ``max_blocks_per_row`` blocks."""
    return all(len(row) <= limits.max_blocks_per_row for row in table)


def block_ids_in_pool(table: Table, limits: TableLimits) -> bool:
    """Every block id is in ``[0, block_id_limit)``."""
    return all(0 <= block < limits.block_id_limit for row in table for block in row)


INVARIANTS: dict[str, Callable[[Table, TableLimits], bool]] = {
    "has_one_row_per_slot": has_one_row_per_slot,
    "rows_within_capacity": rows_within_capacity,
    "block_ids_in_pool": block_ids_in_pool,
}


def violated_invariants(table: Table, limits: TableLimits) -> list[str]:
    """The names of the invariants ``table`` breaks (empty when it is well formed)."""
    return [name for name, holds in INVARIANTS.items() if not holds(table, limits)]


# --- checks, in the order the implementation must apply them ------------------------------


def check_row(limits: TableLimits, row: int) -> None:
    if not 0 <= row < limits.num_rows:
        raise RowIndexError(f"row index {row} is outside [0, {limits.num_rows})")


def check_block_ids(limits: TableLimits, block_ids: Sequence[int]) -> None:
    for block in block_ids:
        if not 0 <= block < limits.block_id_limit:
            raise BlockIdError(f"block id {block} is outside [0, {limits.block_id_limit})")


def check_capacity(limits: TableLimits, row: int, num_blocks: int) -> None:
    if num_blocks > limits.max_blocks_per_row:
        raise RowCapacityError(
            f"row {row} would hold {num_blocks} blocks, more than "
            f"max_num_blocks_per_req={limits.max_blocks_per_row}"
        )


# --- operations ----------------------------------------------------------------------------


def empty_table(limits: TableLimits) -> Table:
    """The table of a fresh BlockTable: every row empty.

    post: violated_invariants(__return__, limits) == []
    """
    return ((),) * limits.num_rows


def _replace(table: Table, row: int, contents: Row) -> Table:
    return (*table[:row], contents, *table[row + 1 :])


def add_row(table: Table, limits: TableLimits, row: int, block_ids: Sequence[int]) -> Table:
    """Row ``row`` becomes ``block_ids``.

    pre: violated_invariants(table, limits) == []
    post: violated_invariants(__return__, limits) == []
    post: __return__[row] == tuple(block_ids)
    raises: BlockTableModelError
    """
    check_row(limits, row)
    check_block_ids(limits, block_ids)
    check_capacity(limits, row, len(block_ids))
    return _replace(table, row, tuple(block_ids))


def append_row(table: Table, limits: TableLimits, row: int, block_ids: Sequence[int]) -> Table:
    """``block_ids`` are appended to row ``row``.

    pre: violated_invariants(table, limits) == []
    post: violated_invariants(__return__, limits) == []
    post: __return__[row] == table[row] + tuple(block_ids)
    raises: BlockTableModelError
    """
    check_row(limits, row)
    check_block_ids(limits, block_ids)
    check_capacity(limits, row, len(table[row]) + len(block_ids))
    return _replace(table, row, table[row] + tuple(block_ids))


def move_row(table: Table, limits: TableLimits, src: int, tgt: int) -> Table:
    """Row ``tgt`` becomes a copy of row ``src``; row ``src`` is kept.

    pre: violated_invariants(table, limits) == []
    post: violated_invariants(__return__, limits) == []
    post: __return__[tgt] == table[src] == __return__[src]
    raises: BlockTableModelError
    """
    check_row(limits, src)
    check_row(limits, tgt)
    return _replace(table, tgt, table[src])


def swap_row(table: Table, limits: TableLimits, src: int, tgt: int) -> Table:
    """Rows ``src`` and ``tgt`` trade places.

    pre: violated_invariants(table, limits) == []
    post: violated_invariants(__return__, limits) == []
    post: __return__[src] == table[tgt] and __return__[tgt] == table[src]
    raises: BlockTableModelError
    """
    check_row(limits, src)
    check_row(limits, tgt)
    swapped = list(table)
    swapped[src], swapped[tgt] = table[tgt], table[src]
    return tuple(swapped)


def clear_row(table: Table, limits: TableLimits, row: int) -> Table:
    """Row ``row`` becomes empty.

    pre: violated_invariants(table, limits) == []
    post: violated_invariants(__return__, limits) == []
    post: __return__[row] == ()
    raises: BlockTableModelError
    """
    check_row(limits, row)
    return _replace(table, row, ())


def cleared(table: Table) -> Table:
    """The table after ``BlockTable.clear()``: every entry is block 0, lengths kept.

    post: all(len(new) == len(old) for new, old in zip(__return__, table))
    """
    return tuple((0,) * len(row) for row in table)
