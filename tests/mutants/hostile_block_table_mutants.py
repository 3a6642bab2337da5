"""Hostile-input mutants of the worker block tables (impl/block_table.py, impl/utils.py,
impl/slot_mapping_triton.py): each brings back one way a bad call went wrong (accepted without
a word, an untyped error, a refusal that changed a table or broke what the next call reads, an
error that does not name the value), and tests/hostile/test_block_table.py kills it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvspec.impl import block_table as bt, utils
from tests.mutants import Mutant, replace

SUITE = "tests/hostile/test_block_table.py"
GENERATED = f"{SUITE}::test_block_tables_refuse_bad_calls_and_change_nothing"
ROW_WRITES = f"{SUITE}::test_refused_row_writes_leave_every_group_and_slot_as_it_was"


def narrow_signed_as_unsigned() -> None:
    """The range check views every signed array as unsigned and compares with the limit: an
    int8 -1 (255) or int16 -1 (65535) below a wide table's limit is taken, as block -1 or a
    far slot (the issue's defect)."""
    def check_below(values: np.ndarray, limit: int, error: Any, name: str) -> None:
        unsigned = values.view(bt._UNSIGNED[values.dtype.itemsize]) if (
            values.dtype.kind == "i") else values
        worst = int(unsigned.argmax())
        if int(unsigned[worst]) >= limit:
            raise error(f"{name}[{worst}] = {int(values[worst])} is outside [0, {limit})")
    replace(bt, "_check_below", check_below)


def commit_count_unchecked() -> None:
    """commit_block_table checks only ``0 <= num_reqs <= max_num_reqs``: 1.5 passes, part of
    the table is copied, then slicing raises a TypeError (the issue's defect)."""
    def commit_block_table(self: bt.BlockTable, num_reqs: Any) -> None:
        if not 0 <= num_reqs <= self.max_num_reqs:
            raise bt.RowIndexError(f"num_reqs={num_reqs} is outside [0, {self.max_num_reqs}]")
        self._commit_rows(num_reqs)
    replace(bt.BlockTable, "commit_block_table", commit_block_table)


def multi_group_append_as_it_goes() -> None:
    """MultiGroupBlockTable.append_row checks and appends group by group: a bad id in the
    second group leaves the first group's row appended."""
    def append_row(self: bt.MultiGroupBlockTable, block_ids: Any, row_idx: Any) -> None:
        for table, ids in zip(self.block_tables, self._per_group(block_ids), strict=True):
            table._apply_append(*table._prepare_append(ids, row_idx))
    replace(bt.MultiGroupBlockTable, "append_row", append_row)


def sequences_trusted_to_numpy() -> None:
    """Block ids and batches given as lists go straight to numpy: [True, 2] becomes [1, 2],
    and [1.5] is refused as "an array of float64" without naming the value."""
    original = bt._integer_array

    def integer_array(values: Any, name: str, error: Any) -> np.ndarray:
        if isinstance(values, list | tuple):
            values = np.asarray(values)
            if values.dtype.kind not in "iu" and values.size:
                raise error(f"{name} must hold integers, got an array of {values.dtype}")
        return original(values, name, error)
    replace(bt, "_integer_array", integer_array)


def length_read_first() -> None:
    """append_row and add_row read ``len(block_ids)`` before looking at its type: a
    generator, None or 3 gets Python's bare TypeError."""
    def prepare(check_capacity_from_count: bool) -> Any:
        def prepare_ids(self: bt.BlockTable, block_ids: Any, row_idx: Any) -> Any:
            row = self._check_row(row_idx)
            if not len(block_ids):
                return row, block_ids
            kernel_ids = self._kernel_ids(block_ids)
            start = self._counts_mv[row] if check_capacity_from_count else 0
            self._check_capacity(row, start + len(kernel_ids))
            return row, kernel_ids
        return prepare_ids
    replace(bt.BlockTable, "_prepare_append", prepare(True))
    replace(bt.BlockTable, "_prepare_add", prepare(False))


def shadow_written_while_checking() -> None:
    """add_row computes the new row's int64 slot shadow while it checks the ids (one pass),
    before the capacity check: a refused add_row leaves the table as it was but the shadow
    holding the refused ids, so the next slot mapping maps the row's tokens to wrong slots
    (the snapshot cannot see it; the suite's check that the table still works does)."""
    original = bt.BlockTable._prepare_add

    def prepare_add(self: bt.BlockTable, block_ids: Any, row_idx: Any) -> Any:
        row = self._check_row(row_idx)
        kernel_ids = self._kernel_ids(block_ids)
        bases = self._slot_bases
        if bases is not None and not self._bases_stale:
            width = self.max_num_blocks_per_req
            count = min(len(kernel_ids), width)
            ids = np.asarray(kernel_ids[:count], dtype=np.int64)
            bases[row * width: row * width + count] = (
                ids * self.block_size - self._column_bias[:count])
        return original(self, block_ids, row_idx)
    replace(bt.BlockTable, "_prepare_add", prepare_add)


def row_refusal_names_nothing() -> None:
    """A bad row index is refused without saying which value it got."""
    def check_row(self: bt.BlockTable, row_idx: Any) -> int:
        if type(row_idx) is int and 0 <= row_idx < self.max_num_reqs:
            return row_idx
        try:
            return bt._index(row_idx, self.max_num_reqs, bt.RowIndexError, "row index")
        except bt.RowIndexError:
            raise bt.RowIndexError("bad row index") from None
    replace(bt.BlockTable, "_check_row", check_row)


def group_index_as_a_list() -> None:
    """MultiGroupBlockTable[idx] indexes its list of groups: tables[-1] is the last group,
    tables[None] a bare TypeError (vLLM 0.13's behaviour)."""
    def getitem(self: bt.MultiGroupBlockTable, idx: Any) -> bt.BlockTable:
        table: bt.BlockTable = self.block_tables[idx]
        return table
    replace(bt.MultiGroupBlockTable, "__getitem__", getitem)


def buffer_copy_count_unchecked() -> None:
    """CpuGpuBuffer.copy_to_gpu(n) checks only ``0 <= n <= rows``: 1.5 reaches the slice
    (a bare TypeError) and True copies one row."""
    def rows(self: utils.CpuGpuBuffer, n: Any) -> Any:
        total = int(self.cpu.shape[0])
        if n is None:
            return total
        if not 0 <= n <= total:
            raise utils.CpuGpuBufferError(f"cannot copy {n} rows of a buffer of {total}")
        return n
    replace(utils.CpuGpuBuffer, "_rows", rows)


def device_unchecked() -> None:
    """The constructors take ``device`` as given: torch.device('nonsense') raises a bare
    RuntimeError, and None or 3.5 a bare TypeError."""
    def as_device(device: Any, error: Any = utils.CpuGpuBufferError) -> Any:
        import torch
        return torch.device(device)
    replace(bt, "as_device", as_device)
    replace(utils, "as_device", as_device)


def kernel_expansion_unchecked() -> None:
    """kernel_block_ids expands whatever it is given: block -1 becomes kernel blocks -2 and
    -1, and 1.5 becomes 3.0 and 4.0."""
    def kernel_block_ids(block_ids: Any, blocks_per_kv_block: Any) -> list[Any]:
        return [b * blocks_per_kv_block + j for b in block_ids for j in range(
            blocks_per_kv_block)]
    replace(bt, "kernel_block_ids", kernel_block_ids)


def rank_none_taken_from_process() -> None:
    """A rank of None is the process's rank even with a world size given: ``pcp_world_size=2,
    pcp_rank=None`` builds a table as rank 0 of 2 outside any context-parallel group (the
    issue's ``BlockTable(pcp_rank=None)``)."""
    def context_parallel(pcp_world_size: Any, pcp_rank: Any, dcp_world_size: Any,
                         dcp_rank: Any) -> tuple[Any, Any, Any, Any]:
        return (1 if pcp_world_size is None else pcp_world_size,
                0 if pcp_rank is None else pcp_rank,
                1 if dcp_world_size is None else dcp_world_size,
                0 if dcp_rank is None else dcp_rank)
    replace(bt, "_context_parallel", context_parallel)


def _mutant(name: str, plant: Any, *checker: str, killed_by: str = "") -> Mutant:
    description = " ".join((plant.__doc__ or "").split())
    return Mutant(name, description, plant, checker or (SUITE,), killed_by)


MUTANTS: list[Mutant] = [
    _mutant("hostile_bt_narrow_signed_as_unsigned", narrow_signed_as_unsigned),
    _mutant("hostile_bt_commit_count_unchecked", commit_count_unchecked),
    _mutant("hostile_bt_multi_group_append_as_it_goes", multi_group_append_as_it_goes,
            ROW_WRITES, GENERATED, killed_by="refused, but the state changed"),
    _mutant("hostile_bt_sequences_trusted_to_numpy", sequences_trusted_to_numpy),
    _mutant("hostile_bt_length_read_first", length_read_first, GENERATED,
            killed_by="neither a ValueError nor a LookupError"),
    _mutant("hostile_bt_shadow_written_while_checking", shadow_written_while_checking,
            ROW_WRITES, GENERATED, killed_by="slots differ from the spec"),
    _mutant("hostile_bt_row_refusal_names_nothing", row_refusal_names_nothing, GENERATED,
            killed_by="does not name the value"),
    _mutant("hostile_bt_group_index_as_a_list", group_index_as_a_list, GENERATED),
    _mutant("hostile_cpu_gpu_buffer_copy_count_unchecked", buffer_copy_count_unchecked,
            f"{SUITE}::test_cpu_gpu_buffer_refuses_bad_copies"),
    _mutant("hostile_bt_device_unchecked", device_unchecked,
            f"{SUITE}::test_block_table_constructor_refuses_bad_arguments",
            f"{SUITE}::test_cpu_gpu_buffer_constructor_refuses_bad_arguments",
            killed_by="neither a ValueError nor a LookupError"),
    _mutant("hostile_bt_kernel_expansion_unchecked", kernel_expansion_unchecked,
            f"{SUITE}::test_slot_helpers_refuse_bad_arguments"),
    _mutant("hostile_bt_rank_none_taken_from_process", rank_none_taken_from_process,
            f"{SUITE}::test_a_rank_of_none_with_its_world_size_given_is_refused",
            killed_by="accepted without a word"),
]
