"""Worker-side helpers (impl/utils.py): ``CpuGpuBuffer``'s copies between its host and device
sides and its refusals, and ``as_device``. Hostile input to the buffer:
tests/hostile/test_block_table.py.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from kvspec.impl.utils import (
    TORCH_INTEGER_DTYPES,
    CpuGpuBuffer,
    CpuGpuBufferError,
    as_device,
)


def test_cpu_gpu_buffer() -> None:
    buffer = CpuGpuBuffer(3, 2, dtype=torch.int32, device="cpu", pin_memory=True)
    buffer.np[:] = [[1, 2], [3, 4], [5, 6]]
    buffer.copy_to_gpu(2)
    assert buffer.gpu.tolist() == [[1, 2], [3, 4], [0, 0]]
    buffer.gpu[2] = 9
    buffer.copy_to_cpu()
    assert buffer.np[2].tolist() == [9, 9]
    with pytest.raises(CpuGpuBufferError, match="4 rows"):
        buffer.copy_to_gpu(4)
    with pytest.raises(CpuGpuBufferError, match="bfloat16"):
        CpuGpuBuffer(2, dtype=torch.bfloat16, device="cpu", pin_memory=False)


def test_copies_take_numpy_integers_and_none_means_every_row() -> None:
    buffer = CpuGpuBuffer(4, dtype=torch.int64, device="cpu", pin_memory=False)
    buffer.np[:] = [1, 2, 3, 4]
    assert buffer.copy_to_gpu(np.int32(3)).tolist() == [1, 2, 3]
    assert buffer.gpu.tolist() == [1, 2, 3, 0]
    assert buffer.copy_to_gpu().tolist() == [1, 2, 3, 4]
    with pytest.raises(CpuGpuBufferError, match="True"):
        buffer.copy_to_gpu(True)


def test_as_device_names_what_is_not_a_device() -> None:
    cpu = torch.device("cpu")
    assert as_device(cpu) is cpu
    assert as_device("cpu") == cpu
    for bad in (True, 1.5, "no-such-device"):
        with pytest.raises(CpuGpuBufferError, match=re.escape(repr(bad))):
            as_device(bad)


def test_integer_dtypes_are_the_integer_ones() -> None:
    assert {torch.int32, torch.int64, torch.uint8} <= TORCH_INTEGER_DTYPES
    assert all(not dtype.is_floating_point for dtype in TORCH_INTEGER_DTYPES)
    assert torch.float32 not in TORCH_INTEGER_DTYPES and torch.bool not in TORCH_INTEGER_DTYPES
