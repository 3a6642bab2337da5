"""BlockTable and MultiGroupBlockTable (impl/block_table.py): bad input, publishing, groups.

Every refused call must raise a typed error (a ValueError or LookupError subclass naming the
offending value) and leave every table exactly as it was: the host table, the counts, the
slot buffer and the device copies.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from kvspec.impl.block_table import (
    BlockIdError,
    BlockTable,
    BlockTableConfigError,
    MultiGroupBlockTable,
    PositionError,
    RowCapacityError,
    RowIndexError,
    TokenBatchError,
)


def small_table(kernel_block_size: int = 4) -> BlockTable:
    """4 rows of at most 3 blocks of 4 tokens, a pool of 10 blocks, 8 slots."""
    table = BlockTable(4, 4, 3, 8, False, "cpu", kernel_block_size, num_blocks=10)
    table.add_row([1, 2], 0)
    table.add_row([3], 1)
    table.commit_block_table(4)
    table.compute_slot_mapping(np.array([0, 0, 1]), np.array([0, 5, 2]))
    table.commit_slot_mapping(3)
    return table


def snapshot(table: BlockTable) -> tuple[object, ...]:
    return (
        table.block_table.np.copy(), table.num_blocks_per_row.copy(),
        table.block_table.gpu.clone(), table.slot_mapping.np.copy(),
        table.slot_mapping.gpu.clone(),
    )


def assert_unchanged(table: BlockTable, before: tuple[object, ...]) -> None:
    after = snapshot(table)
    for old, new in zip(before, after, strict=True):
        if isinstance(old, torch.Tensor):
            assert isinstance(new, torch.Tensor) and torch.equal(old, new)
        else:
            np.testing.assert_array_equal(old, new)
    # The refused call must not have left anything half-published either.
    table.commit_block_table(table.max_num_reqs)
    np.testing.assert_array_equal(table.block_table.gpu.numpy(), table.block_table.np)


BAD_CALLS: list[tuple[str, Callable[[BlockTable], object], type[Exception], str]] = [
    ("block id past the pool", lambda t: t.append_row([4, 10], 1), BlockIdError, "10"),
    ("negative block id", lambda t: t.add_row([-1], 2), BlockIdError, "-1"),
    ("block id of a numpy array", lambda t: t.append_row(np.array([3, 99]), 1), BlockIdError,
     "99"),
    ("float block ids", lambda t: t.append_row([1.5], 1), BlockIdError, "float"),  # type: ignore[list-item]
    ("bool block ids", lambda t: t.append_row([True], 1), BlockIdError, "bool"),
    ("too many blocks appended", lambda t: t.append_row([4, 5], 0), RowCapacityError, "4"),
    ("too many blocks added", lambda t: t.add_row([1, 2, 3, 4], 3), RowCapacityError, "4"),
    ("append to row past the end", lambda t: t.append_row([1], 4), RowIndexError, "4"),
    ("append to negative row", lambda t: t.append_row([1], -1), RowIndexError, "-1"),
    ("add to numpy row past the end", lambda t: t.add_row([1], np.int64(7)),  # type: ignore[arg-type]
     RowIndexError,
     "7"),
    ("row index of another type", lambda t: t.add_row([1], 1.0), RowIndexError,  # type: ignore[arg-type]
     "1.0"),
    ("move from a missing row", lambda t: t.move_row(9, 0), RowIndexError, "9"),
    ("move to a negative row", lambda t: t.move_row(0, -2), RowIndexError, "-2"),
    ("swap with a missing row", lambda t: t.swap_row(0, 4), RowIndexError, "4"),
    ("clear a missing row", lambda t: t.clear_row(-1), RowIndexError, "-1"),
    ("negative position", lambda t: t.compute_slot_mapping(np.array([0, 1]), np.array([3, -1])),
     PositionError, "-1"),
    ("position past the table", lambda t: t.compute_slot_mapping(np.array([0]), np.array([12])),
     PositionError, "12"),
    ("request index past the rows",
     lambda t: t.compute_slot_mapping(np.array([0, 4]), np.array([0, 0])), RowIndexError, "4"),
    ("negative request index",
     lambda t: t.compute_slot_mapping(np.array([-1]), np.array([0])), RowIndexError, "-1"),
    ("int32 negative position",
     lambda t: t.compute_slot_mapping(np.array([0], np.int32), np.array([-7], np.int32)),
     PositionError, "-7"),
    ("list with a negative position", lambda t: t.compute_slot_mapping([0, 0], [1, -4]),
     PositionError, "-4"),
    ("arrays of different lengths",
     lambda t: t.compute_slot_mapping(np.array([0, 0]), np.array([0])), TokenBatchError, "2"),
    ("more tokens than slots",
     lambda t: t.compute_slot_mapping(np.zeros(9, np.int64), np.zeros(9, np.int64)),
     TokenBatchError, "9"),
    ("float positions",
     lambda t: t.compute_slot_mapping(np.array([0]), np.array([0.5])), TokenBatchError,
     "float"),
    ("2-D positions",
     lambda t: t.compute_slot_mapping(np.zeros((1, 1), np.int64), np.zeros((1, 1), np.int64)),
     TokenBatchError, "shape"),
    ("commit past the rows", lambda t: t.commit_block_table(5), RowIndexError, "5"),
    ("commit more slots than the buffer", lambda t: t.commit_slot_mapping(9), TokenBatchError,
     "9"),
]


@pytest.mark.parametrize(
    ("call", "error", "named"), [case[1:] for case in BAD_CALLS], ids=[c[0] for c in BAD_CALLS]
)
@pytest.mark.parametrize("hybrid", [False, True], ids=["plain", "kernel-blocks"])
def test_bad_input_is_refused_and_changes_nothing(
    call: Callable[[BlockTable], object], error: type[Exception], named: str, hybrid: bool
) -> None:
    table = small_table(kernel_block_size=2) if hybrid else small_table()
    if hybrid:
        # Positions run over the manager's block size: the same limits hold.
        assert table.block_size == 2 and table.blocks_per_kv_block == 2
    before = snapshot(table)
    with pytest.raises(error) as raised:
        call(table)
    assert isinstance(raised.value, ValueError | LookupError)
    assert named in str(raised.value)
    assert_unchanged(table, before)


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        ({"block_size": 16, "kernel_block_size": 12}, "kernel_block_size=12"),
        ({"block_size": 0, "kernel_block_size": 1}, "block_size=0"),
        ({"max_num_reqs": -1}, "max_num_reqs=-1"),
        ({"dcp_world_size": 2, "dcp_rank": 2}, "dcp_rank=2"),
        ({"pcp_world_size": 2, "pcp_rank": 0, "cp_kv_cache_interleave_size": 3},
         "interleave_size=3"),
        ({"pcp_world_size": 2, "pcp_rank": None}, "pcp_rank=None"),
        ({"num_blocks": 0}, "num_blocks=0"),
        ({"slot_mapping_backend": "cuda-graphs"}, "cuda-graphs"),
    ],
)
def test_impossible_sizes_are_refused(arguments: dict[str, object], named: str) -> None:
    sizes: dict[str, object] = {
        "block_size": 16, "max_num_reqs": 2, "max_num_blocks_per_req": 2,
        "max_num_batched_tokens": 8, "pin_memory": False, "device": "cpu",
        "kernel_block_size": 16,
    }
    sizes.update(arguments)
    with pytest.raises(BlockTableConfigError, match=named):
        BlockTable(**sizes)  # type: ignore[arg-type]


def test_vllm_attributes_and_kernel_blocks() -> None:
    table = BlockTable(32, 2, 3, 16, False, "cpu", 16)
    assert (table.block_size, table.blocks_per_kv_block, table.use_hybrid_blocks) == (16, 2, True)
    assert table.max_num_blocks_per_req == 6
    assert table.block_table.np.shape == (2, 6) and table.block_table.np.dtype == np.int32
    assert table.slot_mapping.np.dtype == np.int64
    table.append_row([0, 1], 0)
    table.append_row(np.array([2]), 0)
    assert table.block_table.np[0].tolist() == [0, 1, 2, 3, 4, 5]
    assert table.num_blocks_per_row.tolist() == [6, 0]
    expanded = BlockTable.map_to_kernel_blocks(np.array([0, 1, 2]), 2, np.arange(2).reshape(1, -1))
    assert expanded.tolist() == [0, 1, 2, 3, 4, 5]
    table.compute_slot_mapping(np.array([0]), np.array([40]))
    assert table.slot_mapping.np[0] == 40  # manager block 1 * 32 + 8


def test_row_operations_follow_vllm_0_13() -> None:
    table = BlockTable(4, 3, 4, 8, False, "cpu", 4)
    table.add_row([5, 6, 7], 0)
    table.add_row([8], 0)  # the stale tail stays, as in vLLM
    assert table.block_table.np[0].tolist() == [8, 6, 7, 0]
    assert table.num_blocks_per_row[0] == 1
    table.append_row([], 1)
    assert table.num_blocks_per_row[1] == 0
    table.move_row(0, 2)  # copies the valid prefix; the source keeps its blocks
    assert table.block_table.np[2].tolist() == [8, 0, 0, 0]
    assert table.num_blocks_per_row.tolist() == [1, 0, 1]
    table.append_row([9, 10], 1)
    table.swap_row(0, 1)  # whole rows, stale entries included
    assert table.block_table.np[:2].tolist() == [[9, 10, 0, 0], [8, 6, 7, 0]]
    assert table.num_blocks_per_row.tolist() == [2, 1, 1]
    table.clear_row(0)
    assert table.block_table.np[0].tolist() == [0, 0, 0, 0]
    assert table.num_blocks_per_row[0] == 0
    table.commit_block_table(3)
    table.clear()  # zeroes both sides, keeps the counts
    assert not table.block_table.np.any() and not table.block_table.gpu.any()
    assert table.num_blocks_per_row.tolist() == [0, 1, 1]
    assert table.get_device_tensor(2).shape == (2, 4)


def test_commit_publishes_exactly_the_first_rows() -> None:
    table = BlockTable(4, 3, 3, 8, False, "cpu", 4)
    for row in range(3):
        table.add_row([row + 1], row)
    table.commit_block_table(1)
    assert table.block_table.gpu[:, 0].tolist() == [1, 0, 0]
    table.append_row([7], 0)
    table.commit_block_table(2)
    assert table.block_table.gpu[:, :2].tolist() == [[1, 7], [2, 0], [0, 0]]
    table.commit_block_table(3)
    np.testing.assert_array_equal(table.block_table.gpu.numpy(), table.block_table.np)


def test_commit_after_many_appends_and_scattered_rows() -> None:
    """More appends than the cell log holds, rows far apart, a full-width add: every path
    of the commit ends with the device equal to the host."""
    rng = np.random.default_rng(0)
    table = BlockTable(16, 64, 200, 64, False, "cpu", 16)
    published = table.block_table.gpu.numpy().copy()
    for step in range(30):
        for row in rng.choice(64, size=int(rng.integers(1, 64)), replace=False).tolist():
            if table.num_blocks_per_row[row] + 3 > 200:
                table.clear_row(row)
            table.append_row(rng.integers(0, 1000, int(rng.integers(1, 4))).tolist(), row)
        if step % 7 == 3:
            table.add_row(rng.integers(0, 1000, 200).tolist(), int(rng.integers(0, 64)))
        if step % 5 == 1:
            table.swap_row(int(rng.integers(0, 64)), int(rng.integers(0, 64)))
        num_reqs = int(rng.integers(0, 65))
        table.commit_block_table(num_reqs)
        published[:num_reqs] = table.block_table.np[:num_reqs]
        np.testing.assert_array_equal(table.block_table.gpu.numpy(), published)


def test_direct_writes_need_mark_dirty() -> None:
    table = BlockTable(4, 2, 2, 4, False, "cpu", 4)
    table.get_numpy_array()[1, :2] = [3, 4]
    table.num_blocks_per_row[1] = 2
    table.compute_slot_mapping(np.array([1, 1]), np.array([0, 5]))
    assert table.slot_mapping.np.tolist() == [12, 17, -1, -1]
    table.commit_block_table(2)
    np.testing.assert_array_equal(table.block_table.gpu.numpy(), table.block_table.np)
    table.block_table.np[0, 0] = 9  # behind the table's back ...
    table.mark_dirty()  # ... and declared
    table.compute_slot_mapping(np.array([0]), np.array([1]))
    assert table.slot_mapping.np[0] == 37
    table.commit_block_table(2)
    assert table.block_table.gpu[0, 0] == 9


def test_slot_commit_pads_the_device_tail() -> None:
    table = BlockTable(4, 1, 4, 6, False, "cpu", 4)
    table.add_row([1, 2], 0)
    table.compute_slot_mapping(np.zeros(5, np.int64), np.arange(5))
    table.commit_slot_mapping(5)
    assert table.slot_mapping.gpu.tolist() == [4, 5, 6, 7, 8, -1]
    table.compute_slot_mapping(np.zeros(2, np.int64), np.array([7, 6]))
    table.commit_slot_mapping(2)
    assert table.slot_mapping.gpu.tolist() == [11, 10, -1, -1, -1, -1]
    table.compute_slot_mapping(np.zeros(0, np.int64), np.zeros(0, np.int64))
    table.commit_slot_mapping(0)
    assert table.slot_mapping.gpu.tolist() == [-1] * 6


def test_multi_group_widths_and_fan_out() -> None:
    tables = MultiGroupBlockTable(4, 100, 16, False, "cpu", [16, 32], [16, 16],
                                  num_speculative_tokens=2)
    assert [t.max_num_blocks_per_req for t in tables.block_tables] == [7, 4 * 2]
    assert len(tables) == 2 and tables[1] is tables.block_tables[1]
    tables.add_row(([1, 2], [3]), 0)
    tables.append_row(([4], []), 0)
    assert tables[0].block_table.np[0, :3].tolist() == [1, 2, 4]
    assert tables[1].block_table.np[0, :2].tolist() == [6, 7]
    tables.move_row(0, 1)
    tables.swap_row(1, 2)
    assert [t.num_blocks_per_row.tolist() for t in tables.block_tables] == [
        [3, 0, 3, 0], [2, 0, 2, 0]
    ]
    tables.clear_row(0)
    tables.commit_block_table(4)
    tables.compute_slot_mapping(np.array([2, 2]), np.array([0, 20]))
    tables.commit_slot_mapping(2)
    assert tables[0].slot_mapping.gpu[:3].tolist() == [16, 36, -1]
    assert tables[1].slot_mapping.gpu[:3].tolist() == [96, 116, -1]
    tables.clear()
    assert not tables[0].block_table.np.any()
    cp_tables = MultiGroupBlockTable(2, 100, 8, False, "cpu", [16], [16], dcp_world_size=2,
                                     dcp_rank=1)
    assert cp_tables[0].max_num_blocks_per_req == 4  # cdiv(100, 16 * 2)


def test_multi_group_refusal_changes_no_group() -> None:
    tables = MultiGroupBlockTable(2, 32, 8, False, "cpu", [16, 8], [16, 8], num_blocks=20)
    tables.add_row(([1], [2, 3]), 0)
    before = [snapshot(t) for t in tables.block_tables]
    with pytest.raises(BlockIdError):
        tables.append_row(([4], [20]), 0)  # the second group refuses
    with pytest.raises(RowCapacityError):
        tables.append_row(([5], [6, 7, 8]), 0)
    with pytest.raises(BlockIdError, match="3 block id lists"):
        tables.add_row(([1], [2], [3]), 0)
    with pytest.raises(PositionError):
        # 40 fits the second group's row (4 blocks of 8 = 32 tokens)? No: 2 blocks of 16 = 32
        # in the first; both refuse, neither computes.
        tables.compute_slot_mapping(np.array([0]), np.array([40]))
    for table, old in zip(tables.block_tables, before, strict=True):
        assert_unchanged(table, old)
    with pytest.raises(BlockTableConfigError):
        MultiGroupBlockTable(2, 32, 8, False, "cpu", [16, 8], [16])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_commit_and_pinned_buffers() -> None:
    table = BlockTable(16, 8, 4, 64, True, "cuda", 16)
    assert table.block_table.cpu.is_pinned()
    for row in range(8):
        table.add_row([row, row + 8], row)
    table.swap_row(0, 7)
    table.commit_block_table(8)
    torch.cuda.synchronize()
    np.testing.assert_array_equal(table.block_table.gpu.cpu().numpy(), table.block_table.np)
    for row in range(0, 8, 3):
        table.append_row([100 + row], row)
    table.commit_block_table(8)
    torch.cuda.synchronize()
    np.testing.assert_array_equal(table.block_table.gpu.cpu().numpy(), table.block_table.np)


@pytest.mark.parametrize("kernel_block_size", [4, 2])
def test_slots_follow_every_row_operation(kernel_block_size: int) -> None:
    """A seeded walk of row operations; after each, every position of every row maps to the
    slot its block says and the device copy equals the host after a full commit."""
    rng = np.random.default_rng(7)
    table = BlockTable(4, 5, 4, 64, False, "cpu", kernel_block_size, num_blocks=50)
    rows: list[list[int]] = [[] for _ in range(5)]
    for _ in range(300):
        operation = rng.choice(["add", "append", "move", "swap", "clear"])
        row, other = (int(r) for r in rng.integers(0, 5, size=2))
        if operation == "add":
            rows[row] = rng.integers(0, 50, int(rng.integers(0, 5))).tolist()
            table.add_row(list(rows[row]), row)
        elif operation == "append" and len(rows[row]) < 4:
            new = rng.integers(0, 50, int(rng.integers(1, 5 - len(rows[row])))).tolist()
            rows[row] += new
            table.append_row(new, row)
        elif operation == "move":
            rows[other] = list(rows[row])
            table.move_row(row, other)
        elif operation == "swap":
            rows[row], rows[other] = rows[other], rows[row]
            table.swap_row(row, other)
        elif operation == "clear":
            rows[row] = []
            table.clear_row(row)
        tokens = [(r, p) for r in range(5) for p in range(len(rows[r]) * 4)]
        table.compute_slot_mapping(
            np.array([r for r, _ in tokens], dtype=np.int64),
            np.array([p for _, p in tokens], dtype=np.int64),
        )
        expected = [rows[r][p // 4] * 4 + p % 4 for r, p in tokens]
        assert table.slot_mapping.np[: len(tokens)].tolist() == expected
        assert (table.slot_mapping.np[len(tokens):] == -1).all()
        table.commit_block_table(5)
        np.testing.assert_array_equal(table.block_table.gpu.numpy(), table.block_table.np)
