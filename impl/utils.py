"""Worker-side helpers shared by the block tables: vLLM 0.13's ``CpuGpuBuffer``.

A ``CpuGpuBuffer`` is one logical buffer seen three ways: ``cpu`` (a torch tensor, pinned
when asked and a CUDA device is present, so host-to-device copies can be asynchronous),
``np`` (a numpy view of the same memory, where the CPU side does its edits) and ``gpu`` (a
tensor of the same shape on the target device; a separate CPU tensor when the device is the
CPU). ``copy_to_gpu(n)`` publishes the first ``n`` rows.

Every argument is checked before anything is allocated or copied: a bad one gets a
``CpuGpuBufferError`` naming it, and a refused copy copies nothing.
"""

from __future__ import annotations

from typing import SupportsIndex

import numpy as np
import torch

from kvspec.impl.checks import as_int
from kvspec.impl.errors import CpuGpuBufferError as CpuGpuBufferError

# Sizes are int64 in torch: anything larger cannot be a tensor's dimension.
_SIZE_LIMIT = 2**63
# The tensor dtypes that hold integers (a batch's request indices and positions, a table).
TORCH_INTEGER_DTYPES = frozenset(
    dtype for dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
                        getattr(torch, "uint16", None), getattr(torch, "uint32", None),
                        getattr(torch, "uint64", None))
    if dtype is not None
)


def cuda_available() -> bool:
    """Whether a CUDA device can be used in this process."""
    return bool(torch.cuda.is_available())


def as_device(device: object, error: type[ValueError] = CpuGpuBufferError) -> torch.device:
    """``device`` as a ``torch.device``, or ``error`` naming it."""
    if isinstance(device, torch.device):
        return device
    if not isinstance(device, str | int) or isinstance(device, bool):
        raise error(f"device={device!r} is not a torch.device, a name or an index")
    try:
        return torch.device(device)
    except (RuntimeError, ValueError) as cause:
        raise error(f"device={device!r} is not a device: {cause}") from cause


class CpuGpuBuffer:
    """A host staging buffer and its device mirror (``vllm.v1.utils.CpuGpuBuffer``)."""

    def __init__(
        self,
        *size: SupportsIndex,
        dtype: torch.dtype,
        device: torch.device | str,
        pin_memory: bool,
        with_numpy: bool = True,
    ) -> None:
        shape = _shape(size)
        if not isinstance(dtype, torch.dtype):
            raise CpuGpuBufferError(f"dtype={dtype!r} is not a torch.dtype")
        target = as_device(device)
        for name, flag in (("pin_memory", pin_memory), ("with_numpy", with_numpy)):
            if not isinstance(flag, bool):
                raise CpuGpuBufferError(f"{name}={flag!r} is not a bool")
        if with_numpy and dtype == torch.bfloat16:
            raise CpuGpuBufferError("bfloat16 has no numpy dtype: pass with_numpy=False")
        # Pinning needs a CUDA driver; without one a pinned request quietly gets pageable memory.
        pin = pin_memory and cuda_available()
        try:
            self.cpu = torch.zeros(*shape, dtype=dtype, device="cpu", pin_memory=pin)
            self.gpu = torch.zeros_like(self.cpu, device=target)
        except (RuntimeError, MemoryError, AssertionError) as error:
            # Too large, or a device this process cannot use (torch raises AssertionError for
            # a backend it was not built with).
            raise CpuGpuBufferError(
                f"cannot allocate a buffer of size {shape} of {dtype} on {target}: {error}"
            ) from error
        try:
            self.np: np.ndarray = self.cpu.numpy() if with_numpy else np.empty(0)
        except TypeError as error:
            raise CpuGpuBufferError(f"{dtype} has no numpy dtype: pass with_numpy=False") from error

    def _rows(self, n: object) -> int:
        rows = int(self.cpu.shape[0])
        if n is None:
            return rows
        count = as_int(n)
        if count is None:
            raise CpuGpuBufferError(f"cannot copy {n!r} rows: not an integer")
        if not 0 <= count <= rows:
            raise CpuGpuBufferError(f"cannot copy {count} rows of a buffer of {rows}")
        return count

    def copy_to_gpu(self, n: SupportsIndex | None = None) -> torch.Tensor:
        """Copy the first ``n`` rows (all when ``None``) to the device; returns that view."""
        rows = self._rows(n)
        return self.gpu[:rows].copy_(self.cpu[:rows], non_blocking=True)

    def copy_to_cpu(self, n: SupportsIndex | None = None) -> torch.Tensor:
        """Copy the first ``n`` rows back to the host (the caller synchronises)."""
        rows = self._rows(n)
        return self.cpu[:rows].copy_(self.gpu[:rows], non_blocking=True)


def _shape(size: tuple[object, ...]) -> tuple[int, ...]:
    """The buffer's shape: at least one dimension (copies count rows), each a size torch
    can hold."""
    if not size:
        raise CpuGpuBufferError("a buffer needs a size: got size ()")
    shape = []
    for value in size:
        dimension = as_int(value)
        if dimension is None or not 0 <= dimension < _SIZE_LIMIT:
            raise CpuGpuBufferError(f"size {value!r} is not a size in [0, 2**63)")
        shape.append(dimension)
    return tuple(shape)
