"""The block-table conformance machine: a MultiGroupBlockTable and `spec.block_table_model`
side by side, every step.

Tiny tables (3 rows of at most 3 blocks, a pool of 6 blocks, 12 slots) so that full rows,
stale tails, swaps of a row with itself and refused calls really happen. Each example picks
one configuration: one group or two, plain or kernel blocks, context parallel or not, the
numpy slot mapping or the torch-ops device path. Every row operation and every batch's
slot mapping is a `spec.block_table_model` command run on both through
`lockstep.Lockstep`; after every step the host rows must be the spec's (in kernel blocks),
every named table invariant must hold on them, and the device table must be exactly what
the commits published.

`machine_for(make_adapter)` builds a machine; `adapter_for(target)` finds the adapter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, ClassVar

import numpy as np
from hypothesis import event, strategies as st
from hypothesis.stateful import initialize, invariant, rule

from kvspec.conformance.lockstep import NOTHING, Adapter, Call, Reader, method
from kvspec.conformance.machine import LockstepMachine, bad_call
from kvspec.spec import block_table_model as model, slot_mapping as slots
from kvspec.spec.block_table_model import (
    AddRow,
    AppendRow,
    ClearRow,
    CommitBlockTable,
    ComputeSlotMapping,
    MoveRow,
    NewTables,
    SwapRow,
    TablesState,
)

NUM_ROWS = 3
MAX_BLOCKS = 3
NUM_BLOCKS = 6
NUM_SLOTS = 12
IMPL_TABLES = "kvspec.impl.block_table:MultiGroupBlockTable"


def _config(block_sizes: tuple[int, ...], kernel_block_sizes: tuple[int, ...],
            **options: Any) -> NewTables:
    return NewTables(block_sizes, kernel_block_sizes, NUM_ROWS, MAX_BLOCKS, NUM_BLOCKS,
                     NUM_SLOTS, **options)


CONFIGS = (
    _config((2,), (2,)),  # one group
    _config((4,), (2,)),  # kernel blocks
    _config((2, 4), (2, 2)),  # two groups
    _config((4,), (4,), dcp_world_size=2, dcp_rank=1, interleave=2),  # context parallel
    _config((4,), (2,), dcp_world_size=2),  # context parallel, kernel blocks
    _config((2, 4), (2, 4), backend="torch"),  # the torch device path
)

row_indices = st.integers(0, NUM_ROWS - 1)
block_lists = st.lists(st.integers(0, NUM_BLOCKS - 1), max_size=MAX_BLOCKS)


def view_of(state: TablesState) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Per group, each row's blocks in kernel blocks: what a reader of the table may rely on
    (entries past a row's count are stale, and no part of the model)."""
    return tuple(tuple(slots.kernel_row(row, limits.blocks_per_kv_block) for row in table)
                 for table, limits in zip(state.tables, state.limits, strict=True))


def table_rows(tables: Any) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """A MultiGroupBlockTable's rows read back: each row's first count entries."""
    def row(table: Any, index: int, count: int) -> tuple[int, ...]:
        entries = table.block_table.np[index, :count].tolist()
        return tuple(entries + [-1] * (count - len(entries)))  # a count past the row's width

    return tuple(tuple(row(t, index, count) for index, count in
                       enumerate(t.num_blocks_per_row.tolist()))
                 for t in tables.block_tables)


def slot_mappings(tables: Any) -> tuple[tuple[int, ...], ...]:
    """Each group's committed slot mapping (the device copy)."""
    return tuple(tuple(t.slot_mapping.gpu.tolist()) for t in tables.block_tables)


def _new_tables(adapter: TablesAdapter, c: NewTables) -> None:
    adapter.config = c
    adapter.tables = adapter.tables_class(
        c.num_rows, 64, c.num_slots, False, "cpu", list(c.block_sizes),
        list(c.kernel_block_sizes), cp_kv_cache_interleave_size=c.interleave,
        max_num_blocks=[c.max_blocks_per_row] * len(c.block_sizes),
        dcp_world_size=c.dcp_world_size, dcp_rank=c.dcp_rank,
        num_blocks=c.num_blocks, slot_mapping_backend=c.backend)


def _new_tables_source(adapter: TablesAdapter, c: NewTables) -> str:
    return (f"{adapter.path.partition(':')[2]}({c.num_rows}, 64, {c.num_slots}, False, "
            f"'cpu', {list(c.block_sizes)}, {list(c.kernel_block_sizes)}, "
            f"cp_kv_cache_interleave_size={c.interleave}, "
            f"max_num_blocks={[c.max_blocks_per_row] * len(c.block_sizes)}, "
            f"dcp_world_size={c.dcp_world_size}, dcp_rank={c.dcp_rank}, "
            f"num_blocks={c.num_blocks}, slot_mapping_backend={c.backend!r})")


def _rows(adapter: TablesAdapter, c: AddRow | AppendRow) -> tuple[object, ...]:
    return tuple(list(ids) for ids in c.block_ids), c.row


def _compute_slot_mapping(adapter: TablesAdapter, c: ComputeSlotMapping) -> object:
    """The batch's slot mapping computed and committed: the device copy (on the numpy path
    it must equal the host's)."""
    tables = adapter.tables
    tables.compute_slot_mapping(np.array(c.req_indices, dtype=np.int64),
                                np.array(c.positions, dtype=np.int64))
    tables.commit_slot_mapping(len(c.positions))
    host = tuple(tuple(t.slot_mapping.np.tolist()) for t in tables.block_tables)
    device = slot_mappings(tables)
    assert adapter.config is not None
    if adapter.config.backend == "numpy" and host != device:
        raise AssertionError(f"slot mapping: host {host}, device {device}")
    return device


class TablesAdapter(Adapter):
    """Performs block-table commands on a class with vLLM 0.13's MultiGroupBlockTable API
    (kvspec's own constructor keywords: explicit row width and pool size)."""

    variable = "tables"

    def __init__(self, path: str = IMPL_TABLES) -> None:
        from kvspec.conformance.vllm_targets import load_class

        self.path = path
        self.target_path = path
        self.tables_class: Any = load_class(path)
        self.tables: Any = None
        self.config: NewTables | None = None

    calls: ClassVar[dict[type, Call]] = {
        NewTables: Call(_new_tables, _new_tables_source),
        AddRow: method("add_row", _rows, NOTHING),
        AppendRow: method("append_row", _rows, NOTHING),
        MoveRow: method("move_row", lambda a, c: (c.src, c.tgt), NOTHING),
        SwapRow: method("swap_row", lambda a, c: (c.src, c.tgt), NOTHING),
        ClearRow: method("clear_row", lambda a, c: (c.row,), NOTHING),
        CommitBlockTable: method("commit_block_table", lambda a, c: (c.num_reqs,), NOTHING),
        ComputeSlotMapping: Call(_compute_slot_mapping, lambda a, c: (
            f"(tables.compute_slot_mapping(np.array({list(c.req_indices)}, dtype=np.int64), "
            f"np.array({list(c.positions)}, dtype=np.int64)), "
            f"tables.commit_slot_mapping({len(c.positions)}))"),
            Reader(lambda device: device, "({}, slot_mappings(tables))[1]")),
    }

    def view(self) -> tuple[tuple[tuple[int, ...], ...], ...]:
        return table_rows(self.tables)

    def imports(self) -> list[str]:
        module, _, name = self.path.partition(":")
        return ["import numpy as np", f"from {module} import {name}",
                "from kvspec.conformance.block_table_machine import slot_mappings, "
                "table_rows"]

    def view_source(self) -> str:
        return "table_rows(tables)"


def adapter_for(target: str) -> Callable[[], TablesAdapter]:
    """``impl`` or ``package.module:Class`` (a class taking kvspec's constructor keywords)."""
    if target == "impl":
        return TablesAdapter
    if target == "vllm" or target.startswith("vllm."):
        from kvspec.conformance.vllm_targets import LayerUnavailable

        raise LayerUnavailable(
            "no adapter for vLLM's MultiGroupBlockTable yet: it takes its row width from "
            "max_model_len and its context-parallel sizes from vLLM's distributed state, so "
            "the tiny tables of this machine cannot be built from outside")
    TablesAdapter(target)  # a TargetError now, where the class cannot be found
    return lambda: TablesAdapter(target)


class BlockTableMachine(LockstepMachine[TablesState]):
    """Runs a block-table adapter against `spec.block_table_model` (every step under the step
    deadline)."""

    spec_step = staticmethod(model.step)
    view_of = staticmethod(view_of)
    make_adapter: Callable[[], TablesAdapter] = TablesAdapter

    def __init__(self) -> None:
        super().__init__()
        self.published: list[Any] = []

    @property
    def num_groups(self) -> int:
        return len(self.spec.config.block_sizes)

    def _ids(self, lists: list[list[int]]) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(lists[g % len(lists)]) for g in range(self.num_groups))

    def _publish(self, num_reqs: int | None = None) -> None:
        """What the device table holds after a commit (None: the whole table)."""
        for published, table in zip(self.published, self.adapter.tables.block_tables,
                                    strict=True):
            rows = NUM_ROWS if num_reqs is None else num_reqs
            published[:rows] = table.block_table.np[:rows]

    # -- set-up --------------------------------------------------------------------------

    @initialize(config=st.sampled_from(CONFIGS))
    def build(self, config: NewTables) -> None:
        self.lockstep(config)
        event(f"config: {config.block_sizes}/{config.kernel_block_sizes} "
              f"dcp {config.dcp_world_size} {config.backend}")
        self.published = [t.block_table.gpu.numpy().copy()
                          for t in self.adapter.tables.block_tables]

    # -- rules: what the model runner does -------------------------------------------------

    @rule(row=row_indices, ids=st.lists(block_lists, min_size=2, max_size=2))
    def add_row(self, row: int, ids: list[list[int]]) -> None:
        if len(self.spec.tables[0][row]) > len(ids[0]):
            event("add_row leaves a stale tail")
        self.lockstep(AddRow(row, self._ids(ids)))

    @rule(row=row_indices, ids=st.lists(block_lists, min_size=2, max_size=2))
    def append_row(self, row: int, ids: list[list[int]]) -> None:
        if len(self.spec.tables[0][row]) + len(ids[0]) > MAX_BLOCKS:
            event("append past the row's capacity")
        self.lockstep(AppendRow(row, self._ids(ids)))

    @rule(src=row_indices, tgt=row_indices)
    def move_row(self, src: int, tgt: int) -> None:
        self.lockstep(MoveRow(src, tgt))

    @rule(src=row_indices, tgt=row_indices)
    def swap_row(self, src: int, tgt: int) -> None:
        event("swap a row with itself" if src == tgt else "swap")
        self.lockstep(SwapRow(src, tgt))

    @rule(row=row_indices)
    def clear_row(self, row: int) -> None:
        self.lockstep(ClearRow(row))

    @rule(num_reqs=st.integers(0, NUM_ROWS))
    def commit_block_table(self, num_reqs: int) -> None:
        event("commit some rows" if num_reqs < NUM_ROWS else "commit all rows")
        self.lockstep(CommitBlockTable(num_reqs))
        self._publish(num_reqs)

    @rule(data=st.data())
    def compute_slot_mapping(self, data: st.DataObject) -> None:
        config = self.spec.config
        # Positions every group's row covers (the groups share the batch).
        covered = [min(len(table[row]) * size * config.dcp_world_size
                       for table, size in zip(self.spec.tables, config.block_sizes,
                                              strict=True))
                   for row in range(NUM_ROWS)]
        rows = [row for row in range(NUM_ROWS) if covered[row]]
        num_tokens = data.draw(st.integers(0, NUM_SLOTS if rows else 0))
        pairs = [(row, data.draw(st.integers(0, covered[row] - 1)))
                 for row in (data.draw(st.sampled_from(rows)) for _ in range(num_tokens))]
        event(f"{num_tokens} tokens" if num_tokens in (0, NUM_SLOTS) else "some tokens")
        self.lockstep(ComputeSlotMapping(tuple(r for r, _ in pairs), tuple(p for _, p in pairs)))
        if config.backend != "numpy":
            self._publish()  # the device computation publishes the whole table first

    # -- rules: bad calls, each refused with a typed error and no change ------------------

    @bad_call(row=row_indices, bad=st.sampled_from([-1, NUM_BLOCKS, 2**40]),
              group=st.integers(0, 1),
          append=st.booleans())
    def bad_block_outside_pool(self, row: int, bad: int, group: int, append: bool) -> None:
        ids = tuple((bad,) if g == group % self.num_groups else () for g in range(
            self.num_groups))
        self.refuse(AppendRow(row, ids) if append else AddRow(row, ids))

    @bad_call(bad=st.sampled_from([-1, NUM_ROWS, NUM_ROWS + 5]), good=row_indices,
          operation=st.sampled_from(["add_row", "append_row", "move_row", "swap_row",
                                     "clear_row", "move_row to"]))
    def bad_row_outside_table(self, bad: int, good: int, operation: str) -> None:
        ids = tuple((0,) for _ in range(self.num_groups))
        command: Any = {
            "add_row": AddRow(bad, ids), "append_row": AppendRow(bad, ids),
            "move_row": MoveRow(bad, good), "swap_row": SwapRow(bad, good),
            "clear_row": ClearRow(bad), "move_row to": MoveRow(good, bad)}[operation]
        self.refuse(command)

    @bad_call(lambda self: self.built and bool(self.spec.tables[0][0]))
    def bad_batch_negative_position(self) -> None:
        self.refuse(ComputeSlotMapping((0, 1), (0, -3)))

    @bad_call()
    def bad_batch_row_outside_table(self) -> None:
        self.refuse(ComputeSlotMapping((NUM_ROWS,), (0,)))

    @bad_call(lambda self: self.built and bool(self.spec.tables[0][0]))
    def bad_batch_lengths_differ(self) -> None:
        self.refuse(ComputeSlotMapping((0, 1), (0,)))

    # -- invariants ----------------------------------------------------------------------

    def state_from_view(self, view: Any) -> TablesState:
        """The target's rows in the spec's terms (kernel blocks back to manager blocks)."""
        tables = tuple(tuple(tuple(b // limits.blocks_per_kv_block
                                   for b in row[::limits.blocks_per_kv_block]) for row in rows)
                       for rows, limits in zip(view, self.spec.limits, strict=True))
        return replace(self.spec, tables=tables)

    @invariant()
    def invariant_table_invariants_hold(self) -> None:
        """Every named invariant of the table model holds on the target's rows."""
        if not self.built:
            return
        state = self.target_state()
        for table, limits in zip(state.tables, state.limits, strict=True):
            broken = model.violated_invariants(table, limits)
            assert not broken, f"invariants violated by the target: {broken}"

    @invariant()
    def rows_are_the_spec_rows(self) -> None:
        if not self.built:
            return
        actual, expected = self.target_view(), view_of(self.spec)
        assert actual == expected, f"rows: target {actual}, spec {expected}"

    @invariant()
    def every_block_maps_its_tokens(self) -> None:
        """One token in each block of each row (numpy path: it changes no table)."""
        if not self.built or self.spec.config.backend != "numpy":
            return
        config = self.spec.config
        for table, rows, limits in zip(self.adapter.tables.block_tables, self.spec.tables,
                                       self.spec.limits, strict=True):
            kernel_rows = tuple(slots.kernel_row(row, limits.blocks_per_kv_block) for row in rows)
            span = table.block_size * config.dcp_world_size
            tokens = [(r, j * span + (span - 1 - config.dcp_rank))
                      for r, row in enumerate(kernel_rows) for j in range(len(row))]
            for first in range(0, len(tokens), NUM_SLOTS):
                chunk = tokens[first:first + NUM_SLOTS]
                req_indices = tuple(r for r, _ in chunk)
                positions = tuple(p for _, p in chunk)
                table.compute_slot_mapping(np.array(req_indices, dtype=np.int64),
                                           np.array(positions, dtype=np.int64))
                actual = tuple(table.slot_mapping.np.tolist())
                expected = slots.batch_slot_mapping(
                    kernel_rows, req_indices, positions, table.block_size, NUM_SLOTS,
                    config.dcp_world_size, config.dcp_rank, config.interleave)
                assert actual == expected, \
                    f"slot mapping of every block: target {actual}, spec {expected}"

    @invariant()
    def device_table_is_what_was_published(self) -> None:
        import torch

        if not self.built:
            return
        for published, table in zip(self.published, self.adapter.tables.block_tables,
                                    strict=True):
            np.testing.assert_array_equal(table.block_table.gpu.numpy(), published)
            assert table.block_table.gpu.dtype == torch.int32


# Calls no caller within vLLM's contract makes: `kvspec audit --scope contract` leaves them out.
OUT_OF_CONTRACT = BlockTableMachine.bad_call_rules


def machine_for(make_adapter: Callable[[], TablesAdapter] = TablesAdapter,
                ) -> type[BlockTableMachine]:
    """A BlockTableMachine subclass checking adapters made by make_adapter."""
    return BlockTableMachine.for_target(make_adapter)
