"""Hostile input to the worker's block tables (impl/block_table.py), their slot-mapping helpers
and ``CpuGpuBuffer`` (impl/utils.py).

Subjects are ``MultiGroupBlockTable``s of 1 to 3 KV-cache groups (plain or kernel blocks, with
or without context parallelism, the numpy slot mapping or the torch-ops device path, a known
or unknown pool size) after a random run of valid operations: rows added, appended, moved,
swapped and cleared, direct writes declared with ``mark_dirty``, batches mapped and committed,
some rows published and others not. A bad call goes to the multi-group table or to one
group's ``BlockTable``. The snapshot is everything a caller can see, per group: the host
table, the block counts, the slot buffer, and the device copies of the table and the slots
(separate CPU tensors on this machine).

A refusal could also damage what the snapshot cannot see (the int64 slot shadow, the record
of what the next commit must copy), so after each call the table must still work: a full
commit publishes exactly the host table, and every token of every row maps to the slot
spec/slot_mapping.py gives it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from kvspec.impl import block_table as bt, slot_mapping_triton
from kvspec.impl.block_table import BlockTable, MultiGroupBlockTable
from kvspec.impl.checks import as_int
from kvspec.impl.utils import CpuGpuBuffer
from kvspec.spec import slot_mapping as spec
from tests.hostile import BadCall, Verdict, check, judge
from tests.hostile.values import (
    Bad,
    HalfwayError,
    Opaque,
    bad_count,
    bad_int,
    bad_positive,
    halfway,
    not_a_bool,
)

# The device copy is a separate tensor even on the CPU; a refused call must not touch it.
DEVICE = "cpu"
# Sizes no machine can allocate (a table of 2**48 entries fails at once; smaller "huge" sizes
# such as 2**31 tokens could be allocated and would fill this machine's memory).
ENORMOUS = [2**48, 2**62, 2**63, 2**64, 2**100]
NUMPY_INTEGER_ACCEPTED = ("a numpy integer in range: the worker computes indices and counts "
                          "with numpy, and its value is exact")


def _call(describe: str, run: Callable[[Any], object], bad: Bad | None = None,
          **kwargs: Any) -> BadCall:
    if bad is None:
        return BadCall(describe, run, **kwargs)
    return BadCall(describe, run, bad.value, bad.forms, **kwargs)


def _numpy_in_range(bad: Bad, low: int, high: int) -> str:
    """The acceptance reason when ``bad`` is a numpy integer in ``[low, high]``, else ''."""
    value = bad.value
    if isinstance(value, np.integer) and not isinstance(value, np.bool_) and (
            low <= int(value) <= high):
        return NUMPY_INTEGER_ACCEPTED
    return ""


# ---------------------------------------------------------------------- subjects


@dataclass(frozen=True)
class Layout:
    block_sizes: tuple[int, ...]         # the manager's, per group
    kernel_block_sizes: tuple[int, ...]
    max_num_blocks: tuple[int, ...]      # manager blocks per row, per group
    max_num_reqs: int
    max_num_batched_tokens: int
    pcp_world_size: int
    pcp_rank: int
    dcp_world_size: int
    dcp_rank: int
    interleave: int
    num_blocks: int | None
    backend: str

    @property
    def num_groups(self) -> int:
        return len(self.block_sizes)

    @property
    def cp_world_size(self) -> int:
        return self.pcp_world_size * self.dcp_world_size

    @property
    def cp_rank(self) -> int:
        return self.pcp_rank * self.dcp_world_size + self.dcp_rank

    def factor(self, group: int) -> int:
        return self.block_sizes[group] // self.kernel_block_sizes[group]

    def block_id_limit(self, group: int) -> int:
        bound = bt.INT32_LIMIT // self.factor(group)
        return bound if self.num_blocks is None else min(self.num_blocks, bound)

    def build(self) -> MultiGroupBlockTable:
        return MultiGroupBlockTable(
            self.max_num_reqs, 64, self.max_num_batched_tokens, False, DEVICE,
            list(self.block_sizes), list(self.kernel_block_sizes),
            cp_kv_cache_interleave_size=self.interleave, max_num_blocks=list(self.max_num_blocks),
            pcp_world_size=self.pcp_world_size, pcp_rank=self.pcp_rank,
            dcp_world_size=self.dcp_world_size, dcp_rank=self.dcp_rank,
            num_blocks=self.num_blocks, slot_mapping_backend=self.backend,
        )


@st.composite
def layouts(draw: st.DrawFn) -> Layout:
    num_groups = draw(st.integers(1, 3))
    pcp, dcp = draw(st.sampled_from([(1, 1), (1, 1), (1, 2), (2, 1), (2, 2)]))
    kernel_sizes = tuple(draw(st.sampled_from([1, 2, 4])) for _ in range(num_groups))
    factors = tuple(draw(st.sampled_from([1, 1, 2, 3])) for _ in range(num_groups))
    smallest = min(kernel_sizes)  # 1, 2 or 4: its divisors divide every kernel size
    return Layout(
        block_sizes=tuple(k * f for k, f in zip(kernel_sizes, factors, strict=True)),
        kernel_block_sizes=kernel_sizes,
        # Now and then a table wide or tall enough that its limits pass 2**7 (a negative
        # int8 position or row viewed as unsigned is below them).
        max_num_blocks=tuple(draw(st.sampled_from([1, 2, 3, 4, 40])) for _ in range(num_groups)),
        max_num_reqs=draw(st.sampled_from([1, 2, 3, 4, 130])),
        max_num_batched_tokens=draw(st.integers(1, 12)),
        pcp_world_size=pcp, pcp_rank=draw(st.integers(0, pcp - 1)),
        dcp_world_size=dcp, dcp_rank=draw(st.integers(0, dcp - 1)),
        interleave=1 if pcp * dcp == 1 else draw(st.sampled_from(
            [d for d in (1, 2, 4) if smallest % d == 0])),
        num_blocks=draw(st.sampled_from([None, 6, 9, 20])),
        backend=draw(st.sampled_from(["numpy", "numpy", "numpy", "torch"])),
    )


@dataclass
class TableSubject:
    layout: Layout
    tables: MultiGroupBlockTable

    def table(self, group: int | None) -> Any:
        """The target of a call: the multi-group table (None) or one group's table."""
        return self.tables if group is None else self.tables.block_tables[group]

    def manager_counts(self, group: int) -> list[int]:
        """Manager blocks per row of ``group``."""
        table = self.tables.block_tables[group]
        return [int(c) // self.layout.factor(group) for c in table.num_blocks_per_row]

    def covered(self, row: int) -> int:
        """How many positions of ``row`` every group's blocks cover (the groups share a
        batch)."""
        return min(int(t.num_blocks_per_row[row]) * t.block_size * self.layout.cp_world_size
                   for t in self.tables.block_tables)

    def __repr__(self) -> str:
        return f"TableSubject({self.layout})"


def _ids(draw: st.DrawFn, layout: Layout, group: int, max_size: int) -> Any:
    """Valid block ids for ``group``, as a list, a tuple or an array (the forms vLLM's
    callers and numpy code pass)."""
    limit = min(layout.block_id_limit(group), 64)
    ids = draw(st.lists(st.integers(0, limit - 1), max_size=max_size))
    form = draw(st.sampled_from(["list", "list", "list", "tuple", "int64", "int32", "np ints"]))
    if form == "tuple":
        return tuple(ids)
    if form == "int64":
        return np.array(ids, dtype=np.int64)
    if form == "int32":
        return np.array(ids, dtype=np.int32)
    if form == "np ints":
        return [np.int64(i) for i in ids]
    return ids


@st.composite
def _valid_batch(draw: st.DrawFn, s: TableSubject) -> tuple[Any, Any, int]:
    """A batch every group's rows cover, in one of the forms the slot mapping takes."""
    rows = [row for row in range(s.layout.max_num_reqs) if s.covered(row)]
    num_tokens = draw(st.integers(0, s.layout.max_num_batched_tokens if rows else 0))
    req_indices, positions = [], []
    for _ in range(num_tokens):
        row = draw(st.sampled_from(rows))
        req_indices.append(row)
        positions.append(draw(st.integers(0, s.covered(row) - 1)))
    form = draw(st.sampled_from(["int64", "int64", "int32", "list", "tensor"]))
    if form == "list":
        return req_indices, positions, num_tokens
    if form == "tensor":
        return torch.tensor(req_indices, dtype=torch.int64), torch.tensor(
            positions, dtype=torch.int64), num_tokens
    dtype = np.int64 if form == "int64" else np.int32
    return np.array(req_indices, dtype=dtype), np.array(positions, dtype=dtype), num_tokens


@st.composite
def tables(draw: st.DrawFn) -> TableSubject:
    layout = draw(layouts())
    s = TableSubject(layout, layout.build())
    rows = st.integers(0, layout.max_num_reqs - 1)
    for _ in range(draw(st.integers(0, 10))):
        action = draw(st.sampled_from(["add", "add", "append", "append", "move", "swap",
                                       "clear_row", "commit", "slots", "direct write",
                                       "clear"]))
        if action in ("add", "append"):
            row = draw(rows)
            room = [layout.max_num_blocks[g] - (s.manager_counts(g)[row] if action == "append"
                                                else 0) for g in range(layout.num_groups)]
            ids = tuple(_ids(draw, layout, g, room[g]) for g in range(layout.num_groups))
            (s.tables.add_row if action == "add" else s.tables.append_row)(ids, row)
        elif action in ("move", "swap"):
            src, tgt = draw(rows), draw(rows)
            (s.tables.move_row if action == "move" else s.tables.swap_row)(src, tgt)
        elif action == "clear_row":
            s.tables.clear_row(draw(rows))
        elif action == "commit":
            s.tables.commit_block_table(draw(st.integers(0, layout.max_num_reqs)))
        elif action == "slots":
            req_indices, positions, _ = draw(_valid_batch(s))
            s.tables.compute_slot_mapping(req_indices, positions)
            s.tables.commit_slot_mapping(draw(st.integers(0, layout.max_num_batched_tokens)))
        elif action == "direct write":
            # A caller writing the host table itself, and declaring it.
            group = draw(st.integers(0, layout.num_groups - 1))
            table = s.tables.block_tables[group]
            row = draw(rows)
            count = int(table.num_blocks_per_row[row])
            if count:
                kernel_limit = min(layout.block_id_limit(group) * layout.factor(group), 64)
                table.get_numpy_array()[row, draw(st.integers(0, count - 1))] = draw(
                    st.integers(0, kernel_limit - 1))
                table.mark_dirty()
        else:
            s.tables.clear()
    return s


def table_snapshot(s: TableSubject) -> object:
    return tuple(
        (t.block_table.np.tolist(), t.num_blocks_per_row.tolist(), t.slot_mapping.np.tolist(),
         t.block_table.gpu.tolist(), t.slot_mapping.gpu.tolist(), str(t.block_table.gpu.dtype))
        for t in s.tables.block_tables
    )


def assert_still_consistent(s: TableSubject) -> None:
    """The table still works: a full commit publishes the host table, and every token of
    every row gets the spec's slot (reads the shadow and the dirty record a snapshot does not
    show)."""
    layout = s.layout
    for table in s.tables.block_tables:
        table.commit_block_table(layout.max_num_reqs)
        assert table.block_table.gpu.tolist() == table.block_table.np.tolist(), (
            "a full commit did not publish the host table")
        counts = table.num_blocks_per_row.tolist()
        kernel_rows = tuple(tuple(table.block_table.np[row, :count].tolist())
                            for row, count in enumerate(counts))
        span = table.block_size * layout.cp_world_size
        tokens = [(row, position) for row, blocks in enumerate(kernel_rows)
                  for position in range(len(blocks) * span)]
        for first in range(0, len(tokens), layout.max_num_batched_tokens):
            chunk = tokens[first: first + layout.max_num_batched_tokens]
            req_indices = tuple(row for row, _ in chunk)
            positions = tuple(position for _, position in chunk)
            table.compute_slot_mapping(np.array(req_indices, dtype=np.int64),
                                       np.array(positions, dtype=np.int64))
            table.commit_slot_mapping(len(chunk))
            expected = list(spec.batch_slot_mapping(
                kernel_rows, req_indices, positions, table.block_size,
                layout.max_num_batched_tokens, layout.cp_world_size, layout.cp_rank,
                layout.interleave))
            assert table.slot_mapping.gpu.tolist() == expected, "slots differ from the spec"
            if layout.backend == "numpy":
                assert table.slot_mapping.np.tolist() == expected, "slots differ from the spec"


# ---------------------------------------------------------------------- bad values


def _bad(value: Any, label: str | None = None, *named: str) -> Bad:
    return Bad(value, label if label is not None else repr(value), tuple(named))


# An element of a block id list that is not a block id (numpy integers are block ids).
_NOT_BLOCK_IDS = [
    _bad(1.5), _bad(3.0), _bad(None), _bad("3"), _bad(True), _bad(False), _bad(1 + 0j),
    _bad([1]), _bad(Opaque()), _bad(np.float64(1.0), "np.float64(1.0)", "np.float64(1.0)"),
    _bad(np.bool_(True), "np.True_", "np.True_", "True"),
]


def _out_of_pool(limit: int) -> list[Bad]:
    values = [-1, -(2**31), limit, limit + 5, 2**31, 2**40, 2**63 - 1, 2**63, 2**64, 2**70]
    return [_bad(v) for v in dict.fromkeys(values) if not 0 <= v < limit]


def _bad_id_arrays(limit: int) -> list[Bad]:
    """Whole block-id arguments that numpy or torch hold."""
    return [
        _bad(np.array([-1], dtype=np.int8), "np.int8([-1])", "-1"),
        _bad(np.array([1, -1], dtype=np.int16), "np.int16([1, -1])", "-1"),
        _bad(np.array([-128], dtype=np.int8), "np.int8([-128])", "-128"),
        _bad(np.array([-1], dtype=np.int32), "np.int32([-1])", "-1"),
        _bad(np.array([0, limit], dtype=np.int64), f"np.int64([0, {limit}])", str(limit)),
        _bad(np.array([2**64 - 1], dtype=np.uint64), "np.uint64([2**64 - 1])",
             str(2**64 - 1)),
        _bad(np.array([1.0]), "np.array([1.0])", "float64"),
        _bad(np.array([True]), "np.array([True])", "bool"),
        _bad(np.array([[1]]), "np.array([[1]])", "(1, 1)"),
        _bad(np.array(3), "np.array(3) (0-d)", "()"),
        _bad(np.array(["1"]), "np.array(['1'])", "<U1"),
        _bad(np.array([1, None], dtype=object), "np.array([1, None], dtype=object)", "None"),
        _bad(np.zeros((0, 1), dtype=np.float32), "an empty 2-D float32 array", "(0, 1)"),
        _bad(torch.tensor([-1], dtype=torch.int8), "torch.tensor([-1], dtype=torch.int8)",
             "-1"),
        _bad(torch.tensor([1.0]), "torch.tensor([1.0])", "torch.float32"),
        _bad(torch.tensor([1.0], dtype=torch.bfloat16), "a bfloat16 tensor", "torch.bfloat16"),
    ]


_NOT_SEQUENCES = [
    _bad(None), _bad(3), _bad(2.5), _bad(Opaque()), _bad("12"), _bad(b"\x01\x02"),
    _bad({1, 2}), _bad({1: 2}), _bad([[1], [1, 2]], "[[1], [1, 2]] (ragged)", "[1]"),
]


@st.composite
def bad_block_ids(draw: st.DrawFn, s: TableSubject, group: int, room: int) -> tuple[Bad, Any]:
    """(the bad value, the block-id argument holding it) for one group."""
    limit = s.layout.block_id_limit(group)
    kind = draw(st.sampled_from(["element", "element", "out of pool", "array",
                                 "not a sequence", "overflow", "overflow"]))
    valid = st.integers(0, min(limit, 64) - 1)
    good = draw(st.lists(valid, max_size=max(0, min(room, 2))))
    if kind == "overflow":
        capacity = s.layout.max_num_blocks[group]
        ids = draw(st.lists(valid, min_size=room + 1, max_size=room + 2))
        return _bad(ids, f"{len(ids)} blocks into a row with room for {room}",
                    f"max_num_blocks_per_req={capacity}"), ids
    if kind == "array":
        bad = draw(st.sampled_from(_bad_id_arrays(limit)))
        return bad, bad.value
    if kind == "not a sequence":
        bad = draw(st.sampled_from(_NOT_SEQUENCES))
        return bad, bad.value
    bad = draw(st.sampled_from(_NOT_BLOCK_IDS if kind == "element" else _out_of_pool(limit)))
    position = draw(st.integers(0, len(good)))
    ids = [*good[:position], bad.value, *good[position:]]
    if draw(st.booleans()):
        return Bad(bad.value, f"({', '.join(map(repr, ids))},)", bad.forms), tuple(ids)
    return Bad(bad.value, repr(ids), bad.forms), ids


def _row_bad(draw: st.DrawFn, s: TableSubject) -> tuple[Bad, str]:
    bad = draw(bad_int(0, s.layout.max_num_reqs - 1).filter(lambda b: not isinstance(
        b.value, list)))
    return bad, _numpy_in_range(bad, 0, s.layout.max_num_reqs - 1)


def _group(draw: st.DrawFn, s: TableSubject) -> int | None:
    """The target: the multi-group table (None) or one group's table."""
    group: int | None = draw(st.sampled_from([None, *range(s.layout.num_groups)]))
    return group


def _name(group: int | None) -> str:
    return "tables" if group is None else f"tables[{group}]"


# ---------------------------------------------------------------------- bad calls


@st.composite
def table_bad_calls(draw: st.DrawFn, s: TableSubject) -> BadCall:
    # Row writes have the most ways to go wrong (and to leave one group changed): drawn
    # three times as often as the other operations.
    operation = draw(st.sampled_from([*sorted(_TABLE_CALLS), *["append_row", "add_row"] * 2]))
    call: BadCall = draw(_TABLE_CALLS[operation](s))
    return BadCall(call.describe, call.run, call.bad, call.named, call.propagates,
                   call.accepted, operation)


@st.composite
def _row_write(draw: st.DrawFn, s: TableSubject, operation: str) -> BadCall:
    """append_row or add_row with a bad argument."""
    layout = s.layout
    group = _group(draw, s) if draw(st.booleans()) else None  # mostly every group
    # Mostly a row that holds blocks: a refusal that touched it shows.
    filled = [row for row in range(layout.max_num_reqs) if s.covered(row)]
    prefer_filled = bool(filled) and draw(st.booleans())
    row = draw(st.sampled_from(filled) if prefer_filled
               else st.integers(0, layout.max_num_reqs - 1))
    groups = [group] if group is not None else list(range(layout.num_groups))
    room = {g: layout.max_num_blocks[g] - (s.manager_counts(g)[row] if operation == "append_row"
                                           else 0) for g in groups}
    # The other groups' ids valid and, where they fit, not empty.
    good = {g: draw(st.lists(st.integers(0, min(layout.block_id_limit(g), 64) - 1),
                             min_size=min(1, room[g]), max_size=room[g])) for g in groups}
    which = draw(st.sampled_from(["ids", "ids", "ids", "row", "halfway"] + (
        ["groups"] if group is None else [])))

    def run_with(ids: Any, row_idx: Any) -> Callable[[TableSubject], object]:
        return lambda s: getattr(s.table(group), operation)(ids, row_idx)

    def as_argument(per_group: dict[int, Any]) -> Any:
        return per_group[group] if group is not None else tuple(
            per_group[g] for g in range(layout.num_groups))

    if which == "row":
        bad, accepted = _row_bad(draw, s)
        if accepted and operation == "append_row":
            # Appending to that row must fit.
            good = {g: [] for g in groups}
        return _call(f"{_name(group)}.{operation}(<valid ids>, {bad.label})",
                     run_with(as_argument(good), bad.value), bad, accepted=accepted)
    if which == "halfway":
        target = draw(st.sampled_from(groups))
        per_group: dict[int, Any] = dict(good)
        per_group[target] = halfway(good[target])
        describe = f"<iterator of {len(good[target])} ids, then fails>"
        if group is None and draw(st.booleans()):
            # The groups themselves come from an iterator.
            return _call(f"{_name(group)}.{operation}(<iterator of {layout.num_groups} "
                         f"groups, then fails>, {row})",
                         lambda s: getattr(s.tables, operation)(
                             halfway([good[g] for g in range(layout.num_groups)]), row),
                         named=("generator",), propagates=HalfwayError)
        return _call(f"{_name(group)}.{operation}({describe} for group {target}, {row})",
                     run_with(as_argument(per_group), row), named=("generator",),
                     propagates=HalfwayError)
    if which == "groups":
        kind = draw(st.sampled_from(["count", "not a sequence"]))
        if kind == "count":
            count = draw(st.sampled_from([0, layout.num_groups + 1, layout.num_groups + 2]))
            argument = tuple([0] for _ in range(count))
            return _call(f"tables.{operation}(<{count} groups of ids>, {row})",
                         lambda s: getattr(s.tables, operation)(argument, row),
                         named=(f"{count} block id lists",))
        bad = draw(st.sampled_from([_bad(None), _bad(3), _bad(Opaque()), _bad({0: [1]})]))
        return _call(f"tables.{operation}({bad.label}, {row})",
                     lambda s: getattr(s.tables, operation)(bad.value, row), bad)
    target = draw(st.sampled_from(groups))
    bad, ids = draw(bad_block_ids(s, target, room[target]))
    per_group = dict(good)
    per_group[target] = ids
    return _call(f"{_name(group)}.{operation}({bad.label} for group {target}, {row})",
                 run_with(as_argument(per_group), row), bad)


@st.composite
def _append_row(draw: st.DrawFn, s: TableSubject) -> BadCall:
    return draw(_row_write(s, "append_row"))


@st.composite
def _add_row(draw: st.DrawFn, s: TableSubject) -> BadCall:
    return draw(_row_write(s, "add_row"))


@st.composite
def _two_rows(draw: st.DrawFn, s: TableSubject, operation: str) -> BadCall:
    group = _group(draw, s)
    bad, accepted = _row_bad(draw, s)
    good = draw(st.integers(0, s.layout.max_num_reqs - 1))
    if draw(st.booleans()):
        return _call(f"{_name(group)}.{operation}({bad.label}, {good})",
                     lambda s: getattr(s.table(group), operation)(bad.value, good), bad,
                     accepted=accepted)
    return _call(f"{_name(group)}.{operation}({good}, {bad.label})",
                 lambda s: getattr(s.table(group), operation)(good, bad.value), bad,
                 accepted=accepted)


@st.composite
def _move_row(draw: st.DrawFn, s: TableSubject) -> BadCall:
    return draw(_two_rows(s, "move_row"))


@st.composite
def _swap_row(draw: st.DrawFn, s: TableSubject) -> BadCall:
    return draw(_two_rows(s, "swap_row"))


@st.composite
def _clear_row(draw: st.DrawFn, s: TableSubject) -> BadCall:
    group = _group(draw, s)
    bad, accepted = _row_bad(draw, s)
    return _call(f"{_name(group)}.clear_row({bad.label})",
                 lambda s: s.table(group).clear_row(bad.value), bad, accepted=accepted)


def _count_call(draw: st.DrawFn, s: TableSubject, operation: str, high: int,
                groups: bool = True) -> BadCall:
    group = _group(draw, s) if groups else draw(st.integers(0, s.layout.num_groups - 1))
    bad = draw(bad_count(high).filter(lambda b: not isinstance(b.value, list)))
    return _call(f"{_name(group)}.{operation}({bad.label})",
                 lambda s: getattr(s.table(group), operation)(bad.value), bad,
                 accepted=_numpy_in_range(bad, 0, high))


@st.composite
def _commit_block_table(draw: st.DrawFn, s: TableSubject) -> BadCall:
    return _count_call(draw, s, "commit_block_table", s.layout.max_num_reqs)


@st.composite
def _commit_slot_mapping(draw: st.DrawFn, s: TableSubject) -> BadCall:
    return _count_call(draw, s, "commit_slot_mapping", s.layout.max_num_batched_tokens)


@st.composite
def _get_device_tensor(draw: st.DrawFn, s: TableSubject) -> BadCall:
    return _count_call(draw, s, "get_device_tensor", s.layout.max_num_reqs, groups=False)


@st.composite
def _getitem(draw: st.DrawFn, s: TableSubject) -> BadCall:
    bad = draw(bad_int(0, s.layout.num_groups - 1).filter(lambda b: not isinstance(
        b.value, list)))
    return _call(f"tables[{bad.label}]", lambda s: s.tables[bad.value], bad,
                 accepted=_numpy_in_range(bad, 0, s.layout.num_groups - 1))


# Index arrays that are not a batch's request indices or positions.
_NOT_INDEX_ARRAYS = [
    _bad(np.array([0.0]), "np.array([0.0])", "float64"),
    _bad(np.array([False]), "np.array([False])", "bool"),
    _bad(np.array([0, None], dtype=object), "np.array([0, None], dtype=object)", "None"),
    _bad(np.array(["0"]), "np.array(['0'])", "<U1"),
    _bad([0.0], "[0.0]", "0.0"),
    _bad([None], "[None]", "None"),
    _bad([False], "[False]", "False"),
    _bad(torch.tensor([0.0]), "torch.tensor([0.0])", "torch.float32"),
    _bad(torch.tensor([0.0], dtype=torch.bfloat16), "a bfloat16 tensor", "torch.bfloat16"),
    _bad(torch.tensor([True]), "torch.tensor([True])", "torch.bool"),
    *_NOT_SEQUENCES[:-1],
    _bad([[0], [0, 1]], "[[0], [0, 1]] (ragged)", "[0]"),
]


@st.composite
def _compute_slot_mapping(draw: st.DrawFn, s: TableSubject) -> BadCall:
    layout = s.layout
    group = _group(draw, s)
    req_indices, positions, num_tokens = draw(_valid_batch(s))
    rows_list = [int(r) for r in req_indices]
    positions_list = [int(p) for p in positions]
    which = draw(st.sampled_from(["row", "position", "position", "type", "shape", "count",
                                  "halfway", "past the row"]))
    tensors_on_device = layout.backend != "numpy"

    def run(rows: Any, token_positions: Any) -> Callable[[TableSubject], object]:
        return lambda s: s.table(group).compute_slot_mapping(rows, token_positions)

    describe = f"{_name(group)}.compute_slot_mapping"
    if which in ("row", "position"):
        targets = s.tables.block_tables if group is None else [s.tables.block_tables[group]]
        limit = layout.max_num_reqs if which == "row" else min(
            t._position_limit for t in targets)
        value = draw(st.sampled_from([-1, -2, -128, limit, limit + 7, 2**31, 2**63 - 1]))
        dtype = draw(st.sampled_from(["int8", "int16", "int32", "int64", "uint64", "list",
                                      "tensor int8", "tensor int64"]))
        # One bad token among valid ones (leaving room for it in the buffer).
        rows = rows_list[: layout.max_num_batched_tokens - 1]
        token_positions = positions_list[: layout.max_num_batched_tokens - 1]
        index = draw(st.integers(0, len(rows)))
        rows.insert(index, value if which == "row" else 0)
        token_positions.insert(index, value if which == "position" else 0)
        rows_argument = _as_dtype(rows, dtype if which == "row" else "int64")
        positions_argument = _as_dtype(token_positions, dtype if which == "position"
                                       else "int64")
        if rows_argument is None or positions_argument is None:
            dtype = "list"  # the value does not fit the dtype: a list holds it
            rows_argument, positions_argument = rows, token_positions
        if dtype.startswith("tensor"):
            # The other argument a tensor too, so that the batch is one the device path takes.
            as_tensor = torch.tensor(rows if which == "position" else token_positions)
            if which == "row":
                positions_argument = as_tensor
            else:
                rows_argument = as_tensor
        accepted = ""
        if tensors_on_device and dtype.startswith("tensor"):
            accepted = ("a batch already on the device: checking it would cost a device "
                        "sync every step; tokens outside the table get the pad slot")
        bad = _bad(value, f"{value} as {dtype}", str(value))
        return _call(f"{describe}(<{which}s with {bad.label}>)",
                     run(rows_argument, positions_argument), bad, accepted=accepted)
    if which == "past the row":
        # A position inside the table's width but past the row's blocks.
        candidates = [(row, int(t.num_blocks_per_row[row]) * t.block_size
                       * layout.cp_world_size, t._position_limit)
                      for row in range(layout.max_num_reqs)
                      for t in ([s.tables.block_tables[group]] if group is not None
                                else s.tables.block_tables)]
        open_rows = [(row, covered, limit) for row, covered, limit in candidates
                     if covered < limit]
        if not open_rows:
            which = "type"
        else:
            row, covered, limit = draw(st.sampled_from(open_rows))
            position = draw(st.integers(covered, limit - 1))
            if group is None:
                position = min(position, min(t._position_limit
                                             for t in s.tables.block_tables) - 1)
            return _call(f"{describe}([{row}], [{position}]) (past the row's blocks)",
                         run(np.array([row]), np.array([position])),
                         _bad(position), accepted=(
                             "a position inside the table but past its row's blocks: the "
                             "slot of what the table holds there, as in vLLM"))
    if which == "type":
        bad = draw(st.sampled_from(_NOT_INDEX_ARRAYS))
        on_device = tensors_on_device and isinstance(bad.value, torch.Tensor)
        other: Any = torch.tensor([0]) if on_device else np.array([0])
        if draw(st.booleans()):
            return _call(f"{describe}({bad.label}, <one position>)", run(bad.value, other), bad)
        return _call(f"{describe}(<one row>, {bad.label})", run(other, bad.value), bad)
    if which == "shape":
        kind = draw(st.sampled_from(["lengths", "2-D", "0-d"]))
        tensor = tensors_on_device and draw(st.booleans())
        make: Callable[[Any], Any] = torch.tensor if tensor else np.array
        if kind == "lengths":
            rows_argument = make(rows_list + [0])
            named = (str(len(rows_list) + 1),)
            return _call(f"{describe}(<{len(rows_list) + 1} rows>, <{num_tokens} positions>)",
                         run(rows_argument, make(positions_list)), named=named)
        shaped = make([[0]]) if kind == "2-D" else make(0)
        named = ("(1, 1)",) if kind == "2-D" else ("()",)
        return _call(f"{describe}(<{kind} arrays>)", run(shaped, shaped), named=named)
    if which == "count":
        count = layout.max_num_batched_tokens + draw(st.sampled_from([1, 5]))
        zeros = np.zeros(count, dtype=draw(st.sampled_from([np.int64, np.int32])))
        return _call(f"{describe}(<{count} tokens>)", run(zeros, zeros), named=(str(count),))
    # halfway
    if draw(st.booleans()):
        return _call(f"{describe}(<iterator of rows, then fails>, <positions>)",
                     run(halfway(rows_list), positions_list), named=("generator",),
                     propagates=HalfwayError)
    return _call(f"{describe}(<rows>, <iterator of positions, then fails>)",
                 run(rows_list, halfway(positions_list)), named=("generator",),
                 propagates=HalfwayError)


def _as_dtype(values: list[int], dtype: str) -> Any:
    """``values`` in ``dtype``, or None when one does not fit it."""
    if dtype == "list":
        return values
    if dtype.startswith("tensor"):
        torch_dtype = torch.int8 if dtype == "tensor int8" else torch.int64
        info = torch.iinfo(torch_dtype)
        if any(not info.min <= v <= info.max for v in values):
            return None
        return torch.tensor(values, dtype=torch_dtype)
    numpy_info = np.iinfo(np.dtype(dtype))
    if any(not int(numpy_info.min) <= v <= int(numpy_info.max) for v in values):
        return None
    return np.array(values, dtype=dtype)


@st.composite
def _map_to_kernel_blocks(draw: st.DrawFn, s: TableSubject) -> BadCall:
    which = draw(st.sampled_from(["ids", "factor", "arange"]))
    ids, factor = np.array([1, 2], dtype=np.int64), 2
    arange = np.arange(2).reshape(1, -1)
    if which == "ids":
        bad = draw(st.sampled_from([
            _bad(np.array([1.0, 2.0]), "np.array([1.0, 2.0])", "float64"),
            _bad(np.array([-1], dtype=np.int8), "np.int8([-1])", "-1"),
            _bad(np.array([1, -3]), "np.array([1, -3])", "-3"),
            _bad([1, 2], "[1, 2] (a list)", "list"), _bad(None), _bad(Opaque()),
        ]))
        ids = bad.value
    elif which == "factor":
        bad = draw(bad_positive().filter(lambda b: not isinstance(b.value, list)))
        factor = bad.value
        if isinstance(factor, np.integer) and int(factor) >= 1:
            arange = np.arange(int(factor)).reshape(1, -1)
    else:
        bad = draw(st.sampled_from([
            _bad(np.arange(3).reshape(1, -1), "np.arange(3).reshape(1, -1)", "(1, 3)"),
            _bad(np.array([[1, 0]]), "np.array([[1, 0]])", "array([[1, 0]])"),
            _bad(np.arange(2), "np.arange(2) (1-D)", "(2,)"), _bad(None),
        ]))
        arange = bad.value
    accepted = ""
    if which == "factor":
        accepted = _numpy_in_range(bad, 1, 2**31)
    return _call(f"BlockTable.map_to_kernel_blocks(<{which}: {bad.label}>)",
                 lambda s: BlockTable.map_to_kernel_blocks(ids, factor, arange), bad,
                 accepted=accepted)


_TABLE_CALLS: dict[str, Any] = {
    "append_row": _append_row,
    "add_row": _add_row,
    "move_row": _move_row,
    "swap_row": _swap_row,
    "clear_row": _clear_row,
    "commit_block_table": _commit_block_table,
    "commit_slot_mapping": _commit_slot_mapping,
    "compute_slot_mapping": _compute_slot_mapping,
    "get_device_tensor": _get_device_tensor,
    "__getitem__": _getitem,
    "map_to_kernel_blocks": _map_to_kernel_blocks,
}


@given(st.data())
def test_block_tables_refuse_bad_calls_and_change_nothing(data: st.DataObject) -> None:
    subject = data.draw(tables())
    call = data.draw(table_bad_calls(subject))
    check(subject, table_snapshot, call)
    assert_still_consistent(subject)


def test_refused_row_writes_leave_every_group_and_slot_as_it_was() -> None:
    """Two refusals that a snapshot of one group, or of the host table alone, would miss:
    a bad id in the second group (the first group's row must not be appended), and an
    add_row of too many blocks (the int64 slot shadow of the row must not be rewritten)."""
    layout = Layout((4, 4), (4, 2), (3, 3), 2, 12, 1, 0, 1, 0, 1, 20, "numpy")
    subject = TableSubject(layout, layout.build())
    subject.tables.add_row(([5, 6], [7]), 0)
    subject.tables.commit_block_table(1)
    for call in (
        _call("tables.append_row(([1], [20]), 0)",
              lambda s: s.tables.append_row(([1], [20]), 0), _bad(20)),
        _call("tables.add_row(([9, 9, 9, 9], [1]), 0)",
              lambda s: s.tables.add_row(([9, 9, 9, 9], [1]), 0),
              named=("max_num_blocks_per_req=3",)),
    ):
        verdict, detail = judge(subject, table_snapshot, call)
        assert verdict is Verdict.REFUSED, f"{call.describe}\n  {verdict.value}\n  {detail}"
    assert_still_consistent(subject)


@given(st.data())
def test_a_table_of_no_groups_accepts_every_call_and_changes_nothing(data: st.DataObject) -> None:
    """vLLM builds a MultiGroupBlockTable of no groups for a model without KV cache."""
    tables = MultiGroupBlockTable(2, 16, 8, False, DEVICE, [], [])
    bad = data.draw(bad_int(0, 1).filter(lambda b: not isinstance(b.value, list)))
    operation = data.draw(st.sampled_from(["move_row", "clear_row", "commit_block_table",
                                           "commit_slot_mapping", "append_row"]))
    arguments: tuple[Any, ...] = {"move_row": (bad.value, 0), "append_row": ((), bad.value)}.get(
        operation, (bad.value,))
    check(tables, lambda t: len(t), _call(
        f"<no groups>.{operation}{arguments}", lambda t: getattr(t, operation)(*arguments), bad,
        accepted="a table of no KV-cache groups: nothing to change or to check against",
        operation=operation))


# ---------------------------------------------------------------------- the cases


def _plain_table(kernel_block_size: int = 4, num_blocks: int | None = 1000,
                 max_num_reqs: int = 2, max_num_blocks_per_req: int = 3) -> BlockTable:
    table = BlockTable(4, max_num_reqs, max_num_blocks_per_req, 8, False, DEVICE,
                       kernel_block_size, num_blocks=num_blocks)
    table.add_row([5, 6], 0)
    table.commit_block_table(max_num_reqs)
    return table


@pytest.mark.parametrize("kernel_block_size", [4, 2])
@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32])
def test_narrow_signed_block_ids_are_not_read_as_unsigned(
        dtype: type[np.signedinteger[Any]], kernel_block_size: int) -> None:
    """np.int8([-1]) once passed the check as 255 (below the int32 bound on block ids): the
    row got block -1."""
    table = _plain_table(kernel_block_size, num_blocks=None)
    before = (table.block_table.np.tolist(), table.num_blocks_per_row.tolist())
    for operation in (table.append_row, table.add_row):
        with pytest.raises(bt.BlockIdError, match="-1"):
            operation(np.array([3, -1], dtype=dtype), 1)
    assert (table.block_table.np.tolist(), table.num_blocks_per_row.tolist()) == before


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32])
def test_narrow_signed_positions_and_rows_are_not_read_as_unsigned(
        dtype: type[np.signedinteger[Any]]) -> None:
    """int16 positions of -1 once passed as 65535 (below the limit of a table 20,000 blocks
    wide) and mapped to a far slot; an int8 row of -1 passed as 255 in a table of 300 rows."""
    wide = _plain_table(max_num_blocks_per_req=20_000)
    tall = _plain_table(max_num_reqs=300 if dtype == np.int8 else 70_000)
    for table in (wide, tall):
        table.compute_slot_mapping(np.array([0], dtype=dtype), np.array([1], dtype=dtype))
        before = table.slot_mapping.np.tolist()
        with pytest.raises(bt.PositionError, match="-1"):
            table.compute_slot_mapping(np.array([0, 0], dtype=dtype),
                                       np.array([2, -1], dtype=dtype))
        with pytest.raises(bt.RowIndexError, match="-1"):
            table.compute_slot_mapping(np.array([-1], dtype=dtype), np.array([0], dtype=dtype))
        assert table.slot_mapping.np.tolist() == before


@pytest.mark.parametrize("num_reqs", [1.5, 0.5, "2", None, True])
def test_commit_of_a_count_that_is_not_an_int_copies_nothing(num_reqs: Any) -> None:
    """commit_block_table(1.5) once copied part of the table, then raised a TypeError."""
    table = BlockTable(4, 4, 3, 8, False, DEVICE, 4)
    table.commit_block_table(4)
    table.append_row([1, 2], 0)  # logged cells
    table.add_row(list(range(3)), 3)  # a dirty row
    with pytest.raises(bt.RowIndexError, match=repr(num_reqs)):
        table.commit_block_table(num_reqs)
    assert not table.block_table.gpu.any()
    table.commit_block_table(4)
    assert table.block_table.gpu.tolist() == table.block_table.np.tolist()


def test_lists_with_bools_are_not_block_ids() -> None:
    """numpy turns [True, 2] into [1, 2]: a list is checked element by element."""
    table = _plain_table()
    with pytest.raises(bt.BlockIdError, match="True"):
        table.append_row([2, True] + [1] * 70, 1)  # past the short-list path
    with pytest.raises(bt.BlockIdError, match="True"):
        table.append_row([True, 2], 1)
    assert table.num_blocks_per_row.tolist() == [2, 0]


def test_byte_swapped_arrays_are_read_by_value() -> None:
    """A big-endian array is a valid array of ints (not refused as huge)."""
    table = _plain_table()
    table.append_row(np.array([7], dtype=">i8"), 1)
    table.compute_slot_mapping(np.array([0, 1], dtype=">i4"), np.array([5, 2], dtype=">i8"))
    assert table.slot_mapping.np[:3].tolist() == [6 * 4 + 1, 7 * 4 + 2, -1]


# ---------------------------------------------------------------------- constructors

_TABLE_ARGUMENTS: dict[str, Any] = {
    "block_size": 4, "max_num_reqs": 2, "max_num_blocks_per_req": 3,
    "max_num_batched_tokens": 8, "pin_memory": False, "device": DEVICE,
    "kernel_block_size": 4, "cp_kv_cache_interleave_size": 1, "pcp_world_size": 1,
    "pcp_rank": 0, "dcp_world_size": 1, "dcp_rank": 0, "num_blocks": None,
    "slot_mapping_backend": "numpy",
}
_SIZES = ["block_size", "max_num_reqs", "max_num_blocks_per_req", "max_num_batched_tokens",
          "kernel_block_size", "cp_kv_cache_interleave_size", "pcp_world_size",
          "dcp_world_size", "num_blocks"]
_BAD_DEVICES = [_bad("nonsense"), _bad(None), _bad(3.5), _bad(Opaque()),
                _bad("cuda:7" if torch.cuda.is_available() else "cuda", None)]
_BAD_BACKENDS = [_bad("cuda-graphs"), _bad(None), _bad(["numpy"], "['numpy']"), _bad(3)]


def _enormous() -> st.SearchStrategy[Bad]:
    return st.sampled_from(ENORMOUS).map(_bad)


@pytest.mark.parametrize("table", ["BlockTable", "MultiGroupBlockTable"])
@pytest.mark.parametrize("kind", ["pcp", "dcp"])
def test_a_rank_of_none_with_its_world_size_given_is_refused(table: str, kind: str) -> None:
    """``pcp_rank=None`` means the process's rank, which belongs to the process's world size
    (1 here): with ``pcp_world_size=2`` given it is refused, not taken as rank 0."""
    context: dict[str, Any] = {f"{kind}_world_size": 2, f"{kind}_rank": None}

    def build(_: Any) -> object:
        if table == "BlockTable":
            return BlockTable(**{**_TABLE_ARGUMENTS, **context})
        return MultiGroupBlockTable(2, 16, 8, False, DEVICE, [4], [4], **context)

    call = _call(f"{table}({kind}_world_size=2, {kind}_rank=None)", build,
                 _bad(None, "None", f"{kind}_rank=None"), operation=f"{kind}_rank")
    verdict, detail = judge(None, lambda _: None, call)
    if verdict is not Verdict.REFUSED:
        raise AssertionError(f"{call.describe}\n  {verdict.value}\n  {detail}")


@given(st.data())
def test_block_table_constructor_refuses_bad_arguments(data: st.DataObject) -> None:
    which = data.draw(st.sampled_from([*_SIZES, "pin_memory", "device", "pcp_rank",
                                       "dcp_rank", "slot_mapping_backend", "divisibility"]))
    arguments = dict(_TABLE_ARGUMENTS)
    accepted = ""
    if which in _SIZES:
        bad = data.draw(st.one_of(_bad_size(1), _enormous()))
        if bad.value is None and which in ("num_blocks", "pcp_world_size", "dcp_world_size"):
            bad = _bad(0)  # None is valid: the pool's size is not known, the process's CP
        arguments[which] = bad.value
        if which in ("block_size", "kernel_block_size"):
            # Both, so that the value is not refused as a mere divisibility mismatch.
            arguments["block_size"] = arguments["kernel_block_size"] = bad.value
        accepted = _numpy_in_range(bad, 1, 4 if which == "cp_kv_cache_interleave_size" else 64)
        if which == "cp_kv_cache_interleave_size":
            if accepted and 4 % int(bad.value):
                accepted = ""  # np.int64(3) does not divide the kernel block size
            if data.draw(st.booleans()):
                arguments["dcp_world_size"] = 2
            elif (as_int(bad.value) or 0) > 0:
                accepted = ("an interleave without context parallelism: not used, and vLLM "
                            "checks it only under decode context parallelism")
    elif which == "pin_memory":
        bad = data.draw(not_a_bool())
        arguments[which] = bad.value
    elif which == "device":
        bad = data.draw(st.sampled_from(_BAD_DEVICES))
        arguments[which] = bad.value
    elif which in ("pcp_rank", "dcp_rank"):
        arguments[which.replace("rank", "world_size")] = 2
        # None too: the process's own rank, which belongs to the process's world size (1),
        # not to the world size of 2 given here.
        bad = data.draw(bad_int(0, 1).filter(lambda b: not isinstance(b.value, list)))
        accepted = _numpy_in_range(bad, 0, 1)
        arguments[which] = bad.value
    elif which == "slot_mapping_backend":
        bad = data.draw(st.sampled_from(_BAD_BACKENDS))
        arguments[which] = bad.value
    else:
        bad = _bad(6, "kernel_block_size=4 with block_size=6", "kernel_block_size=4")
        arguments["block_size"] = 6
    check(None, lambda _: None, _call(f"BlockTable({which}={bad.label})",
                                       lambda _: BlockTable(**arguments), bad,
                                       accepted=accepted, operation=which))


def _bad_size(low: int) -> st.SearchStrategy[Bad]:
    """Not a size of at least ``low`` (sizes large enough to allocate are left out: see
    ENORMOUS)."""
    return bad_int(low).filter(lambda b: not isinstance(b.value, list))


@given(st.data())
def test_multi_group_constructor_refuses_bad_arguments(data: st.DataObject) -> None:
    arguments: dict[str, Any] = {
        "max_num_reqs": 2, "max_model_len": 16, "max_num_batched_tokens": 8,
        "pin_memory": False, "device": DEVICE, "block_sizes": [4, 8],
        "kernel_block_sizes": [4, 4], "num_speculative_tokens": 0,
        "cp_kv_cache_interleave_size": 1,
    }
    which = data.draw(st.sampled_from(["max_model_len", "num_speculative_tokens",
                                       "block_sizes", "kernel_block_sizes", "max_num_blocks",
                                       "lengths"]))
    accepted = ""
    if which == "max_model_len":
        bad = data.draw(st.one_of(_bad_size(1), _enormous()))
        accepted = _numpy_in_range(bad, 1, 2**20)
    elif which == "num_speculative_tokens":
        bad = data.draw(st.one_of(_bad_size(0), _enormous()))
        accepted = _numpy_in_range(bad, 0, 2**20)
    elif which in ("block_sizes", "kernel_block_sizes", "max_num_blocks"):
        element = data.draw(st.one_of(_bad_size(1), _enormous()))
        if which == "kernel_block_sizes" and type(element.value) is int and element.value > 0:
            element = _bad(-1)
        whole = data.draw(st.sampled_from(
            ([] if which == "max_num_blocks" else [_bad(None)])  # None: derived from lengths
            + [_bad(4), _bad("44"), _bad(Opaque()),
               _bad(halfway([4, 4]), "<generator>", "generator")]))
        bad = data.draw(st.sampled_from([
            Bad([4, element.value], f"[4, {element.label}]", element.forms), whole]))
        accepted = _numpy_in_range(element, 1, 2**20) if bad is not whole else ""
    else:
        bad = _bad([4], "kernel_block_sizes=[4] for 2 groups", "1 kernel block sizes")
        arguments["kernel_block_sizes"] = bad.value
    if which != "lengths":
        arguments[which] = bad.value
    check(None, lambda _: None, _call(f"MultiGroupBlockTable({which}={bad.label})",
                                       lambda _: MultiGroupBlockTable(**arguments), bad,
                                       accepted=accepted, operation=which))


# ---------------------------------------------------------------------- CpuGpuBuffer


@dataclass
class BufferSubject:
    buffer: CpuGpuBuffer
    rows: int


@st.composite
def buffers(draw: st.DrawFn) -> BufferSubject:
    rows = draw(st.integers(0, 6))
    shape = (rows,) if draw(st.booleans()) else (rows, draw(st.integers(1, 3)))
    dtype = draw(st.sampled_from([torch.int32, torch.int64, torch.float32]))
    buffer = CpuGpuBuffer(*shape, dtype=dtype, device=DEVICE, pin_memory=draw(st.booleans()))
    buffer.cpu.copy_(torch.arange(buffer.cpu.numel()).reshape(shape))
    buffer.copy_to_gpu(draw(st.integers(0, rows)))
    buffer.cpu.add_(1)
    return BufferSubject(buffer, rows)


def buffer_snapshot(s: BufferSubject) -> object:
    return (s.buffer.cpu.tolist(), s.buffer.gpu.tolist(), s.buffer.np.tolist())


@given(st.data())
def test_cpu_gpu_buffer_refuses_bad_copies(data: st.DataObject) -> None:
    subject = data.draw(buffers())
    operation = data.draw(st.sampled_from(["copy_to_gpu", "copy_to_cpu"]))
    # (None is valid: every row.)
    bad = data.draw(bad_count(subject.rows).filter(lambda b: not isinstance(b.value, list)
                                                   and b.value is not None))
    check(subject, buffer_snapshot, _call(
        f"buffer.{operation}({bad.label})", lambda s: getattr(s.buffer, operation)(bad.value),
        bad, accepted=_numpy_in_range(bad, 0, subject.rows), operation=operation))


@given(st.data())
def test_cpu_gpu_buffer_constructor_refuses_bad_arguments(data: st.DataObject) -> None:
    which = data.draw(st.sampled_from(["size", "dtype", "device", "pin_memory", "with_numpy"]))
    size: list[Any] = [3, 2]
    arguments: dict[str, Any] = {"dtype": torch.int32, "device": DEVICE, "pin_memory": False}
    accepted = ""
    if which == "size":
        bad = data.draw(st.one_of(_bad_size(0), _enormous(),
                                  st.just(_bad((), "no size at all", "()"))))
        if bad.label == "no size at all":
            size = []
        else:
            size[data.draw(st.integers(0, 1))] = bad.value
            accepted = _numpy_in_range(bad, 0, 2**20)
    elif which == "dtype":
        bad = data.draw(st.sampled_from([_bad(None), _bad("int32"), _bad(np.int32, "np.int32",
                                                                         "numpy.int32"),
                                         _bad(Opaque())]))
        arguments["dtype"] = bad.value
    elif which == "device":
        bad = data.draw(st.sampled_from(_BAD_DEVICES))
        arguments["device"] = bad.value
    else:
        bad = data.draw(not_a_bool())
        arguments[which] = bad.value
    check(None, lambda _: None, _call(f"CpuGpuBuffer({which}={bad.label})",
                                       lambda _: CpuGpuBuffer(*size, **arguments), bad,
                                       accepted=accepted, operation=which))


# ---------------------------------------------------------------------- slot helpers


@given(st.data())
def test_slot_helpers_refuse_bad_arguments(data: st.DataObject) -> None:
    """The scalar slot arithmetic (block_table's module functions) and the device slot
    mapping (slot_mapping_triton) refuse what the spec's preconditions exclude."""
    helper = data.draw(st.sampled_from(["cp_local_offset", "cp_offset_table", "slot_of_token",
                                        "kernel_block_ids", "slot_mapping_torch"]))
    call = data.draw(_HELPER_CALLS[helper]())
    out = torch.full((4,), 99, dtype=torch.int64)
    check(out, lambda o: o.tolist(), BadCall(call.describe, call.run, call.bad, call.named,
                                             call.propagates, call.accepted, helper))


# Good arguments, by name, for each helper; a call replaces one of them.
_CP = {"block_size": 4, "cp_world_size": 2, "cp_rank": 1, "interleave": 2}


@st.composite
def _cp_local_offset(draw: st.DrawFn) -> BadCall:
    arguments = {"offset": 3, **_CP}
    name = draw(st.sampled_from(sorted(arguments)))
    bad = draw(_helper_bad(name, arguments))
    arguments[name] = bad.value
    return _call(f"cp_local_offset({name}={bad.label})",
                 lambda _: bt.cp_local_offset(**arguments), bad,
                 accepted=_helper_accepted(name, bad, arguments))


def _helper_bounds(name: str, arguments: dict[str, Any]) -> tuple[int, int | None]:
    block_size = arguments.get("block_size", 4)
    world = arguments.get("cp_world_size", 1)
    if name in ("block_size", "cp_world_size", "interleave", "row_stride",
                "blocks_per_kv_block"):
        return 1, None
    if name == "cp_rank":
        return 0, world - 1
    if name == "offset":
        return 0, block_size * world - 1
    return 0, None


def _helper_bad(name: str, arguments: dict[str, Any]) -> st.SearchStrategy[Bad]:
    low, high = _helper_bounds(name, arguments)
    strategies = [bad_int(low, high).filter(lambda b: not isinstance(b.value, list))]
    if name == "interleave":
        strategies.append(st.just(_bad(3, "3 (does not divide block_size=4)")))
    return st.one_of(strategies)


def _helper_accepted(name: str, bad: Bad, arguments: dict[str, Any]) -> str:
    low, high = _helper_bounds(name, arguments)
    if name == "interleave" and bad.value == 3:
        return ""
    return _numpy_in_range(bad, low, 2**20 if high is None else high)


@st.composite
def _cp_offset_table(draw: st.DrawFn) -> BadCall:
    arguments = dict(_CP)
    name = draw(st.sampled_from(sorted(arguments)))
    bad = draw(_helper_bad(name, arguments))
    arguments[name] = bad.value
    return _call(f"cp_offset_table({name}={bad.label})",
                 lambda _: bt.cp_offset_table(**arguments), bad,
                 accepted=_helper_accepted(name, bad, arguments))


@st.composite
def _slot_of_token(draw: st.DrawFn) -> BadCall:
    flat = [3, 5, 0, 0, 7, 0, 0, 0]  # two rows of 4 kernel blocks, 8 positions each under CP
    arguments: dict[str, Any] = {"row_stride": 4, "row": 1, "position": 2, **_CP}
    name = draw(st.sampled_from([*sorted(arguments), "table"]))
    if name == "table":
        bad = draw(st.sampled_from([
            _bad(None), _bad(Opaque()),
            _bad([3, -1, 0, 0, -5, 0, 0, 0], "a table holding block -5", "-5"),
            _bad([3, 5, 0, 0, 7.0, 0, 0, 0], "a table holding 7.0", "7.0"),
        ]))
        table: Any = bad.value
        return _call(f"slot_of_token(<table: {bad.label}>, ...)",
                     lambda _: bt.slot_of_token(table, **arguments), bad)
    # Past the table: a third row, a position past the row's 4 blocks, rows of 3 (8 entries
    # do not make rows of 3).
    past = {"row": _bad(2, "row 2 of a table of 2 rows", "2"),
            "position": _bad(32, "position 32 of a row of 4 blocks of 8", "32"),
            "row_stride": _bad(3, "row_stride=3 for a table of 8 entries", "3")}
    options = [_helper_bad(name, arguments)]
    if name in past:
        options.append(st.just(past[name]))
    bad = draw(st.one_of(options))
    arguments[name] = bad.value
    return _call(f"slot_of_token({name}={bad.label})",
                 lambda _: bt.slot_of_token(flat, **arguments), bad,
                 accepted=_helper_accepted(name, bad, arguments))


@st.composite
def _kernel_block_ids(draw: st.DrawFn) -> BadCall:
    if draw(st.booleans()):
        bad = draw(bad_positive().filter(lambda b: not isinstance(b.value, list)))
        return _call(f"kernel_block_ids([1, 2], {bad.label})",
                     lambda _: bt.kernel_block_ids([1, 2], bad.value), bad,
                     accepted=_numpy_in_range(bad, 1, 2**20))
    bad = draw(st.sampled_from([*_NOT_BLOCK_IDS, _bad(-1), _bad(-(2**40))]))
    return _call(f"kernel_block_ids([1, {bad.label}], 2)",
                 lambda _: bt.kernel_block_ids([1, bad.value], 2), bad)


@st.composite
def _slot_mapping_torch(draw: st.DrawFn) -> BadCall:
    table = torch.tensor([[3, 5], [7, 0]], dtype=torch.int32)
    arguments: dict[str, Any] = {
        "block_table": table, "req_indices": torch.tensor([0, 1]),
        "positions": torch.tensor([1, 2]), "num_tokens": 2, "block_size": 4,
        "cp_world_size": 1, "cp_rank": 0, "interleave": 1,
    }
    name = draw(st.sampled_from([*sorted(arguments), "values"]))
    if name == "values":
        bad = draw(st.sampled_from([_bad(torch.tensor([1, -5]), "positions [1, -5]", "-5"),
                                    _bad(torch.tensor([0, 9]), "req_indices [0, 9]", "9")]))
        arguments["positions" if "positions" in bad.label else "req_indices"] = bad.value
        return _call(f"slot_mapping_torch(<{bad.label}>)",
                     lambda out: slot_mapping_triton.slot_mapping_torch(out=out, **arguments),
                     bad, accepted=("indices on the device are not read on the host: tokens "
                                    "outside the table get the pad slot"))
    if name in ("block_table", "req_indices", "positions"):
        bad = draw(st.sampled_from([
            _bad(None), _bad(np.array([0, 1]), "a numpy array", "ndarray"),
            _bad(torch.tensor([0.0, 1.0]), "a float tensor", "torch.float32"),
            _bad(torch.tensor([[0, 1]]), "a 2-D tensor", "(1, 2)"),
        ]))
        if name == "block_table":
            bad = draw(st.sampled_from([
                _bad(None), _bad(table.float(), "a float table", "torch.float32"),
                _bad(table[0], "a 1-D table", "(2,)"),
            ]))
    else:
        low, high = {"num_tokens": (0, 2), "block_size": (1, None), "cp_world_size": (1, None),
                     "cp_rank": (0, 0), "interleave": (1, None)}[name]
        bad = draw(bad_int(low, high).filter(lambda b: not isinstance(b.value, list)
                                             and b.value not in (2**31, 2**32)))
    arguments[name] = bad.value
    accepted = ""
    if name not in ("block_table", "req_indices", "positions"):
        low, high = {"num_tokens": (0, 2), "block_size": (1, 64), "cp_world_size": (1, 8),
                     "cp_rank": (0, 0), "interleave": (1, 4)}[name]
        accepted = _numpy_in_range(bad, low, high)
    return _call(f"slot_mapping_torch({name}={bad.label})",
                 lambda out: slot_mapping_triton.slot_mapping_torch(out=out, **arguments), bad,
                 accepted=accepted)


_HELPER_CALLS: dict[str, Callable[[], st.SearchStrategy[BadCall]]] = {
    "cp_local_offset": _cp_local_offset,
    "cp_offset_table": _cp_offset_table,
    "slot_of_token": _slot_of_token,
    "kernel_block_ids": _kernel_block_ids,
    "slot_mapping_torch": _slot_mapping_torch,
}
