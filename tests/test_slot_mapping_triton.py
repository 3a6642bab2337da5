"""Slot mapping on the device (impl/slot_mapping_triton.py): the torch-ops fallback and the
Triton kernel against the spec's slots (spec/slot_mapping.py) on random tables and batches
(tests/slot_mapping_cases.py), a buffer of many Triton programs, and no read outside the
table. Without a GPU the kernel runs under ``TRITON_INTERPRET=1`` on CPU tensors; without
Triton its tests skip, and the CUDA variant runs only where a GPU is. The same functions
behind ``BlockTable``: tests/test_slot_mapping.py.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings

from kvspec.impl import slot_mapping_triton
from tests.slot_mapping_cases import (
    Case,
    Config,
    cases,
    needs_cuda,
    needs_triton,
    run_device_function,
)


@given(cases())
def test_torch_fallback_matches_spec(case: Case) -> None:
    assert tuple(run_device_function(slot_mapping_triton.slot_mapping_torch, case)) == (
        case.expected()
    )


@needs_triton
@settings(max_examples=25)
@given(cases())
def test_triton_kernel_matches_spec(case: Case) -> None:
    assert tuple(run_device_function(slot_mapping_triton.slot_mapping_triton, case)) == (
        case.expected()
    )


@needs_triton
def test_triton_kernel_covers_a_buffer_of_many_tiles() -> None:
    """2,500 slots are three programs of 1,024: the batch ends inside the first, the other
    two hold only padding."""
    config = Config(16, 16, 1, 0, 1, 0, 1, 2, 8, 2500)
    case = Case(config, ((3, 4, 5), (9,)), (0, 1, 0, 0), (0, 15, 20, 47))
    slots = run_device_function(slot_mapping_triton.slot_mapping_triton, case)
    assert slots[:4] == [48, 159, 68, 95]
    assert slots[4:] == [-1] * (2500 - 4)


@pytest.mark.parametrize(
    "function", [slot_mapping_triton.slot_mapping_torch, slot_mapping_triton.slot_mapping_triton]
)
def test_device_paths_never_read_outside_the_table(function: object) -> None:
    if function is slot_mapping_triton.slot_mapping_triton and not (
        slot_mapping_triton.triton_available()
    ):
        pytest.skip("triton is not installed")
    config = Config(4, 4, 1, 0, 1, 0, 1, 2, 2, 6)
    # Row 2 and -1 do not exist; -3 is a negative position; 8 is past row 0's width.
    case = Case(config, ((1, 2), (3,)), (0, 2, -1, 0, 1), (1, 0, 0, -3, 8))
    assert run_device_function(function, case) == [5, -1, -1, -1, -1, -1]


# --- CUDA (skipped without a GPU) -----------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
@needs_triton
@settings(max_examples=50)
@given(cases())
def test_cuda_triton_and_torch_match_spec(case: Case) -> None:
    for function in (
        slot_mapping_triton.slot_mapping_triton, slot_mapping_triton.slot_mapping_torch
    ):
        assert tuple(run_device_function(function, case, "cuda")) == case.expected()
