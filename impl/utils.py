"""Worker-side helpers shared by the block tables: vLLM 0.13's ``CpuGpuBuffer``.

A ``CpuGpuBuffer`` is one logical buffer seen three ways: ``cpu`` (a torch tensor, pinned
when asked and a CUDA device is present, so host-to-device copies can be asynchronous),
``np`` (a numpy view of the same memory, where the CPU side does its edits) and ``gpu`` (a
tensor of the same shape on the target device; a separate CPU tensor when the device is the
CPU). ``copy_to_gpu(n)`` publishes the first ``n`` rows.
"""

from __future__ import annotations

import numpy as np
import torch


class CpuGpuBufferError(ValueError):
    """A buffer that cannot be built, or a copy of more rows than it has."""


def cuda_available() -> bool:
    """Whether a CUDA device can be used in this process."""
    return bool(torch.cuda.is_available())


class CpuGpuBuffer:
    """A host staging buffer and its device mirror (``vllm.v1.utils.CpuGpuBuffer``)."""

    def __init__(
        self,
        *size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        pin_memory: bool,
        with_numpy: bool = True,
    ) -> None:
        if with_numpy and dtype == torch.bfloat16:
            raise CpuGpuBufferError("bfloat16 has no numpy dtype: pass with_numpy=False")
        # Pinning needs a CUDA driver; without one a pinned request quietly gets pageable memory.
        pin = bool(pin_memory) and cuda_available()
        self.cpu = torch.zeros(*size, dtype=dtype, device="cpu", pin_memory=pin)
        self.gpu = torch.zeros_like(self.cpu, device=device)
        self.np: np.ndarray = self.cpu.numpy() if with_numpy else np.empty(0)

    def _rows(self, n: int | None) -> int:
        rows = int(self.cpu.shape[0])
        if n is None:
            return rows
        if not 0 <= n <= rows:
            raise CpuGpuBufferError(f"cannot copy {n} rows of a buffer of {rows}")
        return n

    def copy_to_gpu(self, n: int | None = None) -> torch.Tensor:
        """Copy the first ``n`` rows (all when ``None``) to the device; returns that view."""
        rows = self._rows(n)
        return self.gpu[:rows].copy_(self.cpu[:rows], non_blocking=True)

    def copy_to_cpu(self, n: int | None = None) -> torch.Tensor:
        """Copy the first ``n`` rows back to the host (the caller synchronises)."""
        rows = self._rows(n)
        return self.cpu[:rows].copy_(self.gpu[:rows], non_blocking=True)
