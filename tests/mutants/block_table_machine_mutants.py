"""Block-table mutants for the block-table conformance machine (an audit layer): row and
commit bugs planted into impl's BlockTable, each caught by a named check of the machine."""

from __future__ import annotations

from typing import Any

from tests.mutants import Mutant, replace

MACHINE = ("tests/test_block_table_machine.py",)


def _table() -> Any:
    from kvspec.impl.block_table import BlockTable

    return BlockTable


def move_row_swaps() -> None:
    """move_row swaps the rows instead of copying src over tgt (src must keep its blocks)."""
    table = _table()
    replace(table, "move_row", table.swap_row)


def clear_row_keeps_count() -> None:
    """clear_row zeroes a row's entries but keeps its count: the row reads as null blocks."""
    table = _table()

    def clear_row(self: Any, row_idx: int) -> None:
        row = self._check_row(row_idx)
        count = self._counts_mv[row]
        for column in range(count):
            self.block_table.np[row, column] = 0
        self._mark_written(row, 0, count)
    replace(table, "clear_row", clear_row)


def swap_row_overfills_a_row() -> None:
    """swap_row gives the target row a count past the row's width (a count written twice)."""
    table = _table()
    original = table.swap_row

    def swap_row(self: Any, src: int, tgt: int) -> None:
        original(self, src, tgt)
        if src != tgt:
            self._set_count(self._check_row(tgt), self.max_num_blocks_per_req + 1)
    replace(table, "swap_row", swap_row)


def commit_publishes_nothing() -> None:
    """commit_block_table copies no row to the device."""
    table = _table()
    replace(table, "commit_block_table", lambda self, num_reqs: None)


MUTANTS = [
    Mutant("bt_move_row_swaps", "move_row swaps instead of copying", move_row_swaps, MACHINE,
           "slot mapping of every block"),
    Mutant("bt_clear_row_keeps_count", "clear_row keeps the row's count",
           clear_row_keeps_count, MACHINE, "rows: target"),
    Mutant("bt_swap_row_overfills_a_row", "swap_row leaves a count past the row's width",
           swap_row_overfills_a_row, MACHINE, "invariants violated by the target"),
    Mutant("bt_commit_publishes_nothing", "commit_block_table publishes nothing",
           commit_publishes_nothing, MACHINE, "Arrays are not equal"),
]
