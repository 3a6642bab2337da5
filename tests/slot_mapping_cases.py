"""Random slot-mapping cases and what the slot-mapping tests share (tests/test_slot_mapping.py,
tests/test_slot_mapping_triton.py): configurations (standard, context parallel with any world
size / rank / interleave, kernel-block expansion), tables and batches, each with the spec's
expected slots (spec/slot_mapping.py), and a runner of impl's device functions.

Importing it first sets ``TRITON_INTERPRET=1`` where there is no GPU, so that the Triton
kernel runs in the interpreter on CPU tensors.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

if not torch.cuda.is_available():
    # Before anything imports triton: without a GPU the kernel runs in the interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np
import pytest
from hypothesis import event, strategies as st

from kvspec.impl import slot_mapping_triton
from kvspec.impl.block_table import BlockTable
from kvspec.spec import slot_mapping as spec

HAS_CUDA = torch.cuda.is_available()
needs_triton = pytest.mark.skipif(
    not slot_mapping_triton.triton_available(), reason="triton is not installed"
)
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


@dataclass(frozen=True)
class Config:
    block_size: int  # the manager's block size
    kernel_block_size: int
    pcp_world_size: int
    pcp_rank: int
    dcp_world_size: int
    dcp_rank: int
    interleave: int
    max_num_reqs: int
    max_num_blocks_per_req: int  # manager blocks
    max_num_batched_tokens: int

    @property
    def world_size(self) -> int:
        return self.pcp_world_size * self.dcp_world_size

    @property
    def rank(self) -> int:
        return self.pcp_rank * self.dcp_world_size + self.dcp_rank

    @property
    def blocks_per_kv_block(self) -> int:
        return self.block_size // self.kernel_block_size

    def table(self, **overrides: object) -> BlockTable:
        return BlockTable(
            self.block_size, self.max_num_reqs, self.max_num_blocks_per_req,
            self.max_num_batched_tokens, False, "cpu", self.kernel_block_size,
            self.interleave, pcp_world_size=self.pcp_world_size, pcp_rank=self.pcp_rank,
            dcp_world_size=self.dcp_world_size, dcp_rank=self.dcp_rank,
            **overrides,  # type: ignore[arg-type]
        )


def divisors(number: int) -> list[int]:
    return [d for d in range(1, number + 1) if number % d == 0]


@st.composite
def configs(draw: st.DrawFn) -> Config:
    kernel_block_size = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    blocks_per_kv_block = draw(st.sampled_from([1, 1, 2, 3]))
    pcp_world_size, dcp_world_size = draw(
        st.sampled_from([(1, 1), (1, 1), (1, 2), (2, 1), (1, 3), (2, 2), (1, 4)])
    )
    interleave = 1
    if pcp_world_size * dcp_world_size > 1:
        interleave = draw(st.sampled_from(divisors(kernel_block_size)))
    return Config(
        block_size=kernel_block_size * blocks_per_kv_block,
        kernel_block_size=kernel_block_size,
        pcp_world_size=pcp_world_size,
        pcp_rank=draw(st.integers(0, pcp_world_size - 1)),
        dcp_world_size=dcp_world_size,
        dcp_rank=draw(st.integers(0, dcp_world_size - 1)),
        interleave=interleave,
        max_num_reqs=draw(st.integers(1, 4)),
        max_num_blocks_per_req=draw(st.integers(1, 4)),
        max_num_batched_tokens=draw(st.integers(1, 40)),
    )


@dataclass(frozen=True)
class Case:
    config: Config
    rows: tuple[tuple[int, ...], ...]  # manager block ids per row
    req_indices: tuple[int, ...]
    positions: tuple[int, ...]

    @property
    def kernel_rows(self) -> tuple[tuple[int, ...], ...]:
        return tuple(spec.kernel_row(row, self.config.blocks_per_kv_block) for row in self.rows)

    def expected(self, num_slots: int | None = None) -> tuple[int, ...]:
        config = self.config
        return spec.batch_slot_mapping(
            self.kernel_rows, self.req_indices, self.positions, config.kernel_block_size,
            config.max_num_batched_tokens if num_slots is None else num_slots,
            config.world_size, config.rank, config.interleave,
        )

    def filled_table(self, **overrides: object) -> BlockTable:
        table = self.config.table(**overrides)
        for row, blocks in enumerate(self.rows):
            table.add_row(list(blocks), row)
        return table


@st.composite
def cases(draw: st.DrawFn, config: Config | None = None) -> Case:
    config = config or draw(configs())
    rows = tuple(
        tuple(draw(st.lists(st.integers(0, 60), max_size=config.max_num_blocks_per_req)))
        for _ in range(config.max_num_reqs)
    )
    tokens_per_row = config.block_size * config.world_size
    filled = [row for row, blocks in enumerate(rows) if blocks]
    num_tokens = draw(st.integers(0, config.max_num_batched_tokens)) if filled else 0
    req_indices, positions = [], []
    for _ in range(num_tokens):
        row = draw(st.sampled_from(filled))
        req_indices.append(row)
        positions.append(draw(st.integers(0, len(rows[row]) * tokens_per_row - 1)))
    event(f"world size {config.world_size}, interleave {config.interleave}")
    event(f"blocks_per_kv_block {config.blocks_per_kv_block}")
    event("batch fills the buffer" if num_tokens == config.max_num_batched_tokens else "padded")
    return Case(config, rows, tuple(req_indices), tuple(positions))


def as_arrays(case: Case, dtype: type[np.integer] = np.int64) -> tuple[np.ndarray, np.ndarray]:
    return np.array(case.req_indices, dtype=dtype), np.array(case.positions, dtype=dtype)


def as_tensors(case: Case, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.tensor(case.req_indices, dtype=torch.int64, device=device),
        torch.tensor(case.positions, dtype=torch.int64, device=device),
    )


def run_device_function(
    function: object, case: Case, device: str = "cpu", garbage: int = 12345
) -> list[int]:
    config = case.config
    table = case.filled_table()
    req_indices, positions = as_tensors(case, device)
    out = torch.full((config.max_num_batched_tokens,), garbage, dtype=torch.int64, device=device)
    function(  # type: ignore[operator]
        table.block_table.cpu.to(device), req_indices, positions, out, len(case.positions),
        config.kernel_block_size, config.world_size, config.rank, config.interleave,
    )
    return list(out.cpu().tolist())
