"""Slot mapping on the device: one fused Triton kernel, and the same formula in torch ops.

Both read the block table where it lives (the device mirror ``BlockTable.block_table.gpu``)
and write a whole slot-mapping buffer: token ``t < num_tokens`` gets the slot of position
``positions[t]`` of row ``req_indices[t]``, every later entry up to the end of the buffer
gets the padding slot. The Triton version does it in one launch over the buffer; tiles that
lie past the batch only store padding.

Slot of a token (vLLM 0.13's formula; B = kernel block size, W = CP world size, R = CP rank,
I = interleave, V = B * W):
``block = table[row, pos // V]``, ``o = pos % V``; the token is local when
``(o // I) % W == R``, its slot then ``block * B + (o // (W * I)) * I + o % I``, else the pad.

A token whose row or position lies outside the table is never read from memory: it gets
the pad slot (device inputs are not checked on the host, which would cost a sync).

Triton is imported on first use, so ``impl`` imports without it. On a machine without a
GPU the kernel runs under ``TRITON_INTERPRET=1`` (CPU tensors), which is how CI tests it.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from kvspec.impl.checks import as_int
from kvspec.impl.errors import (
    SlotMappingArgumentError as SlotMappingArgumentError,
)
from kvspec.impl.utils import TORCH_INTEGER_DTYPES

PAD_SLOT_ID = -1
# Tokens per Triton program. 1024 keeps a program's loads and stores in flight without
# spilling; tiles past the batch only store the pad.
TOKENS_PER_PROGRAM = 1024


@functools.cache
def triton_available() -> bool:
    """Whether ``import triton`` works in this process."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _slot_mapping_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[untyped-decorator]
    def slot_mapping_kernel(  # type: ignore[no-untyped-def]
        block_table_ptr,
        req_indices_ptr,
        positions_ptr,
        out_ptr,
        row_stride,
        num_rows,
        row_width,
        num_tokens,
        num_slots,
        BLOCK_SIZE: tl.constexpr,
        CP_WORLD_SIZE: tl.constexpr,
        CP_RANK: tl.constexpr,
        INTERLEAVE: tl.constexpr,
        PAD: tl.constexpr,
        TILE: tl.constexpr,
    ):
        offsets = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
        in_batch = offsets < num_tokens
        rows = tl.load(req_indices_ptr + offsets, mask=in_batch, other=0).to(tl.int64)
        positions = tl.load(positions_ptr + offsets, mask=in_batch, other=0).to(tl.int64)
        virtual_block_size: tl.constexpr = BLOCK_SIZE * CP_WORLD_SIZE
        block_indices = positions // virtual_block_size
        readable = (
            in_batch & (rows >= 0) & (rows < num_rows) & (positions >= 0)
            & (block_indices < row_width)
        )
        blocks = tl.load(
            block_table_ptr + rows * row_stride + block_indices, mask=readable, other=0
        ).to(tl.int64)
        offsets_in_block = positions % virtual_block_size
        if CP_WORLD_SIZE == 1:
            slots = blocks * BLOCK_SIZE + offsets_in_block
        else:
            local = (offsets_in_block // INTERLEAVE) % CP_WORLD_SIZE == CP_RANK
            local_offsets = (
                (offsets_in_block // (CP_WORLD_SIZE * INTERLEAVE)) * INTERLEAVE
                + offsets_in_block % INTERLEAVE
            )
            slots = tl.where(local, blocks * BLOCK_SIZE + local_offsets, PAD)
        slots = tl.where(readable, slots, PAD)
        tl.store(out_ptr + offsets, slots, mask=offsets < num_slots)

    return slot_mapping_kernel


def _check_arguments(
    block_table: object,
    req_indices: object,
    positions: object,
    out: object,
    num_tokens: object,
    block_size: object,
    cp_world_size: object,
    cp_rank: object,
    interleave: object,
    pad: object,
) -> tuple[int, int, int, int, int, int]:
    """Every argument checked on the host (no device sync): the integers returned as ints.
    The values of the index tensors are not read; tokens outside the table get the pad."""
    block_table = _tensor("block_table", block_table)
    req_indices = _tensor("req_indices", req_indices)
    positions = _tensor("positions", positions)
    out = _tensor("out", out)
    if block_table.dim() != 2 or block_table.stride(1) != 1:
        raise SlotMappingArgumentError(
            f"block_table must be 2-D with contiguous rows, got shape "
            f"{tuple(block_table.shape)} strides {block_table.stride()}"
        )
    for name, tensor in (("block_table", block_table), ("req_indices", req_indices),
                         ("positions", positions)):
        if tensor.dtype not in TORCH_INTEGER_DTYPES:
            raise SlotMappingArgumentError(f"{name} must hold integers, got {tensor.dtype}")
    if req_indices.dim() != 1 or positions.dim() != 1:
        raise SlotMappingArgumentError(
            f"req_indices of shape {tuple(req_indices.shape)} and positions of shape "
            f"{tuple(positions.shape)} must be 1-D"
        )
    if out.dim() != 1 or not out.is_contiguous() or out.dtype != torch.int64:
        raise SlotMappingArgumentError("out must be a contiguous 1-D int64 tensor")
    devices = {tensor.device for tensor in (block_table, req_indices, positions, out)}
    if len(devices) != 1:
        raise SlotMappingArgumentError(f"the tensors are on different devices: {devices}")
    numbers = []
    for name, value, low in (("num_tokens", num_tokens, 0), ("block_size", block_size, 1),
                             ("cp_world_size", cp_world_size, 1), ("cp_rank", cp_rank, 0),
                             ("interleave", interleave, 1), ("pad", pad, None)):
        number = as_int(value)
        if number is None or (low is not None and number < low):
            raise SlotMappingArgumentError(
                f"{name}={value!r} must be an integer" + ("" if low is None else f" >= {low}"))
        numbers.append(number)
    count, size, world, rank, step, pad_slot = numbers
    if count > out.numel():
        raise SlotMappingArgumentError(
            f"num_tokens={count} is outside [0, {out.numel()}] (the buffer's length)"
        )
    if req_indices.numel() < count or positions.numel() < count:
        raise SlotMappingArgumentError(
            f"num_tokens={count} but req_indices has {req_indices.numel()} and "
            f"positions {positions.numel()} entries"
        )
    if not 0 <= rank < world:
        raise SlotMappingArgumentError(f"cp_rank={rank} is outside [0, {world})")
    if world > 1 and size % step:
        raise SlotMappingArgumentError(f"interleave={step} does not divide block_size={size}")
    return count, size, world, rank, step, pad_slot


def _tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise SlotMappingArgumentError(
            f"{name} must be a tensor, got {type(value).__name__} {value!r:.60}")
    return value


def slot_mapping_triton(
    block_table: torch.Tensor,
    req_indices: torch.Tensor,
    positions: torch.Tensor,
    out: torch.Tensor,
    num_tokens: int,
    block_size: int,
    cp_world_size: int = 1,
    cp_rank: int = 0,
    interleave: int = 1,
    pad: int = PAD_SLOT_ID,
) -> None:
    """Fill all of ``out`` in one kernel launch: slots for the first ``num_tokens``
    tokens, ``pad`` after them."""
    num_tokens, block_size, cp_world_size, cp_rank, interleave, pad = _check_arguments(
        block_table, req_indices, positions, out, num_tokens, block_size, cp_world_size,
        cp_rank, interleave, pad,
    )
    num_slots = out.numel()
    if num_slots == 0:
        return
    kernel = _slot_mapping_kernel()
    grid = (_num_programs(num_slots),)
    kernel[grid](
        block_table, req_indices, positions, out,
        block_table.stride(0), block_table.shape[0], block_table.shape[1], num_tokens,
        num_slots,
        BLOCK_SIZE=block_size, CP_WORLD_SIZE=cp_world_size, CP_RANK=cp_rank,
        INTERLEAVE=interleave, PAD=pad, TILE=TOKENS_PER_PROGRAM,
    )


def _num_programs(num_slots: int) -> int:
    """Programs to cover the whole buffer, the padding tail included."""
    return -(-num_slots // TOKENS_PER_PROGRAM)


def slot_mapping_torch(
    block_table: torch.Tensor,
    req_indices: torch.Tensor,
    positions: torch.Tensor,
    out: torch.Tensor,
    num_tokens: int,
    block_size: int,
    cp_world_size: int = 1,
    cp_rank: int = 0,
    interleave: int = 1,
    pad: int = PAD_SLOT_ID,
) -> None:
    """The same result as :func:`slot_mapping_triton`, in torch ops (any device)."""
    num_tokens, block_size, cp_world_size, cp_rank, interleave, pad = _check_arguments(
        block_table, req_indices, positions, out, num_tokens, block_size, cp_world_size,
        cp_rank, interleave, pad,
    )
    num_rows, row_width = block_table.shape
    rows = req_indices[:num_tokens].to(torch.int64)
    token_positions = positions[:num_tokens].to(torch.int64)
    virtual_block_size = block_size * cp_world_size
    block_indices = torch.div(token_positions, virtual_block_size, rounding_mode="floor")
    readable = (
        (rows >= 0) & (rows < num_rows) & (token_positions >= 0) & (block_indices < row_width)
    )
    blocks = _gather_blocks(block_table, rows, block_indices, readable)
    offsets = token_positions - block_indices * virtual_block_size
    if cp_world_size == 1:
        slots = blocks * block_size + offsets
    else:
        local = torch.remainder(
            torch.div(offsets, interleave, rounding_mode="floor"), cp_world_size
        ) == cp_rank
        local_offsets = (
            torch.div(offsets, cp_world_size * interleave, rounding_mode="floor") * interleave
            + torch.remainder(offsets, interleave)
        )
        slots = torch.where(local, blocks * block_size + local_offsets, pad)
    slots = torch.where(readable, slots, pad)
    out[:num_tokens].copy_(slots)
    out[num_tokens:].fill_(pad)


def _gather_blocks(
    block_table: torch.Tensor,
    rows: torch.Tensor,
    block_indices: torch.Tensor,
    readable: torch.Tensor,
) -> torch.Tensor:
    """``block_table[row, index]`` per token as int64; unreadable tokens read entry (0, 0)."""
    zero = torch.zeros_like(rows)
    return block_table[
        torch.where(readable, rows, zero), torch.where(readable, block_indices, zero)
    ].to(torch.int64)
