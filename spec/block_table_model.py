"""The worker block table's row operations as pure functions on an immutable table.

A table is a tuple of rows; row ``r`` is the tuple of (manager) block ids request slot ``r``
holds, in order. vLLM 0.13 keeps the rows in a fixed-width int32 matrix plus a count per row
(vllm/v1/worker/block_table.py, ``BlockTable``); this model keeps only what a reader
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


# --- Operations as data (conformance.lockstep) ----------------------------------------------
# The worker's MultiGroupBlockTable: every group's table changes together (a refusal in one
# group changes none), and a batch's slot mapping is computed for every group.


class BadBatchError(BlockTableModelError, ValueError):
    """A slot-mapping batch whose rows and positions do not pair up, or name a position no
    block of its row holds."""


@dataclass(frozen=True)
class NewTables:
    """Build a MultiGroupBlockTable: one table per KV-cache group."""

    block_sizes: tuple[int, ...]
    kernel_block_sizes: tuple[int, ...]
    num_rows: int
    max_blocks_per_row: int
    num_blocks: int
    num_slots: int
    dcp_world_size: int = 1
    dcp_rank: int = 0
    interleave: int = 1
    backend: str = "numpy"


@dataclass(frozen=True)
class AddRow:
    row: int
    block_ids: tuple[tuple[int, ...], ...]  # per group


@dataclass(frozen=True)
class AppendRow:
    row: int
    block_ids: tuple[tuple[int, ...], ...]  # per group


@dataclass(frozen=True)
class MoveRow:
    src: int
    tgt: int


@dataclass(frozen=True)
class SwapRow:
    src: int
    tgt: int


@dataclass(frozen=True)
class ClearRow:
    row: int


@dataclass(frozen=True)
class CommitBlockTable:
    num_reqs: int


@dataclass(frozen=True)
class ComputeSlotMapping:
    """compute_slot_mapping, then commit_slot_mapping: the batch's slots, per group."""

    req_indices: tuple[int, ...]
    positions: tuple[int, ...]


TableCommand = (NewTables | AddRow | AppendRow | MoveRow | SwapRow | ClearRow
                | CommitBlockTable | ComputeSlotMapping)


@dataclass(frozen=True)
class TablesState:
    config: NewTables
    limits: tuple[TableLimits, ...]
    tables: tuple[Table, ...]


def _each_group(state: TablesState, change: Callable[[Table, TableLimits, int], Table],
                ) -> TablesState:
    tables = tuple(change(table, limits, group) for group, (table, limits)
                   in enumerate(zip(state.tables, state.limits, strict=True)))
    return TablesState(state.config, state.limits, tables)


def _batch(state: TablesState, command: ComputeSlotMapping) -> tuple[tuple[int, ...], ...]:
    from kvspec.spec import slot_mapping as slots

    c, config = command, state.config
    if len(c.req_indices) != len(c.positions) or len(c.positions) > config.num_slots:
        raise BadBatchError(f"{len(c.req_indices)} rows for {len(c.positions)} positions "
                            f"(at most {config.num_slots} tokens)")
    for row in c.req_indices:
        check_row(state.limits[0], row)
    out = []
    for table, limits, size in zip(state.tables, state.limits, config.block_sizes, strict=True):
        kernel = tuple(slots.kernel_row(row, limits.blocks_per_kv_block) for row in table)
        kernel_size = size // limits.blocks_per_kv_block
        span = kernel_size * config.dcp_world_size
        for row, position in zip(c.req_indices, c.positions, strict=True):
            if position < 0 or position // span >= len(kernel[row]):
                raise BadBatchError(f"position {position} is not held by row {row}")
        out.append(slots.batch_slot_mapping(
            kernel, c.req_indices, c.positions, kernel_size, config.num_slots,
            config.dcp_world_size, config.dcp_rank, config.interleave))
    return tuple(out)


def step(state: TablesState | None, command: TableCommand) -> tuple[TablesState, object]:
    """One command on every group's table: the new state and the output (the slot mapping
    of a batch, else None). A refused command raises and changes nothing."""
    if isinstance(command, NewTables):
        limits = tuple(TableLimits(command.num_rows, command.max_blocks_per_row,
                                   command.num_blocks, size // kernel)
                       for size, kernel in zip(command.block_sizes, command.kernel_block_sizes,
                                               strict=True))
        return TablesState(command, limits, tuple(empty_table(lim) for lim in limits)), None
    if state is None:
        raise InvalidLimitsError(f"{command} before the tables are built")
    if isinstance(command, AddRow | AppendRow):
        operation = add_row if isinstance(command, AddRow) else append_row
        ids = command.block_ids
        return _each_group(state, lambda t, lim, g: operation(t, lim, command.row, ids[g])), None
    if isinstance(command, MoveRow):
        return _each_group(state, lambda t, lim, g: move_row(t, lim, command.src,
                                                             command.tgt)), None
    if isinstance(command, SwapRow):
        return _each_group(state, lambda t, lim, g: swap_row(t, lim, command.src,
                                                             command.tgt)), None
    if isinstance(command, ClearRow):
        return _each_group(state, lambda t, lim, g: clear_row(t, lim, command.row)), None
    if isinstance(command, CommitBlockTable):
        return state, None
    return state, _batch(state, command)
