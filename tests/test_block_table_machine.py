"""A state machine over the row operations: impl's MultiGroupBlockTable against the spec.

Tiny tables (3 rows of at most 3 blocks, a pool of 6 blocks, 12 slots) so that full rows,
stale tails, swaps of a row with itself and refused calls really happen. Each example picks
one configuration: one group or two, plain or kernel blocks, context parallel or not, the
numpy slot mapping or the torch-ops device path. After every step the host rows must be
the spec's rows (in kernel blocks), the device table must be exactly what the commits
published, and a refused call must have changed nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from hypothesis import event, strategies as st
from hypothesis.stateful import (
    initialize,
    invariant,
    precondition,
    rule,
)

from kvspec.impl.block_table import BlockTableError, MultiGroupBlockTable
from kvspec.spec import block_table_model as model, slot_mapping as slots
from kvspec.spec.conformance.deadline import BoundedSteps

NUM_ROWS = 3
MAX_BLOCKS = 3
NUM_BLOCKS = 6
NUM_SLOTS = 12


@dataclass(frozen=True)
class MachineConfig:
    name: str
    block_sizes: tuple[int, ...]
    kernel_block_sizes: tuple[int, ...]
    dcp_world_size: int = 1
    dcp_rank: int = 0
    interleave: int = 1
    backend: str = "numpy"


CONFIGS = [
    MachineConfig("one group", (2,), (2,)),
    MachineConfig("kernel blocks", (4,), (2,)),
    MachineConfig("two groups", (2, 4), (2, 2)),
    MachineConfig("context parallel", (4,), (4,), dcp_world_size=2, dcp_rank=1, interleave=2),
    MachineConfig("context parallel, kernel blocks", (4,), (2,), dcp_world_size=2),
    MachineConfig("torch device path", (2, 4), (2, 4), backend="torch"),
]

row_indices = st.integers(0, NUM_ROWS - 1)
bad_rows = st.sampled_from([-1, NUM_ROWS, NUM_ROWS + 5])
block_lists = st.lists(st.integers(0, NUM_BLOCKS - 1), max_size=MAX_BLOCKS)


class BlockTableMachine(BoundedSteps):  # every step under the step deadline
    config: MachineConfig
    tables: MultiGroupBlockTable
    models: list[model.Table]
    limits: list[model.TableLimits]
    published: list[np.ndarray]

    @initialize(config=st.sampled_from(CONFIGS))
    def build(self, config: MachineConfig) -> None:
        self.config = config
        event(f"config: {config.name}")
        self.tables = MultiGroupBlockTable(
            NUM_ROWS, 64, NUM_SLOTS, False, "cpu", list(config.block_sizes),
            list(config.kernel_block_sizes), cp_kv_cache_interleave_size=config.interleave,
            max_num_blocks=[MAX_BLOCKS] * len(config.block_sizes),
            dcp_world_size=config.dcp_world_size, dcp_rank=config.dcp_rank,
            num_blocks=NUM_BLOCKS, slot_mapping_backend=config.backend,
        )
        self.limits = [
            model.TableLimits(NUM_ROWS, MAX_BLOCKS, NUM_BLOCKS, size // kernel)
            for size, kernel in zip(config.block_sizes, config.kernel_block_sizes, strict=True)
        ]
        self.models = [model.empty_table(limits) for limits in self.limits]
        self.published = [t.block_table.gpu.numpy().copy() for t in self.tables.block_tables]

    @property
    def num_groups(self) -> int:
        return len(self.config.block_sizes)

    # --- driving impl and the spec side by side ------------------------------------------

    def snapshot(self) -> list[tuple[np.ndarray, ...]]:
        return [
            (t.block_table.np.copy(), t.num_blocks_per_row.copy(), t.slot_mapping.np.copy(),
             t.block_table.gpu.numpy().copy(), t.slot_mapping.gpu.numpy().copy())
            for t in self.tables.block_tables
        ]

    def both(self, operation: str, *arguments: object) -> None:
        """Apply ``operation`` to the spec (every group, atomically) and to impl; both must
        refuse with the same error or both succeed; a refused call changes nothing."""
        spec_error: model.BlockTableModelError | None = None
        new_models = []
        try:
            for group, (table, limits) in enumerate(zip(self.models, self.limits, strict=True)):
                group_arguments = [
                    argument[group] if isinstance(argument, GroupIds) else argument
                    for argument in arguments
                ]
                new_models.append(getattr(model, operation)(table, limits, *group_arguments))
        except model.BlockTableModelError as error:
            spec_error = error
        before = self.snapshot()
        impl_arguments = [a.ids if isinstance(a, GroupIds) else a for a in arguments]
        if operation in ("add_row", "append_row"):
            impl_arguments.reverse()  # impl takes (block_ids, row_idx)
        try:
            getattr(self.tables, operation)(*impl_arguments)
        except BlockTableError as impl_error:
            assert spec_error is not None, f"impl refused {operation}{arguments}: {impl_error}"
            assert type(impl_error).__name__ == type(spec_error).__name__, (impl_error, spec_error)
            assert isinstance(impl_error, ValueError | LookupError)
            self.assert_unchanged(before)
            event(f"refused: {type(impl_error).__name__}")
            return
        assert spec_error is None, f"impl accepted {operation}{arguments}: spec says {spec_error}"
        self.models = new_models

    def assert_unchanged(self, before: list[tuple[np.ndarray, ...]]) -> None:
        for old, new in zip(before, self.snapshot(), strict=True):
            for old_array, new_array in zip(old, new, strict=True):
                np.testing.assert_array_equal(old_array, new_array)

    # --- rules -----------------------------------------------------------------------------

    @rule(row=row_indices, data=st.data())
    def add_row(self, row: int, data: st.DataObject) -> None:
        ids = GroupIds(tuple(data.draw(block_lists) for _ in range(self.num_groups)))
        if len(self.models[0][row]) > len(ids.ids[0]):
            event("add_row leaves a stale tail")
        self.both("add_row", row, ids)

    @rule(row=row_indices, data=st.data())
    def append_row(self, row: int, data: st.DataObject) -> None:
        ids = GroupIds(tuple(data.draw(block_lists) for _ in range(self.num_groups)))
        if len(self.models[0][row]) + len(ids.ids[0]) > MAX_BLOCKS:
            event("append past the row's capacity")
        self.both("append_row", row, ids)

    @rule(row=row_indices, data=st.data())
    def append_a_block_outside_the_pool(self, row: int, data: st.DataObject) -> None:
        bad = data.draw(st.sampled_from([-1, NUM_BLOCKS, 2**40]))
        group = data.draw(st.integers(0, self.num_groups - 1))
        ids = GroupIds(tuple([bad] if g == group else [] for g in range(self.num_groups)))
        self.both(data.draw(st.sampled_from(["append_row", "add_row"])), row, ids)

    @rule(src=row_indices, tgt=row_indices)
    def move_row(self, src: int, tgt: int) -> None:
        self.both("move_row", src, tgt)

    @rule(src=row_indices, tgt=row_indices)
    def swap_row(self, src: int, tgt: int) -> None:
        event("swap a row with itself" if src == tgt else "swap")
        self.both("swap_row", src, tgt)

    @rule(row=row_indices)
    def clear_row(self, row: int) -> None:
        self.both("clear_row", row)

    @rule(bad=bad_rows, good=row_indices, operation=st.sampled_from(
        ["add_row", "append_row", "move_row", "swap_row", "clear_row", "move_row to"]
    ))
    def use_a_row_that_does_not_exist(self, bad: int, good: int, operation: str) -> None:
        ids = GroupIds(tuple([0] for _ in range(self.num_groups)))
        if operation in ("add_row", "append_row"):
            self.both(operation, bad, ids)
        elif operation == "clear_row":
            self.both(operation, bad)
        elif operation == "move_row to":
            self.both("move_row", good, bad)
        else:
            self.both(operation, bad, good)

    @rule(num_reqs=st.integers(0, NUM_ROWS))
    def commit_block_table(self, num_reqs: int) -> None:
        event("commit some rows" if num_reqs < NUM_ROWS else "commit all rows")
        self.tables.commit_block_table(num_reqs)
        for published, table in zip(self.published, self.tables.block_tables, strict=True):
            published[:num_reqs] = table.block_table.np[:num_reqs]

    @rule(data=st.data())
    def compute_slot_mapping(self, data: st.DataObject) -> None:
        world_size = self.config.dcp_world_size
        # Positions every group's row covers (the groups share the batch).
        covered = [
            min(
                len(table[row]) * size * world_size
                for table, size in zip(self.models, self.config.block_sizes, strict=True)
            )
            for row in range(NUM_ROWS)
        ]
        rows = [row for row in range(NUM_ROWS) if covered[row]]
        num_tokens = data.draw(st.integers(0, NUM_SLOTS if rows else 0))
        req_indices, positions = [], []
        for _ in range(num_tokens):
            row = data.draw(st.sampled_from(rows))
            req_indices.append(row)
            positions.append(data.draw(st.integers(0, covered[row] - 1)))
        event(f"{num_tokens} tokens" if num_tokens in (0, NUM_SLOTS) else "some tokens")
        self.tables.compute_slot_mapping(
            np.array(req_indices, dtype=np.int64), np.array(positions, dtype=np.int64)
        )
        self.tables.commit_slot_mapping(num_tokens)
        for group, table in enumerate(self.tables.block_tables):
            limits = self.limits[group]
            expected = slots.batch_slot_mapping(
                tuple(slots.kernel_row(row, limits.blocks_per_kv_block)
                      for row in self.models[group]),
                tuple(req_indices), tuple(positions), table.block_size, NUM_SLOTS,
                world_size, self.config.dcp_rank, self.config.interleave,
            )
            if self.config.backend == "numpy":
                assert tuple(table.slot_mapping.np.tolist()) == expected
            assert tuple(table.slot_mapping.gpu.tolist()) == expected
        # The device computation published the whole table first.
        if self.config.backend != "numpy":
            for published, table in zip(self.published, self.tables.block_tables, strict=True):
                published[:] = table.block_table.np

    @precondition(lambda self: len(self.models[0][0]) > 0)
    @rule(data=st.data())
    def compute_a_bad_batch(self, data: st.DataObject) -> None:
        bad = data.draw(st.sampled_from(["negative position", "row", "lengths"]))
        rows, positions = np.array([0, 1], dtype=np.int64), np.array([0, -3], dtype=np.int64)
        if bad == "row":
            rows, positions = np.array([NUM_ROWS]), np.array([0])
        elif bad == "lengths":
            positions = np.array([0])
        before = self.snapshot()
        try:
            self.tables.compute_slot_mapping(rows, positions)
        except BlockTableError as error:
            assert isinstance(error, ValueError | LookupError)
        else:
            raise AssertionError(f"a batch with a bad {bad} was accepted")
        self.assert_unchanged(before)

    # --- invariants ------------------------------------------------------------------------

    @invariant()
    def rows_are_the_spec_rows(self) -> None:
        for table, rows, limits in zip(self.tables.block_tables, self.models, self.limits,
                                       strict=True):
            assert model.violated_invariants(rows, limits) == []
            counts = table.num_blocks_per_row.tolist()
            assert counts == [len(row) * limits.blocks_per_kv_block for row in rows]
            for row, blocks in enumerate(rows):
                assert tuple(table.block_table.np[row, : counts[row]].tolist()) == (
                    slots.kernel_row(blocks, limits.blocks_per_kv_block)
                )

    @invariant()
    def every_block_maps_its_tokens(self) -> None:
        """One token in each block of each row (numpy path: it changes no table)."""
        if self.config.backend != "numpy":
            return
        world_size, rank = self.config.dcp_world_size, self.config.dcp_rank
        for table, rows, limits in zip(self.tables.block_tables, self.models, self.limits,
                                       strict=True):
            kernel_rows = tuple(slots.kernel_row(row, limits.blocks_per_kv_block) for row in rows)
            span = table.block_size * world_size
            tokens = [(r, j * span + (span - 1 - rank)) for r, row in enumerate(kernel_rows)
                      for j in range(len(row))]
            for first in range(0, len(tokens), NUM_SLOTS):
                chunk = tokens[first : first + NUM_SLOTS]
                req_indices = tuple(r for r, _ in chunk)
                positions = tuple(p for _, p in chunk)
                table.compute_slot_mapping(np.array(req_indices, dtype=np.int64),
                                           np.array(positions, dtype=np.int64))
                assert tuple(table.slot_mapping.np.tolist()) == slots.batch_slot_mapping(
                    kernel_rows, req_indices, positions, table.block_size, NUM_SLOTS,
                    world_size, rank, self.config.interleave,
                )

    @invariant()
    def device_table_is_what_was_published(self) -> None:
        for published, table in zip(self.published, self.tables.block_tables, strict=True):
            np.testing.assert_array_equal(table.block_table.gpu.numpy(), published)
            assert table.block_table.gpu.dtype == torch.int32


@dataclass(frozen=True)
class GroupIds:
    """Block ids per group: the spec takes one list per group, impl the tuple."""

    ids: tuple[list[int], ...]

    def __getitem__(self, group: int) -> list[int]:
        return self.ids[group]


TestBlockTableMachine = BlockTableMachine.TestCase
