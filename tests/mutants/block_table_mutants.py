"""Realistic bugs in the worker block table and its slot mapping (impl/block_table.py,
impl/slot_mapping_triton.py), each of which some test must catch."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tests.mutants import Mutant

SLOT_TESTS = "tests/test_slot_mapping.py"
DEVICE_SLOT_TESTS = "tests/test_slot_mapping_triton.py"
TABLE_TESTS = "tests/test_block_table.py"


def _row_stride_of_manager_blocks() -> None:
    """With kernel blocks, rows are addressed with the manager's width, not the kernel's."""
    from kvspec.impl.block_table import BlockTable

    original = BlockTable.__init__

    def init(self: BlockTable, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        manager_width = self.max_num_blocks_per_req // self.blocks_per_kv_block
        self._row_stride = np.array(manager_width, dtype=np.int64)

    BlockTable.__init__ = init  # type: ignore[method-assign]


def _pad_with_zero() -> None:
    """Padding slots are 0 (a real slot of block 0) instead of -1."""
    import kvspec.impl.block_table as block_table_module

    block_table_module.PAD_SLOT_ID = 0


def _cp_mask_ignores_interleave() -> None:
    """A token counts as local when ``offset % world == rank``, as if the interleave were 1."""
    import kvspec.impl.block_table as block_table_module

    def cp_local_offset(
        offset: int, block_size: int, cp_world_size: int, cp_rank: int, interleave: int
    ) -> int:
        if offset % cp_world_size != cp_rank:
            return -1
        return (offset // (cp_world_size * interleave)) * interleave + offset % interleave

    block_table_module.cp_local_offset = cp_local_offset


def _expansion_without_factor() -> None:
    """Manager block b becomes kernel blocks b .. b+k-1 instead of b*k .. b*k+k-1."""
    import kvspec.impl.block_table as block_table_module

    def kernel_block_ids(block_ids: Any, blocks_per_kv_block: int) -> list[int]:
        return [block + j for block in block_ids for j in range(blocks_per_kv_block)]

    block_table_module.kernel_block_ids = kernel_block_ids


def _no_row_bound_check() -> None:
    """Row indices are taken as they come (numpy wraps negative ones)."""
    from kvspec.impl.block_table import BlockTable

    def check_row(self: BlockTable, row_idx: Any) -> int:
        return int(row_idx)

    BlockTable._check_row = check_row  # type: ignore[method-assign]


def _stale_tail() -> None:
    """Slots past a shorter batch keep the previous batch's values (0.13's numpy path)."""
    import kvspec.impl.block_table as block_table_module

    def pad_tail(slots: np.ndarray, start: int, stop: int) -> None:
        return None

    block_table_module._pad_tail = pad_tail


def _swap_not_published() -> None:
    """swap_row swaps the host rows but forgets to mark them for the next commit."""
    from kvspec.impl.block_table import BlockTable

    def swap_row(self: BlockTable, src: int, tgt: int) -> None:
        src_row, tgt_row = self._check_row(src), self._check_row(tgt)
        if src_row == tgt_row:
            return
        extent = self._row_extent
        width = max(extent[src_row], extent[tgt_row])
        if width:
            self._copy_columns([src_row, tgt_row], [tgt_row, src_row], width)
        extent[src_row], extent[tgt_row] = extent[tgt_row], extent[src_row]
        src_count, tgt_count = self._counts_mv[src_row], self._counts_mv[tgt_row]
        self._set_count(src_row, tgt_count)
        self._set_count(tgt_row, src_count)

    BlockTable.swap_row = swap_row  # type: ignore[method-assign]


def _move_forgets_shadow() -> None:
    """move_row copies the table row but not its int64 slot shadow."""
    from kvspec.impl.block_table import BlockTable

    def move_row(self: BlockTable, src: int, tgt: int) -> None:
        src_row, tgt_row = self._check_row(src), self._check_row(tgt)
        num_blocks = self._counts_mv[src_row]
        if num_blocks:
            self._table_np[tgt_row, :num_blocks] = self._table_np[src_row, :num_blocks]
            self._mark_written(tgt_row, 0, num_blocks)
        self._set_count(tgt_row, num_blocks)

    BlockTable.move_row = move_row  # type: ignore[method-assign]


def _triton_launch_covers_only_the_batch() -> None:
    """The Triton launch covers the batch's tokens only; the tail keeps stale slots."""
    from kvspec.impl import slot_mapping_triton

    original = slot_mapping_triton.slot_mapping_triton

    def slot_mapping(
        block_table: torch.Tensor, req_indices: torch.Tensor, positions: torch.Tensor,
        out: torch.Tensor, num_tokens: int, *args: Any, **kwargs: Any,
    ) -> None:
        original(block_table, req_indices, positions, out[:num_tokens], num_tokens, *args,
                 **kwargs)

    slot_mapping_triton.slot_mapping_triton = slot_mapping


MUTANTS: list[Mutant] = [
    Mutant("bt_row_stride", _row_stride_of_manager_blocks.__doc__ or "",
           _row_stride_of_manager_blocks,
           (f"{SLOT_TESTS}::test_numpy_path_matches_spec",)),
    Mutant("bt_pad_zero", _pad_with_zero.__doc__ or "", _pad_with_zero,
           (f"{SLOT_TESTS}::test_numpy_path_matches_spec",)),
    Mutant("bt_cp_mask", _cp_mask_ignores_interleave.__doc__ or "", _cp_mask_ignores_interleave,
           (f"{SLOT_TESTS}::test_numpy_path_matches_spec",)),
    Mutant("bt_expansion_factor", _expansion_without_factor.__doc__ or "",
           _expansion_without_factor, (f"{SLOT_TESTS}::test_numpy_path_matches_spec",)),
    Mutant("bt_no_row_check", _no_row_bound_check.__doc__ or "", _no_row_bound_check,
           (f"{TABLE_TESTS}::test_bad_input_is_refused_and_changes_nothing",)),
    Mutant("bt_stale_tail", _stale_tail.__doc__ or "", _stale_tail,
           (f"{SLOT_TESTS}::test_every_slot_past_the_batch_is_padding",)),
    Mutant("bt_swap_unpublished", _swap_not_published.__doc__ or "", _swap_not_published,
           (f"{TABLE_TESTS}::test_slots_follow_every_row_operation",)),
    Mutant("bt_move_shadow", _move_forgets_shadow.__doc__ or "", _move_forgets_shadow,
           (f"{TABLE_TESTS}::test_slots_follow_every_row_operation",)),
    Mutant("bt_triton_tail", _triton_launch_covers_only_the_batch.__doc__ or "",
           _triton_launch_covers_only_the_batch,
           (f"{DEVICE_SLOT_TESTS}::test_triton_kernel_matches_spec",)),
]
