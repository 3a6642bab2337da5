"""Slot mapping: spec/slot_mapping.py against impl's block table (impl/block_table.py).

Differential property tests on random tables and batches (tests/slot_mapping_cases.py:
standard, context parallel with any world size / rank / interleave, kernel-block expansion,
padding): the spec's per-token statement against impl's numpy path
(``BlockTable.compute_slot_mapping``), its scalar arithmetic and its device backends (the
torch-ops fallback and the Triton kernel, interpreted on the CPU when there is no GPU), plus
``crosshair diffbehavior`` between the spec's slot function and impl's scalar one. The CUDA
variants run only where a GPU is. The device functions on their own:
tests/test_slot_mapping_triton.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import event, given, settings, strategies as st

from kvspec.impl import block_table as impl_table, slot_mapping_triton
from kvspec.impl.block_table import BlockTable
from kvspec.spec import slot_mapping as spec
from tests.slot_mapping_cases import (
    Case,
    as_arrays,
    as_tensors,
    cases,
    configs,
    divisors,
    needs_cuda,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
# CrossHair's limits are CPU seconds, which a loaded machine stretches in wall time (a run
# took over 2 min with the cores shared among a dozen processes): the subprocess's timeout
# only stops a hang.
HANG_CAP = 1200


# --- worked examples of vLLM 0.13's formula (vllm/v1/worker/block_table.py) ---------------


def test_worked_examples_from_the_notes() -> None:
    assert [spec.token_slot((1, 2, 3, 4), p, 16) for p in (0, 15, 16, 50)] == [16, 31, 32, 66]
    assert spec.kernel_row((0, 1, 2), 2) == (0, 1, 2, 3, 4, 5)
    assert spec.expanded_token_slot((0, 1, 2), 40, 32, 16) == 40
    assert [spec.token_slot((7,), p, 4, 2, 0, 1) for p in range(8)] == [
        28, -1, 29, -1, 30, -1, 31, -1
    ]
    assert [spec.token_slot((7,), p, 4, 2, 1, 1) for p in range(8)] == [
        -1, 28, -1, 29, -1, 30, -1, 31
    ]
    assert [spec.token_slot((7,), p, 4, 2, 0, 2) for p in range(8)] == [
        28, 29, -1, -1, 30, 31, -1, -1
    ]
    table = ((5, 8), (2, 3, 10), (12,))
    assert spec.batch_slot_mapping(table, (0, 0, 1, 1, 1, 2), (3, 7, 2, 5, 9, 1), 4, 8) == (
        23, 35, 10, 13, 41, 49, -1, -1
    )


def test_impl_reproduces_the_seed_example() -> None:
    table = BlockTable(4, 3, 3, 8, False, "cpu", 4)
    for row, blocks in enumerate(([5, 8], [2, 3, 10], [12])):
        table.add_row(blocks, row)
    table.compute_slot_mapping(np.array([0, 0, 1, 1, 1, 2]), np.array([3, 7, 2, 5, 9, 1]))
    assert table.slot_mapping.np.tolist() == [23, 35, 10, 13, 41, 49, -1, -1]


# --- spec vs impl (numpy) -------------------------------------------------------------------


@given(cases())
def test_numpy_path_matches_spec(case: Case) -> None:
    table = case.filled_table()
    table.compute_slot_mapping(*as_arrays(case))
    assert tuple(table.slot_mapping.np.tolist()) == case.expected()


@given(cases(), st.sampled_from([np.int32, np.int64, np.uint32]))
def test_numpy_path_takes_other_integer_types(case: Case, dtype: type[np.integer]) -> None:
    table = case.filled_table()
    table.compute_slot_mapping(*as_arrays(case, dtype))
    assert tuple(table.slot_mapping.np.tolist()) == case.expected()
    table.compute_slot_mapping(list(case.req_indices), list(case.positions))
    assert tuple(table.slot_mapping.np.tolist()) == case.expected()


@given(configs().flatmap(lambda config: st.tuples(cases(config), cases(config))))
def test_every_slot_past_the_batch_is_padding(pair: tuple[Case, Case]) -> None:
    """A longer batch then a shorter one: nothing of the first survives past the second."""
    first, second = pair
    table = first.filled_table()
    table.compute_slot_mapping(*as_arrays(first))
    for row, blocks in enumerate(second.rows):
        table.add_row(list(blocks), row)
    table.compute_slot_mapping(*as_arrays(second))
    assert tuple(table.slot_mapping.np.tolist()) == second.expected()
    table.commit_slot_mapping(len(second.positions))
    assert tuple(table.slot_mapping.gpu.tolist()) == second.expected()
    event("second batch shorter" if len(second.positions) < len(first.positions) else "longer")


@given(cases())
def test_scalar_arithmetic_matches_spec(case: Case) -> None:
    config = case.config
    kernel_rows = case.kernel_rows
    width = config.max_num_blocks_per_req * config.blocks_per_kv_block
    flat = [block for row in kernel_rows for block in row + (0,) * (width - len(row))]
    for row, position in zip(case.req_indices, case.positions, strict=True):
        assert impl_table.slot_of_token(
            flat, width, row, position, config.kernel_block_size, config.world_size,
            config.rank, config.interleave,
        ) == spec.token_slot(
            kernel_rows[row], position, config.kernel_block_size, config.world_size,
            config.rank, config.interleave,
        )
    for blocks in case.rows:
        assert tuple(impl_table.kernel_block_ids(blocks, config.blocks_per_kv_block)) == (
            spec.kernel_row(blocks, config.blocks_per_kv_block)
        )
        assert tuple(
            BlockTable.map_to_kernel_blocks(
                np.array(blocks, dtype=np.int64), config.blocks_per_kv_block,
                np.arange(config.blocks_per_kv_block).reshape(1, -1),
            ).tolist()
        ) == spec.kernel_row(blocks, config.blocks_per_kv_block)


@given(
    st.sampled_from([1, 2, 4, 8]).flatmap(
        lambda b: st.tuples(
            st.just(b), st.sampled_from([1, 2, 3, 4]),
            st.sampled_from(divisors(b)),
        )
    ).flatmap(lambda t: st.tuples(st.just(t), st.integers(0, t[1] - 1)))
)
def test_context_parallel_ranks_partition_each_virtual_block(
    params: tuple[tuple[int, int, int], int],
) -> None:
    (block_size, world_size, interleave), rank = params
    assert spec.rank_block_layout(block_size, world_size, rank, interleave) == tuple(
        range(block_size)
    )
    owners = [
        spec.owner_rank(p, block_size, world_size, interleave)
        for p in range(block_size * world_size)
    ]
    assert all(owners.count(r) == block_size for r in range(world_size))


# --- spec vs the block table's device backends (CPU) ----------------------------------------


@pytest.mark.parametrize("backend", ["torch", "triton"])
@settings(max_examples=20)
@given(case=cases())
def test_block_table_device_backends_match_spec(backend: str, case: Case) -> None:
    """The whole BlockTable path: commit the table, compute on the "device" mirror (a CPU
    tensor here), and read the device slot mapping."""
    if backend == "triton" and not slot_mapping_triton.triton_available():
        pytest.skip("triton is not installed")
    table = case.filled_table(slot_mapping_backend=backend)
    table.compute_slot_mapping(*as_arrays(case))
    table.commit_slot_mapping(len(case.positions))
    assert tuple(table.slot_mapping.gpu.tolist()) == case.expected()
    table.compute_slot_mapping(*as_tensors(case))
    assert tuple(table.slot_mapping.gpu.tolist()) == case.expected()


# --- CUDA (skipped without a GPU) -----------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
@settings(max_examples=50)
@given(cases())
def test_cuda_block_table_matches_spec(case: Case) -> None:
    table = BlockTable(
        case.config.block_size, case.config.max_num_reqs, case.config.max_num_blocks_per_req,
        case.config.max_num_batched_tokens, True, "cuda", case.config.kernel_block_size,
        case.config.interleave, pcp_world_size=case.config.pcp_world_size,
        pcp_rank=case.config.pcp_rank, dcp_world_size=case.config.dcp_world_size,
        dcp_rank=case.config.dcp_rank,
    )
    for row, blocks in enumerate(case.rows):
        table.add_row(list(blocks), row)
    table.commit_block_table(case.config.max_num_reqs)
    table.compute_slot_mapping(*as_arrays(case))
    torch.cuda.synchronize()
    assert tuple(table.slot_mapping.gpu.cpu().tolist()) == case.expected()


# --- crosshair diffbehavior: spec's slot function vs impl's scalar arithmetic ---------------


# Both sides of each pair map arbitrary ints onto the same valid arguments (block sizes 1-8,
# world sizes 1-4, interleaves dividing the block size, positions inside the row) instead of
# rejecting the rest, so CrossHair spends its paths where the arithmetic is.
SIZES = (1, 2, 4, 8)


def _block_size(size_code: int) -> int:
    return SIZES[size_code % 4]


def _interleave(size_code: int, interleave_code: int) -> int:
    return SIZES[interleave_code % (size_code % 4 + 1)]


def spec_slot_2x2(
    b00: int, b01: int, b10: int, b11: int, row: int, position: int, size_code: int,
    world_code: int, rank: int, interleave_code: int,
) -> int:
    """The spec's slot in the table ``((b00, b01), (b10, b11))``."""
    block_size, world_size = _block_size(size_code), 1 + world_code % 4
    table = ((abs(b00), abs(b01)), (abs(b10), abs(b11)))
    return spec.token_slot(
        table[row % 2], position % (2 * block_size * world_size), block_size, world_size,
        rank % world_size, _interleave(size_code, interleave_code),
    )


def impl_slot_2x2(
    b00: int, b01: int, b10: int, b11: int, row: int, position: int, size_code: int,
    world_code: int, rank: int, interleave_code: int,
) -> int:
    """impl's scalar slot arithmetic on the same table, flattened row-major."""
    block_size, world_size = _block_size(size_code), 1 + world_code % 4
    return impl_table.slot_of_token(
        [abs(b00), abs(b01), abs(b10), abs(b11)], 2, row % 2,
        position % (2 * block_size * world_size), block_size, world_size, rank % world_size,
        _interleave(size_code, interleave_code),
    )


def spec_expanded_slot(
    b0: int, b1: int, row: int, position: int, size_code: int, factor_code: int,
    world_code: int, rank: int, interleave_code: int,
) -> int:
    """The spec's slot with kernel blocks: two rows of one manager block, each of
    ``factor`` kernel blocks."""
    kernel_block_size, world_size = _block_size(size_code), 1 + world_code % 4
    factor = 1 + factor_code % 3
    return spec.expanded_token_slot(
        ((abs(b0),), (abs(b1),))[row % 2], position % (kernel_block_size * factor * world_size),
        kernel_block_size * factor, kernel_block_size, world_size, rank % world_size,
        _interleave(size_code, interleave_code),
    )


def impl_expanded_slot(
    b0: int, b1: int, row: int, position: int, size_code: int, factor_code: int,
    world_code: int, rank: int, interleave_code: int,
) -> int:
    """impl's kernel-block expansion, then its scalar slot arithmetic."""
    kernel_block_size, world_size = _block_size(size_code), 1 + world_code % 4
    factor = 1 + factor_code % 3
    return impl_table.slot_of_token(
        impl_table.kernel_block_ids([abs(b0), abs(b1)], factor), factor, row % 2,
        position % (kernel_block_size * factor * world_size), kernel_block_size, world_size,
        rank % world_size, _interleave(size_code, interleave_code),
    )


@pytest.mark.skipif(shutil.which("crosshair") is None and not (
    Path(sys.executable).parent / "crosshair").exists(), reason="crosshair is not installed")
@pytest.mark.parametrize(
    "pair",
    [("spec_slot_2x2", "impl_slot_2x2"), ("spec_expanded_slot", "impl_expanded_slot")],
)
def test_crosshair_finds_no_difference(pair: tuple[str, str]) -> None:
    """Standard and context-parallel slots (a 2x2 table, world sizes up to 4) and kernel
    block expansion: CrossHair searches for inputs on which spec and impl differ (and, for
    these small domains, usually exhausts every path)."""
    module = "tests.test_slot_mapping"
    result = subprocess.run(
        [sys.executable, "-m", "crosshair", "diffbehavior", f"{module}.{pair[0]}",
         f"{module}.{pair[1]}", "--max_uninteresting_iterations", "12",
         "--per_path_timeout", "2", "--per_condition_timeout", "20"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=HANG_CAP, check=False,
        env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
    )
    assert result.returncode == 0, result.stdout + result.stderr
