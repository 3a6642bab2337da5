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

PAD_SLOT_ID = -1
# Tokens per Triton program. 1024 keeps a program's loads and stores in flight without
# spilling; tiles past the batch only store the pad.
TOKENS_PER_PROGRAM = 1024


class SlotMappingArgumentError(ValueError):
    """Buffers or parameters the device slot mapping cannot use."""


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
    block_table: torch.Tensor,
    req_indices: torch.Tensor,
    positions: torch.Tensor,
    out: torch.Tensor,
    num_tokens: int,
    block_size: int,
    cp_world_size: int,
    cp_rank: int,
    interleave: int,
) -> None:
    if block_table.dim() != 2 or block_table.stride(1) != 1:
        raise SlotMappingArgumentError(
            f"block_table must be 2-D with contiguous rows, got shape "
            f"{tuple(block_table.shape)} strides {block_table.stride()}"
        )
    if out.dim() != 1 or not out.is_contiguous() or out.dtype != torch.int64:
        raise SlotMappingArgumentError("out must be a contiguous 1-D int64 tensor")
    if not 0 <= num_tokens <= out.numel():
        raise SlotMappingArgumentError(
            f"num_tokens={num_tokens} is outside [0, {out.numel()}] (the buffer's length)"
        )
    if req_indices.numel() < num_tokens or positions.numel() < num_tokens:
        raise SlotMappingArgumentError(
            f"num_tokens={num_tokens} but req_indices has {req_indices.numel()} and "
            f"positions {positions.numel()} entries"
        )
    if block_size < 1 or cp_world_size < 1 or interleave < 1:
        raise SlotMappingArgumentError(
            f"block_size={block_size}, cp_world_size={cp_world_size} and "
            f"interleave={interleave} must all be positive"
        )
    if not 0 <= cp_rank < cp_world_size:
        raise SlotMappingArgumentError(f"cp_rank={cp_rank} is outside [0, {cp_world_size})")


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
    _check_arguments(
        block_table, req_indices, positions, out, num_tokens, block_size, cp_world_size,
        cp_rank, interleave,
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
    _check_arguments(
        block_table, req_indices, positions, out, num_tokens, block_size, cp_world_size,
        cp_rank, interleave,
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
