"""The worker's block tables: vLLM 0.13's ``BlockTable`` and ``MultiGroupBlockTable`` API.

Specification: spec/block_table_model.py (row operations) and spec/slot_mapping.py (the slot
of each token). vLLM reference: vllm/v1/worker/block_table.py (0.13).

Layout
------
* ``block_table``: a ``CpuGpuBuffer`` of int32 ``[max_num_reqs, max_num_blocks_per_req]``
  (kernel blocks). Row operations edit ``block_table.np``; ``commit_block_table`` publishes
  them to ``block_table.gpu``.
* ``num_blocks_per_row``: numpy int32, the number of valid (kernel) entries per row.
* ``slot_mapping``: a ``CpuGpuBuffer`` of int64 ``[max_num_batched_tokens]``; after
  ``compute_slot_mapping`` of ``T`` tokens every entry past ``T`` is the pad slot -1.

What makes the CPU path fast
----------------------------
* ``_slot_bases``, an int64 shadow of the table, holds ``block * B - j * B`` at column ``j``
  (B = kernel block size), so a token's slot is ``_slot_bases[row * width + pos // B] + pos``:
  five ufunc calls, with no int32-to-int64 widening and no ``pos % B``. Under context
  parallelism it holds ``block * B`` and a table of local offsets per offset into the
  virtual block finishes the job. Every row operation keeps it in step.
* ``compute_slot_mapping`` allocates nothing: every ufunc writes into preallocated scratch
  through a positional ``out`` (the keyword form costs a parse per call), constants are 0-d
  arrays (a Python scalar costs a conversion per call), power-of-two block sizes divide by
  shifting, and the scratch views for a batch size are cut once and reused.
* Its input checks are one ``argmax`` per index array viewed as unsigned: a negative value
  becomes huge, so "outside ``[0, limit)``" is a single comparison (against at most
  ``2**(bits-1)`` for a narrow signed dtype, whose -1 is only 255 or 65535).
* The tail past the batch is re-padded only as far as the previous batch reached.
* ``append_row`` of a short list (the scheduler's case) writes the table, the shadow and
  the bookkeeping element by element through ``memoryview``s of the numpy arrays: cheaper
  than building a numpy array for two ids, so it costs about what vLLM's does.
* ``commit_block_table`` copies only the cells written since the last commit. The append
  fast path logs each cell it writes, and the commit copies the logged cells with one
  gather and one scatter; every other write flags its row with a span of columns, copied
  as one window per flagged row (or, when the flagged rows are dense, their bounding
  rectangle as one strided copy). Nothing written, nothing copied.
* Each row's *extent* (one past the last column ever written) bounds what ``swap_row``
  has to move: past it both rows are zero.

The price of the shadow is host memory: 8 bytes per table entry on top of the table's 4 (it
is not kept when the slot mapping runs on the device).

Writes made directly to ``block_table.np`` (or a retained ``get_numpy_array()`` view)
bypass the shadow and the dirty tracking: call ``mark_dirty()`` after them.
``get_numpy_array()`` and ``get_cpu_tensor()`` mark the table dirty themselves.

On a CUDA device (or with ``slot_mapping_backend`` "triton"/"torch") the slot mapping is
computed on the device from ``block_table.gpu`` by impl/slot_mapping_triton.py, padding
included; ``slot_mapping.np`` is then not written and ``commit_slot_mapping`` has nothing
to copy.

Every input is checked before anything changes: a refused call raises a ``BlockTableError``
(a ``ValueError`` or ``IndexError``) naming the value and leaves all tables, host and device,
as they were. Block ids and batches may be lists, tuples or other sequences of ints (checked
element by element: numpy would take ``[True, 2]`` as ``[1, 2]``), numpy integer arrays of any
width and byte order, or integer tensors; rows and counts Python or numpy ints. Batches
already on the device are checked for dtype and shape only (their values would cost a sync).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvspec.impl import host_types, slot_mapping_triton
from kvspec.impl.checks import as_int
from kvspec.impl.errors import (
    BlockIdError as BlockIdError,
    BlockTableConfigError as BlockTableConfigError,
    BlockTableError as BlockTableError,
    GroupIndexError as GroupIndexError,
    PositionError as PositionError,
    RowCapacityError as RowCapacityError,
    RowIndexError as RowIndexError,
    TokenBatchError as TokenBatchError,
)
from kvspec.impl.utils import (
    TORCH_INTEGER_DTYPES,
    CpuGpuBuffer,
    CpuGpuBufferError,
    as_device,
)

PAD_SLOT_ID = -1
INT32_LIMIT = 2**31
# Added to a non-local token's slot under context parallelism, then clamped to the pad.
_NOT_LOCAL = -(2**62)
_UNSIGNED: dict[int, type[np.unsignedinteger[Any]]] = {
    1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64,
}
_BACKENDS = ("auto", "numpy", "triton", "torch")
_INT64 = np.dtype(np.int64)
_UINT64 = np.dtype(np.uint64)
# A commit gathers the dirty cells one by one unless their bounding rectangle is at most
# this many times larger (a strided block copy is that much cheaper per cell).
_RECTANGLE_ADVANTAGE = 8
# Lists of up to this many block ids are checked in Python (cheaper than numpy for few ids).
_SMALL_LIST = 64
# Slots and positions are int64.
_INT64_LIMIT = 2**63
# Under context parallelism the table of local offsets has one entry per position of a
# virtual block (kernel block size x CP world size), built in Python once.
_MAX_VIRTUAL_BLOCK = 2**24
_EMPTY_IDS = np.zeros(0, dtype=np.int64)


# --- argument checks (each raises the typed error naming the value) ------------------------


def _positive(name: str, value: object) -> int:
    number = as_int(value)
    if number is None or number < 1:
        raise BlockTableConfigError(f"{name}={value!r} must be a positive integer")
    return number


def _index(value: object, stop: int, error: type[BlockTableError], what: str) -> int:
    """``value`` as an int in ``[0, stop)``."""
    number = as_int(value)
    if number is None:
        raise error(f"{what} {value!r} is not an integer")
    if not 0 <= number < stop:
        raise error(f"{what} {number} is outside [0, {stop})")
    return number


def _count(value: object, high: int, error: type[BlockTableError], name: str) -> int:
    """``value`` as an int in ``[0, high]``."""
    number = as_int(value)
    if number is None:
        raise error(f"{name}={value!r} is not an integer")
    if not 0 <= number <= high:
        raise error(f"{name}={number} is outside [0, {high}]")
    return number


def _rank(name: str, value: object, world_size: int) -> int:
    """A context-parallel rank: an int in ``[0, world_size)``."""
    number = as_int(value)
    if number is None or not 0 <= number < world_size:
        raise BlockTableConfigError(f"{name}={value!r} is outside [0, {world_size})")
    return number


def _cp_layout(
    block_size: object, cp_world_size: object, cp_rank: object, interleave: object
) -> tuple[int, int, int, int]:
    """A context-parallel layout's numbers as ints (the spec's preconditions)."""
    size = _positive("block_size", block_size)
    world = _positive("cp_world_size", cp_world_size)
    rank = _rank("cp_rank", cp_rank, world)
    step = _positive("interleave", interleave)
    if world > 1 and size % step:
        # Otherwise a rank's local offsets run past its block into the next one.
        raise BlockTableConfigError(f"interleave={step} does not divide block_size={size}")
    return size, world, rank, step


def _describe(value: object) -> str:
    """``repr(value)``, cut short: enough to name a bad argument in a message."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({type(value).__name__})"


def _integer_array(values: Any, name: str, error: type[BlockTableError]) -> np.ndarray:
    """``values`` (a sequence of integers, a numpy integer array or an integer tensor) as a
    1-D numpy integer array in native byte order, or ``error`` naming what is wrong. Reads
    ``values`` whole and changes nothing.

    A sequence is checked element by element (C-speed: the set of its element types), since
    numpy would take ``[True, 2]`` as ``[1, 2]`` and ``[1, 2.5]`` as floats."""
    if isinstance(values, torch.Tensor):
        if values.dtype not in TORCH_INTEGER_DTYPES:
            raise error(f"{name} must hold integers, got a tensor of {values.dtype}")
        values = values.detach().cpu().numpy()
    if not isinstance(values, np.ndarray):
        if isinstance(values, str | bytes | bytearray) or not isinstance(values, Sequence):
            raise error(
                f"{name} must be a sequence or an array of integers, got {_describe(values)}"
            )
        if not values:
            return _EMPTY_IDS
        if not set(map(type, values)) <= {int}:
            for index, element in enumerate(values):
                if as_int(element) is None:
                    raise error(f"{name}[{index}] = {_describe(element)} is not an integer "
                                f"(a {type(element).__name__})")
        array = np.asarray(values)
        if array.dtype.kind not in "iu":
            # numpy holds these integers as objects or floats: one is outside int64.
            for index, element in enumerate(values):
                if not -(2**63) <= int(element) < 2**63:
                    raise error(f"{name}[{index}] = {element} is outside the int64 range")
            raise error(f"{name} {_describe(values)} is not an array of int64")
        return array
    if values.ndim != 1:
        raise error(f"{name} must be 1-D, got shape {values.shape} of {values.dtype}")
    if values.dtype.kind not in "iu":
        if values.dtype.kind == "O":
            return _integer_array(values.tolist(), name, error)
        if values.size:
            raise error(f"{name} must hold integers, got an array of {values.dtype}")
        return _EMPTY_IDS
    if not values.dtype.isnative:
        return values.astype(values.dtype.newbyteorder("="))
    return values


# --- the slot of one token (scalar; the numpy path's offset table is built from these) ---


def cp_local_offset(
    offset: int, block_size: int, cp_world_size: int, cp_rank: int, interleave: int
) -> int:
    """Where the token at ``offset`` into its virtual block sits in ``cp_rank``'s physical
    block, or ``PAD_SLOT_ID`` when another rank stores it."""
    block_size, cp_world_size, cp_rank, interleave = _cp_layout(
        block_size, cp_world_size, cp_rank, interleave)
    offset = _index(offset, block_size * cp_world_size, PositionError, "offset")
    if (offset // interleave) % cp_world_size != cp_rank:
        return PAD_SLOT_ID
    return (offset // (cp_world_size * interleave)) * interleave + offset % interleave


def slot_of_token(
    flat_table: Sequence[int],
    row_stride: int,
    row: int,
    position: int,
    block_size: int,
    cp_world_size: int = 1,
    cp_rank: int = 0,
    interleave: int = 1,
) -> int:
    """The slot of one token, read from a row-major table with ``row_stride`` columns."""
    block_size, cp_world_size, cp_rank, interleave = _cp_layout(
        block_size, cp_world_size, cp_rank, interleave)
    row_stride = _positive("row_stride", row_stride)
    if not isinstance(flat_table, Sequence | np.ndarray) or isinstance(flat_table, str | bytes):
        raise BlockIdError(f"flat_table {_describe(flat_table)} is not a sequence of block ids")
    num_rows, rest = divmod(len(flat_table), row_stride)
    if rest:
        raise BlockTableConfigError(
            f"row_stride={row_stride} does not divide the table's {len(flat_table)} entries")
    row = _index(row, num_rows, RowIndexError, "row index")
    virtual_block_size = block_size * cp_world_size
    position = _index(position, row_stride * virtual_block_size, PositionError, "position")
    column = position // virtual_block_size
    block = as_int(flat_table[row * row_stride + column])
    if block is None or block < 0:
        raise BlockIdError(
            f"the table holds {flat_table[row * row_stride + column]!r} at row {row}, "
            f"column {column}: not a block id")
    local = cp_local_offset(
        position % virtual_block_size, block_size, cp_world_size, cp_rank, interleave
    )
    return PAD_SLOT_ID if local == PAD_SLOT_ID else block * block_size + local


def kernel_block_ids(block_ids: Sequence[int], blocks_per_kv_block: int) -> list[int]:
    """Manager block ``b`` becomes kernel blocks ``b*k .. b*k + k - 1``."""
    factor = _positive("blocks_per_kv_block", blocks_per_kv_block)
    if type(block_ids) is not list and (
            not isinstance(block_ids, Sequence) or isinstance(block_ids, str | bytes)):
        raise BlockIdError(f"block_ids {_describe(block_ids)} is not a sequence of block ids")
    for index, block in enumerate(block_ids):
        if type(block) is not int or block < 0:
            number = as_int(block)
            if number is None or number < 0:
                raise BlockIdError(f"block_ids[{index}] = {_describe(block)} is not a block id")
    return [block * factor + j for block in block_ids for j in range(factor)]


def cp_offset_table(
    block_size: int, cp_world_size: int, cp_rank: int, interleave: int
) -> np.ndarray:
    """``cp_local_offset`` for every offset of a virtual block, ``_NOT_LOCAL`` for tokens of
    other ranks (so that ``block * B + entry`` is negative for them)."""
    block_size, cp_world_size, cp_rank, interleave = _cp_layout(
        block_size, cp_world_size, cp_rank, interleave)
    if block_size * cp_world_size > _MAX_VIRTUAL_BLOCK:
        raise BlockTableConfigError(
            f"a virtual block of block_size={block_size} x cp_world_size={cp_world_size} "
            f"positions is more than the {_MAX_VIRTUAL_BLOCK} an offset table holds")
    offsets = [
        cp_local_offset(offset, block_size, cp_world_size, cp_rank, interleave)
        for offset in range(block_size * cp_world_size)
    ]
    return np.array([_NOT_LOCAL if o == PAD_SLOT_ID else o for o in offsets], dtype=np.int64)


# --- numpy kernels (module functions, each one job) ----------------------------------------


def _slots_standard(
    slot_bases: np.ndarray,
    row_stride: np.ndarray,
    block_shift: np.ndarray | None,
    block_size: np.ndarray,
    req_indices: np.ndarray,
    positions: np.ndarray,
    block_index: np.ndarray,
    flat_index: np.ndarray,
    out: np.ndarray,
) -> None:
    """``out[t] = slot_bases[req[t] * stride + pos[t] // B] + pos[t]``, which is
    ``table[req[t], pos[t] // B] * B + pos[t] % B``."""
    if block_shift is not None:
        np.right_shift(positions, block_shift, block_index)
    else:
        np.floor_divide(positions, block_size, block_index)
    np.multiply(req_indices, row_stride, flat_index)
    np.add(flat_index, block_index, flat_index)
    slot_bases.take(flat_index, out=out, mode="clip")
    np.add(out, positions, out)


def _slots_context_parallel(
    slot_bases: np.ndarray,
    offset_table: np.ndarray,
    row_stride: np.ndarray,
    virtual_block_size: np.ndarray,
    req_indices: np.ndarray,
    positions: np.ndarray,
    block_index: np.ndarray,
    flat_index: np.ndarray,
    out: np.ndarray,
) -> None:
    """``out[t] = block * B + local offset``, or the pad for tokens other ranks store
    (``slot_bases`` holds ``block * B`` here)."""
    np.floor_divide(positions, virtual_block_size, block_index)
    np.multiply(req_indices, row_stride, flat_index)
    np.add(flat_index, block_index, flat_index)
    slot_bases.take(flat_index, out=out, mode="clip")
    np.remainder(positions, virtual_block_size, block_index)
    offset_table.take(block_index, out=flat_index, mode="clip")
    np.add(out, flat_index, out)
    np.maximum(out, PAD_SLOT_ID, out=out)


def _pad_tail(slots: np.ndarray, start: int, stop: int) -> None:
    """Entries ``[start, stop)`` of the slot buffer become the pad slot."""
    if stop > start:
        slots[start:stop] = PAD_SLOT_ID


def _check_below(
    values: np.ndarray, limit: int, error: type[BlockTableError], name: str
) -> None:
    """Raise ``error`` unless every value is in ``[0, limit)``: one argmax over the values
    viewed as unsigned. A negative value of a signed dtype of ``b`` bits is at least
    ``2**(b-1)`` when viewed so, and every non-negative one is below that: against the smaller
    of ``limit`` and ``2**(b-1)`` one comparison refuses exactly the negatives and the values
    past the limit (an int8 -1 read as 255 is below a limit of 1000)."""
    bound = limit
    unsigned = values
    if values.dtype.kind == "i":
        unsigned = values.view(_UNSIGNED[values.dtype.itemsize])
        bound = min(limit, 1 << (8 * values.dtype.itemsize - 1))
    worst = int(unsigned.argmax())
    if int(unsigned[worst]) >= bound:
        raise error(f"{name}[{worst}] = {int(values[worst])} is outside [0, {limit})")


def _expand_kernel_blocks(
    ids: np.ndarray, blocks_per_kv_block: int, kernel_block_arange: np.ndarray
) -> np.ndarray:
    """``BlockTable.map_to_kernel_blocks`` on checked arguments."""
    if blocks_per_kv_block == 1:
        return ids
    expanded: np.ndarray = ids.reshape(-1, 1) * blocks_per_kv_block + kernel_block_arange
    return expanded.reshape(-1)


def _elements(values: np.ndarray) -> memoryview:
    """Python-speed element access to a 1-D numpy array's memory."""
    return memoryview(values)  # type: ignore[arg-type]  # numpy arrays export the buffer


def _power_of_two_shift(value: int) -> np.ndarray | None:
    return np.array(value.bit_length() - 1, dtype=np.int64) if value & (value - 1) == 0 else None


def _context_parallel(
    pcp_world_size: int | None, pcp_rank: int | None,
    dcp_world_size: int | None, dcp_rank: int | None,
) -> tuple[int, int, int, int]:
    """The given context-parallel layout, the process's (``host_types``: one rank, or vLLM's
    process groups inside vLLM) for whatever is not given. A rank of None with its world size
    given is refused: the process's rank belongs to the process's world size, not this one."""
    for kind, world_size, rank in (("pcp", pcp_world_size, pcp_rank),
                                   ("dcp", dcp_world_size, dcp_rank)):
        if world_size is not None and rank is None:
            raise BlockTableConfigError(
                f"{kind}_rank=None with {kind}_world_size={world_size!r}: give the rank with "
                f"its world size (or neither, for the process's own)")
    pcp, pcp_r, dcp, dcp_r = host_types.context_parallel_layout()
    return (pcp if pcp_world_size is None else pcp_world_size,
            pcp_r if pcp_rank is None else pcp_rank,
            dcp if dcp_world_size is None else dcp_world_size,
            dcp_r if dcp_rank is None else dcp_rank)


class BlockTable:
    """One KV-cache group's block table and slot mapping (vLLM 0.13 API)."""

    def __init__(
        self,
        block_size: int,
        max_num_reqs: int,
        max_num_blocks_per_req: int,
        max_num_batched_tokens: int,
        pin_memory: bool,
        device: torch.device | str,
        kernel_block_size: int,
        cp_kv_cache_interleave_size: int = 1,
        *,
        pcp_world_size: int | None = None,
        pcp_rank: int | None = None,
        dcp_world_size: int | None = None,
        dcp_rank: int | None = None,
        num_blocks: int | None = None,
        slot_mapping_backend: str = "auto",
    ) -> None:
        pcp_world_size, pcp_rank, dcp_world_size, dcp_rank = _context_parallel(
            pcp_world_size, pcp_rank, dcp_world_size, dcp_rank)
        block_size = _positive("block_size", block_size)
        kernel_block_size = _positive("kernel_block_size", kernel_block_size)
        max_num_reqs = _positive("max_num_reqs", max_num_reqs)
        max_num_blocks_per_req = _positive("max_num_blocks_per_req", max_num_blocks_per_req)
        max_num_batched_tokens = _positive("max_num_batched_tokens", max_num_batched_tokens)
        interleave = _positive("cp_kv_cache_interleave_size", cp_kv_cache_interleave_size)
        pcp_world_size = _positive("pcp_world_size", pcp_world_size)
        dcp_world_size = _positive("dcp_world_size", dcp_world_size)
        pcp_rank = _rank("pcp_rank", pcp_rank, pcp_world_size)
        dcp_rank = _rank("dcp_rank", dcp_rank, dcp_world_size)
        if not isinstance(pin_memory, bool):
            raise BlockTableConfigError(f"pin_memory={pin_memory!r} is not a bool")
        target = as_device(device, BlockTableConfigError)
        if block_size % kernel_block_size != 0:
            raise BlockTableConfigError(
                f"block_size={block_size} is not a multiple of "
                f"kernel_block_size={kernel_block_size}"
            )
        blocks_per_kv_block = block_size // kernel_block_size
        cp_world_size = pcp_world_size * dcp_world_size
        if cp_world_size > 1 and kernel_block_size % interleave != 0:
            # Otherwise a rank's local offsets run past its block into the next one.
            raise BlockTableConfigError(
                f"cp_kv_cache_interleave_size={interleave} does not divide the kernel block "
                f"size {kernel_block_size}"
            )
        if cp_world_size > 1 and kernel_block_size * cp_world_size > _MAX_VIRTUAL_BLOCK:
            raise BlockTableConfigError(
                f"pcp_world_size={pcp_world_size} x dcp_world_size={dcp_world_size} ranks of "
                f"kernel blocks of {kernel_block_size}: a virtual block has more than "
                f"{_MAX_VIRTUAL_BLOCK} positions"
            )
        # Kernel block ids are int32, slots int64.
        int32_bound = INT32_LIMIT // blocks_per_kv_block
        if int32_bound < 1:
            raise BlockTableConfigError(
                f"block_size={block_size} holds {blocks_per_kv_block} kernel blocks of "
                f"kernel_block_size={kernel_block_size}: their ids do not fit int32"
            )
        if num_blocks is not None:
            num_blocks = _positive("num_blocks", num_blocks)
            if num_blocks > int32_bound:
                raise BlockTableConfigError(
                    f"num_blocks={num_blocks}: the kernel block ids of at most {int32_bound} "
                    f"blocks fit int32"
                )
        block_id_limit = int32_bound if num_blocks is None else num_blocks
        if block_id_limit * block_size > _INT64_LIMIT:
            raise BlockTableConfigError(
                f"block_size={block_size}: the slots of {block_id_limit} blocks do not fit "
                f"int64 (pass num_blocks, the pool's size)"
            )
        if type(slot_mapping_backend) is not str or slot_mapping_backend not in _BACKENDS:
            raise BlockTableConfigError(
                f"slot_mapping_backend={slot_mapping_backend!r} is not one of {_BACKENDS}"
            )
        if slot_mapping_backend == "triton" and not slot_mapping_triton.triton_available():
            raise BlockTableConfigError("slot_mapping_backend='triton' needs triton installed")

        self.max_num_reqs = max_num_reqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.pin_memory = pin_memory
        self.device = target
        self.block_size = kernel_block_size
        self.blocks_per_kv_block = blocks_per_kv_block
        self.use_hybrid_blocks = blocks_per_kv_block != 1
        self.max_num_blocks_per_req = max_num_blocks_per_req * self.blocks_per_kv_block
        self.pcp_world_size, self.pcp_rank = pcp_world_size, pcp_rank
        self.dcp_world_size, self.dcp_rank = dcp_world_size, dcp_rank
        self.cp_kv_cache_interleave_size = interleave
        self.num_blocks = num_blocks
        self._cp_world_size = cp_world_size
        self._cp_rank = pcp_rank * dcp_world_size + dcp_rank
        self._block_id_limit = block_id_limit
        width = self.max_num_blocks_per_req
        # Positions are int64: a limit past 2**63 would let a negative one, viewed as unsigned,
        # through the checks (with absurd block sizes).
        self._position_limit = min(width * self.block_size * cp_world_size, _INT64_LIMIT)

        try:
            self.block_table = CpuGpuBuffer(
                max_num_reqs, width, dtype=torch.int32, device=self.device,
                pin_memory=pin_memory,
            )
            self.slot_mapping = CpuGpuBuffer(
                max_num_batched_tokens, dtype=torch.int64, device=self.device,
                pin_memory=pin_memory,
            )
        except CpuGpuBufferError as error:
            raise BlockTableConfigError(
                f"cannot allocate the tables of max_num_reqs={max_num_reqs} rows of "
                f"max_num_blocks_per_req={max_num_blocks_per_req} blocks (of "
                f"block_size={block_size}, kernel_block_size={kernel_block_size}) and "
                f"max_num_batched_tokens={max_num_batched_tokens} slots on {target}: {error}"
            ) from error
        # After the table: its size bounds what these take.
        self._kernel_block_arange = np.arange(self.blocks_per_kv_block).reshape(1, -1)
        self.num_blocks_per_row = np.zeros(max_num_reqs, dtype=np.int32)
        self.slot_mapping.np.fill(PAD_SLOT_ID)
        self.slot_mapping.gpu.fill_(PAD_SLOT_ID)
        self._table_np: np.ndarray = self.block_table.np
        self._table_flat: np.ndarray = self._table_np.reshape(-1)
        # Python-speed element access to numpy memory, for the per-step row operations.
        self._table_mv = _elements(self._table_flat)
        self._gpu_flat: np.ndarray | None = (
            self.block_table.gpu.numpy().reshape(-1) if self.device.type == "cpu" else None
        )
        self._counts_mv = _elements(self.num_blocks_per_row)

        self._backend = self._choose_backend(slot_mapping_backend)
        # The shadow: block * B - (j * B without CP) at column j; see the module docstring.
        self._bias_step = self.block_size if cp_world_size == 1 else 0
        self._column_bias = np.arange(width, dtype=np.int64) * self._bias_step
        self._slot_bases: np.ndarray | None = None
        self._bases_mv: memoryview | None = None
        self._bases_stale = False
        # compute_slot_mapping's inlined path applies (numpy, no CP, shadow current).
        self._fast_slots = self._backend == "numpy" and cp_world_size == 1
        if self._backend == "numpy":
            bases = np.empty((max_num_reqs, width), dtype=np.int64)
            bases[:] = -self._column_bias
            self._slot_bases = bases.reshape(-1)
            self._bases_mv = _elements(self._slot_bases)

        # What changed since the last commit: per row a flag and the columns
        # [from, max(to, count)) that may differ from the device copy.
        self._row_dirty = np.zeros(max_num_reqs, dtype=np.bool_)
        self._dirty_mv = _elements(self._row_dirty.view(np.uint8))
        self._dirty_from = np.zeros(max_num_reqs, dtype=np.int64)
        self._dirty_to = np.zeros(max_num_reqs, dtype=np.int64)
        self._dirty_from_mv = _elements(self._dirty_from)
        self._dirty_to_mv = _elements(self._dirty_to)
        self._num_dirty = 0
        # The cells the append fast path wrote since the last commit, one by one.
        self._cell_log_capacity = max(1024, 4 * max_num_reqs)
        self._cell_log = np.empty(self._cell_log_capacity, dtype=np.int64)
        self._cell_log_mv = _elements(self._cell_log)
        self._logged_cells = 0
        self._row_extent = [0] * max_num_reqs  # past it a row is all zeros
        self._column_arange = np.arange(width, dtype=np.int64)

        self._cpu_slot_extent = 0  # slot_mapping.np[this:] is all pad
        self._gpu_slot_extent = 0  # slot_mapping.gpu[this:] is all pad
        self._slots_on_device = False
        self._row_stride = np.array(width, dtype=np.int64)
        self._block_size_0d = np.array(self.block_size, dtype=np.int64)
        self._block_shift = _power_of_two_shift(self.block_size)
        self._virtual_block_size_0d = np.array(self.block_size * cp_world_size, dtype=np.int64)
        self._block_index = np.empty(max_num_batched_tokens, dtype=np.int64)
        self._flat_index = np.empty(max_num_batched_tokens, dtype=np.int64)
        self._views_tokens = -1
        self._views: tuple[np.ndarray, np.ndarray, np.ndarray] = (
            self._block_index, self._flat_index, self.slot_mapping.np
        )
        # Used by the context-parallel slot mapping only.
        self._offset_table = cp_offset_table(
            self.block_size, cp_world_size, self._cp_rank, interleave
        ) if cp_world_size > 1 else _EMPTY_IDS
        self._device_req_indices: CpuGpuBuffer | None = None
        self._device_positions: CpuGpuBuffer | None = None

    def _choose_backend(self, requested: str) -> str:
        if requested == "auto":
            if self.device.type != "cuda":
                return "numpy"
            return "triton" if slot_mapping_triton.triton_available() else "torch"
        return requested

    # --- checks ---------------------------------------------------------------------------

    def _check_row(self, row_idx: Any) -> int:
        if type(row_idx) is int and 0 <= row_idx < self.max_num_reqs:
            return row_idx
        return _index(row_idx, self.max_num_reqs, RowIndexError, "row index")

    def _kernel_ids(self, block_ids: Sequence[int] | np.ndarray) -> Sequence[int] | np.ndarray:
        """The checked block ids, as kernel block ids (a short list of ints stays a list)."""
        limit = self._block_id_limit
        if type(block_ids) is list and len(block_ids) <= _SMALL_LIST:
            for block in block_ids:
                if type(block) is not int or not 0 <= block < limit:
                    break
            else:
                if self.blocks_per_kv_block == 1:
                    return block_ids
                return kernel_block_ids(block_ids, self.blocks_per_kv_block)
        ids = _integer_array(block_ids, "block_ids", BlockIdError)
        if ids.size:
            _check_below(ids, limit, BlockIdError, "block_ids")
        if self.blocks_per_kv_block != 1:
            return _expand_kernel_blocks(
                ids.astype(np.int64, copy=False), self.blocks_per_kv_block,
                self._kernel_block_arange,
            )
        return ids

    def _check_capacity(self, row: int, num_kernel_blocks: int) -> None:
        if num_kernel_blocks > self.max_num_blocks_per_req:
            raise RowCapacityError(
                f"row {row} would hold {num_kernel_blocks // self.blocks_per_kv_block} blocks, "
                f"more than max_num_blocks_per_req="
                f"{self.max_num_blocks_per_req // self.blocks_per_kv_block}"
            )

    # --- writes and bookkeeping -----------------------------------------------------------

    def _write(self, row: int, start: int, kernel_ids: Sequence[int] | np.ndarray) -> None:
        """Columns ``[start, start + len(kernel_ids))`` of ``row`` become ``kernel_ids``."""
        end = start + len(kernel_ids)
        offset = row * self.max_num_blocks_per_req
        if type(kernel_ids) is list and len(kernel_ids) <= _SMALL_LIST:
            table, bases = self._table_mv, self._bases_mv
            if bases is None:
                for cell, block in enumerate(kernel_ids, offset + start):
                    table[cell] = block
            else:
                block_size, bias, step = self.block_size, start * self._bias_step, self._bias_step
                for cell, block in enumerate(kernel_ids, offset + start):
                    table[cell] = block
                    bases[cell] = block * block_size - bias
                    bias += step
        else:
            cells = self._table_flat[offset + start : offset + end]
            cells[:] = kernel_ids
            if self._slot_bases is not None:
                shadow = self._slot_bases[offset + start : offset + end]
                np.multiply(cells, self._block_size_0d, shadow)
                np.subtract(shadow, self._column_bias[start:end], shadow)
        self._mark_written(row, start, end)

    def _copy_columns(self, rows: list[int], sources: list[int], width: int) -> None:
        """Columns ``[0, width)`` of each of ``rows`` become those of ``sources`` (read
        before anything is written)."""
        self._table_np[rows, :width] = self._table_np[sources, :width]
        if self._slot_bases is not None:
            bases = self._slot_bases.reshape(self.max_num_reqs, -1)
            bases[rows, :width] = bases[sources, :width]

    def _mark_written(self, row: int, first_col: int, end_col: int) -> None:
        """Columns ``[first_col, end_col)`` of ``row`` may now differ from the device."""
        if end_col > self._row_extent[row]:
            self._row_extent[row] = end_col
        if self._dirty_mv[row]:
            if first_col < self._dirty_from_mv[row]:
                self._dirty_from_mv[row] = first_col
            if end_col > self._dirty_to_mv[row]:
                self._dirty_to_mv[row] = end_col
            return
        self._dirty_mv[row] = 1
        self._dirty_from_mv[row] = first_col
        self._dirty_to_mv[row] = end_col
        self._num_dirty += 1

    def _set_count(self, row: int, count: int) -> None:
        """A dirty row's span ends at ``max(to, count)``: an append only moves the count, so
        a count that shrinks folds the old one into ``to`` first."""
        old = self._counts_mv[row]
        if old > count and self._dirty_mv[row] and old > self._dirty_to_mv[row]:
            self._dirty_to_mv[row] = old
        self._counts_mv[row] = count

    def mark_dirty(self) -> None:
        """Declare that ``block_table.np`` was written directly: the next commit copies the
        whole table and the next slot mapping rereads it."""
        width = self.max_num_blocks_per_req
        self._row_extent = [width] * self.max_num_reqs
        self._row_dirty[:] = True
        self._dirty_from[:] = 0
        self._dirty_to[:] = width
        self._num_dirty = self.max_num_reqs
        self._logged_cells = 0
        if self._slot_bases is not None:
            self._bases_stale = True
            self._fast_slots = False

    def _refresh_slot_bases(self, bases: np.ndarray) -> None:
        shadow = bases.reshape(self.max_num_reqs, -1)
        np.multiply(self._table_np, self._block_size_0d, shadow)
        np.subtract(shadow, self._column_bias, shadow)
        self._bases_stale = False
        self._fast_slots = self._cp_world_size == 1

    # --- row operations -------------------------------------------------------------------

    def append_row(self, block_ids: Sequence[int] | np.ndarray, row_idx: int) -> None:
        """Append ``block_ids`` (manager block ids) to row ``row_idx``."""
        if (
            type(block_ids) is list and type(row_idx) is int
            and 0 <= row_idx < self.max_num_reqs and self.blocks_per_kv_block == 1
        ):
            # The scheduler's case (a few ids, every step, every request), inlined.
            num_ids = len(block_ids)
            start = self._counts_mv[row_idx]
            end = start + num_ids
            if 0 < num_ids <= _SMALL_LIST and end <= self.max_num_blocks_per_req:
                limit = self._block_id_limit
                for block in block_ids:
                    if type(block) is not int or not 0 <= block < limit:
                        break
                else:
                    cell = row_idx * self.max_num_blocks_per_req + start
                    table, bases = self._table_mv, self._bases_mv
                    if bases is None:
                        for block in block_ids:
                            table[cell] = block
                            cell += 1
                    else:
                        block_size, step = self.block_size, self._bias_step
                        bias = start * step
                        for block in block_ids:
                            table[cell] = block
                            bases[cell] = block * block_size - bias
                            cell += 1
                            bias += step
                    self._counts_mv[row_idx] = end
                    if end > self._row_extent[row_idx]:
                        self._row_extent[row_idx] = end
                    logged = self._logged_cells
                    if logged + num_ids <= self._cell_log_capacity:
                        log = self._cell_log_mv
                        for logged_cell in range(cell - num_ids, cell):
                            log[logged] = logged_cell
                            logged += 1
                        self._logged_cells = logged
                    elif not self._dirty_mv[row_idx]:
                        self._dirty_mv[row_idx] = 1
                        self._dirty_from_mv[row_idx] = start
                        self._dirty_to_mv[row_idx] = end
                        self._num_dirty += 1
                    return
        self._apply_append(*self._prepare_append(block_ids, row_idx))

    def _prepare_append(
        self, block_ids: Sequence[int] | np.ndarray, row_idx: int
    ) -> tuple[int, Sequence[int] | np.ndarray]:
        row = self._check_row(row_idx)
        kernel_ids = self._kernel_ids(block_ids)
        if len(kernel_ids):
            self._check_capacity(row, self._counts_mv[row] + len(kernel_ids))
        return row, kernel_ids

    def _apply_append(self, row: int, kernel_ids: Sequence[int] | np.ndarray) -> None:
        if len(kernel_ids):
            start = self._counts_mv[row]
            self._write(row, start, kernel_ids)
            self._counts_mv[row] = start + len(kernel_ids)

    def add_row(self, block_ids: Sequence[int] | np.ndarray, row_idx: int) -> None:
        """Row ``row_idx`` becomes ``block_ids`` (entries past them are left as they were)."""
        self._apply_add(*self._prepare_add(block_ids, row_idx))

    def _prepare_add(
        self, block_ids: Sequence[int] | np.ndarray, row_idx: int
    ) -> tuple[int, Sequence[int] | np.ndarray]:
        row = self._check_row(row_idx)
        kernel_ids = self._kernel_ids(block_ids)
        self._check_capacity(row, len(kernel_ids))
        return row, kernel_ids

    def _apply_add(self, row: int, kernel_ids: Sequence[int] | np.ndarray) -> None:
        if len(kernel_ids):
            self._write(row, 0, kernel_ids)
        self._set_count(row, len(kernel_ids))

    def move_row(self, src: int, tgt: int) -> None:
        """Row ``tgt`` becomes a copy of row ``src``; ``src`` keeps its blocks (0.13)."""
        src_row, tgt_row = self._check_row(src), self._check_row(tgt)
        num_blocks = self._counts_mv[src_row]
        if num_blocks:
            self._copy_columns([tgt_row], [src_row], num_blocks)
            self._mark_written(tgt_row, 0, num_blocks)
        self._set_count(tgt_row, num_blocks)

    def swap_row(self, src: int, tgt: int) -> None:
        """Rows ``src`` and ``tgt`` trade places (stale entries included)."""
        src_row, tgt_row = self._check_row(src), self._check_row(tgt)
        if src_row == tgt_row:
            return
        extent = self._row_extent
        width = max(extent[src_row], extent[tgt_row])
        if width:
            self._copy_columns([src_row, tgt_row], [tgt_row, src_row], width)
            self._mark_written(src_row, 0, width)
            self._mark_written(tgt_row, 0, width)
        extent[src_row], extent[tgt_row] = extent[tgt_row], extent[src_row]
        src_count, tgt_count = self._counts_mv[src_row], self._counts_mv[tgt_row]
        self._set_count(src_row, tgt_count)
        self._set_count(tgt_row, src_count)

    def clear_row(self, row_idx: int) -> None:
        """Row ``row_idx`` becomes empty (its valid entries are zeroed)."""
        row = self._check_row(row_idx)
        num_blocks = self._counts_mv[row]
        if num_blocks:
            self._write(row, 0, np.zeros(num_blocks, dtype=np.int32))
        self._set_count(row, 0)

    def clear(self) -> None:
        """Zero the table on both sides; the counts are kept (vLLM 0.13)."""
        self.block_table.gpu.fill_(0)
        self.block_table.cpu.fill_(0)
        if self._slot_bases is not None:
            self._slot_bases.reshape(self.max_num_reqs, -1)[:] = -self._column_bias
            self._bases_stale = False
            self._fast_slots = self._cp_world_size == 1
        self._row_extent = [0] * self.max_num_reqs
        self._row_dirty[:] = False
        self._num_dirty = 0
        self._logged_cells = 0

    @staticmethod
    def map_to_kernel_blocks(
        kv_manager_block_ids: np.ndarray,
        blocks_per_kv_block: int,
        kernel_block_arange: np.ndarray,
    ) -> np.ndarray:
        """Manager block ids to kernel block ids: ``b`` becomes ``b*k .. b*k + k - 1``
        (``kernel_block_arange`` is ``np.arange(k).reshape(1, -1)``)."""
        factor = _positive("blocks_per_kv_block", blocks_per_kv_block)
        if not isinstance(kv_manager_block_ids, np.ndarray):
            raise BlockIdError(
                f"kv_manager_block_ids must be a numpy array, got "
                f"{type(kv_manager_block_ids).__name__} {_describe(kv_manager_block_ids)}")
        ids = _integer_array(kv_manager_block_ids, "kv_manager_block_ids", BlockIdError)
        if ids.size:
            _check_below(ids, INT32_LIMIT // factor, BlockIdError, "kv_manager_block_ids")
        arange = kernel_block_arange
        if not (isinstance(arange, np.ndarray) and arange.shape == (1, factor)
                and np.array_equal(arange, np.arange(factor).reshape(1, -1))):
            raise BlockTableConfigError(
                f"kernel_block_arange must be np.arange({factor}).reshape(1, -1), got "
                f"{_describe(arange)} of shape {getattr(arange, 'shape', None)}")
        return _expand_kernel_blocks(ids, factor, arange)

    # --- slot mapping ---------------------------------------------------------------------

    def compute_slot_mapping(self, req_indices: Any, positions: Any) -> None:
        """Slots of a batch: token ``t`` is position ``positions[t]`` of row
        ``req_indices[t]``; every later entry of the buffer becomes the pad slot."""
        bases = self._slot_bases
        if (
            self._fast_slots and bases is not None and type(positions) is np.ndarray
            and type(req_indices) is np.ndarray and positions.dtype is _INT64
            and req_indices.dtype is _INT64
        ):
            # The model runner's case, inlined: int64 arrays, no context parallelism.
            shape = positions.shape
            num_tokens = shape[0] if len(shape) == 1 else 0
            if req_indices.shape == shape and 0 < num_tokens <= self.max_num_batched_tokens:
                rows_unsigned = req_indices.view(_UINT64)
                positions_unsigned = positions.view(_UINT64)
                if (
                    rows_unsigned.item(rows_unsigned.argmax()) < self.max_num_reqs
                    and positions_unsigned.item(positions_unsigned.argmax())
                    < self._position_limit
                ):
                    if num_tokens != self._views_tokens:
                        self._cut_views(num_tokens)
                    _slots_standard(
                        bases, self._row_stride, self._block_shift, self._block_size_0d,
                        req_indices, positions, *self._views,
                    )
                    if num_tokens < self._cpu_slot_extent:
                        _pad_tail(self.slot_mapping.np, num_tokens, self._cpu_slot_extent)
                    self._cpu_slot_extent = num_tokens
                    self._slots_on_device = False
                    return
        self._compute_prepared(*self._prepare_batch(req_indices, positions))

    def _cut_views(self, num_tokens: int) -> None:
        self._views = (
            self._block_index[:num_tokens], self._flat_index[:num_tokens],
            self.slot_mapping.np[:num_tokens],
        )
        self._views_tokens = num_tokens

    def _prepare_batch(self, req_indices: Any, positions: Any) -> tuple[Any, Any, int]:
        """The batch as this table's slot mapping takes it, checked (nothing changes)."""
        if self._backend != "numpy":
            device = self.block_table.gpu.device
            if (
                isinstance(req_indices, torch.Tensor) and isinstance(positions, torch.Tensor)
                and req_indices.device == device and positions.device == device
            ):
                # Already on the device: not checked against the table here (that would
                # cost a sync); tokens outside the table get the pad slot. Their dtypes and
                # shapes are known on the host.
                if (
                    req_indices.dtype not in TORCH_INTEGER_DTYPES
                    or positions.dtype not in TORCH_INTEGER_DTYPES
                ):
                    raise TokenBatchError(
                        f"req_indices of {req_indices.dtype} and positions of "
                        f"{positions.dtype}: a batch holds integers"
                    )
                if (
                    req_indices.dim() != 1 or positions.dim() != 1
                    or req_indices.shape[0] != positions.shape[0]
                    or positions.shape[0] > self.max_num_batched_tokens
                ):
                    raise TokenBatchError(
                        f"req_indices of shape {tuple(req_indices.shape)} and positions of "
                        f"shape {tuple(positions.shape)} do not make a batch of at most "
                        f"{self.max_num_batched_tokens} tokens"
                    )
                return req_indices, positions, int(positions.shape[0])
        rows = _integer_array(req_indices, "req_indices", TokenBatchError)
        token_positions = _integer_array(positions, "positions", TokenBatchError)
        num_tokens = token_positions.shape[0]
        if rows.shape[0] != num_tokens:
            raise TokenBatchError(
                f"req_indices has {rows.shape[0]} entries but positions has {num_tokens}"
            )
        if num_tokens > self.max_num_batched_tokens:
            raise TokenBatchError(
                f"{num_tokens} tokens do not fit max_num_batched_tokens="
                f"{self.max_num_batched_tokens}"
            )
        if num_tokens:
            _check_below(rows, self.max_num_reqs, RowIndexError, "req_indices")
            _check_below(token_positions, self._position_limit, PositionError, "positions")
        return rows, token_positions, num_tokens

    def _compute_prepared(self, rows: Any, token_positions: Any, num_tokens: int) -> None:
        if self._backend != "numpy":
            self._compute_on_device(rows, token_positions, num_tokens)
            return
        bases = self._slot_bases
        if num_tokens and bases is not None:
            if self._bases_stale:
                self._refresh_slot_bases(bases)
            if num_tokens != self._views_tokens:
                self._cut_views(num_tokens)
            if self._cp_world_size == 1:
                _slots_standard(
                    bases, self._row_stride, self._block_shift, self._block_size_0d, rows,
                    token_positions, *self._views,
                )
            else:
                _slots_context_parallel(
                    bases, self._offset_table, self._row_stride, self._virtual_block_size_0d,
                    rows, token_positions, *self._views,
                )
        if num_tokens < self._cpu_slot_extent:
            _pad_tail(self.slot_mapping.np, num_tokens, self._cpu_slot_extent)
        self._cpu_slot_extent = num_tokens
        self._slots_on_device = False

    def _compute_on_device(self, rows: Any, token_positions: Any, num_tokens: int) -> None:
        if isinstance(rows, np.ndarray):
            rows, token_positions = self._stage_on_device(rows, token_positions)
        self._commit_rows(self.max_num_reqs)  # the device computation reads the device table
        compute = (
            slot_mapping_triton.slot_mapping_triton if self._backend == "triton"
            else slot_mapping_triton.slot_mapping_torch
        )
        compute(
            self.block_table.gpu, rows, token_positions, self.slot_mapping.gpu, num_tokens,
            self.block_size, self._cp_world_size, self._cp_rank,
            self.cp_kv_cache_interleave_size, PAD_SLOT_ID,
        )
        self._gpu_slot_extent = num_tokens
        self._slots_on_device = True

    def _stage_on_device(
        self, rows: np.ndarray, token_positions: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._device_req_indices is None or self._device_positions is None:
            self._device_req_indices = CpuGpuBuffer(
                self.max_num_batched_tokens, dtype=torch.int64, device=self.device,
                pin_memory=self.pin_memory,
            )
            self._device_positions = CpuGpuBuffer(
                self.max_num_batched_tokens, dtype=torch.int64, device=self.device,
                pin_memory=self.pin_memory,
            )
        num_tokens = token_positions.shape[0]
        np.copyto(self._device_req_indices.np[:num_tokens], rows, casting="unsafe")
        np.copyto(self._device_positions.np[:num_tokens], token_positions, casting="unsafe")
        return (
            self._device_req_indices.copy_to_gpu(num_tokens),
            self._device_positions.copy_to_gpu(num_tokens),
        )

    # --- publishing -----------------------------------------------------------------------

    def _commit_rows(self, num_reqs: int) -> None:
        """Copy the dirty cells of rows ``[0, num_reqs)`` to the device."""
        if self._logged_cells:
            self._commit_logged_cells(num_reqs)
        if not self._num_dirty:
            return
        rows = np.flatnonzero(self._row_dirty[:num_reqs])
        if not rows.size:
            return
        first = self._dirty_from.take(rows)
        end = self._dirty_to.take(rows)
        np.maximum(end, self.num_blocks_per_row.take(rows), out=end)
        span = int((end - first).max())
        first_row, end_row = int(rows[0]), int(rows[-1]) + 1
        if _RECTANGLE_ADVANTAGE * rows.size * span < (end_row - first_row) * (
            self.max_num_blocks_per_req
        ):
            # One window of `span` columns per dirty row, from its first dirty column; the
            # clean cells a window also covers hold the same value on both sides.
            columns = first[:, None] + self._column_arange[:span]
            np.minimum(columns, self.max_num_blocks_per_req - 1, out=columns)
            columns += (rows * self.max_num_blocks_per_req)[:, None]
            self._copy_cells(columns.reshape(-1))
        else:
            first_col, end_col = int(first.min()), int(end.max())
            self.block_table.gpu[first_row:end_row, first_col:end_col].copy_(
                self.block_table.cpu[first_row:end_row, first_col:end_col], non_blocking=True
            )
        self._row_dirty[rows] = False
        self._num_dirty -= int(rows.size)

    def _commit_logged_cells(self, num_reqs: int) -> None:
        cells = self._cell_log[: self._logged_cells]
        if num_reqs == self.max_num_reqs:
            self._copy_cells(cells)
            self._logged_cells = 0
            return
        published = cells < num_reqs * self.max_num_blocks_per_req
        self._copy_cells(cells[published])
        kept = cells[~published]
        self._cell_log[: kept.size] = kept
        self._logged_cells = int(kept.size)

    def _copy_cells(self, cells: np.ndarray) -> None:
        """``gpu.flat[cells] = cpu.flat[cells]``."""
        if self._gpu_flat is not None:
            self._gpu_flat.put(cells, self._table_flat.take(cells))
            return
        gpu = self.block_table.gpu
        index = torch.from_numpy(cells)
        values = self.block_table.cpu.reshape(-1)[index]
        gpu.reshape(-1).index_copy_(
            0, index.to(gpu.device, non_blocking=True), values.to(gpu.device, non_blocking=True)
        )

    def commit_block_table(self, num_reqs: int) -> None:
        """Publish rows ``[0, num_reqs)`` to the device (only the cells written since the
        last commit are copied)."""
        if type(num_reqs) is not int or not 0 <= num_reqs <= self.max_num_reqs:
            num_reqs = _count(num_reqs, self.max_num_reqs, RowIndexError, "num_reqs")
        self._commit_rows(num_reqs)

    def commit_slot_mapping(self, num_tokens: int) -> None:
        """Publish the first ``num_tokens`` slots; device entries past the batch are
        padded too."""
        if type(num_tokens) is not int or not 0 <= num_tokens <= self.max_num_batched_tokens:
            num_tokens = _count(
                num_tokens, self.max_num_batched_tokens, TokenBatchError, "num_tokens")
        if self._slots_on_device:
            return
        end = max(num_tokens, self._gpu_slot_extent)
        if end:
            self.slot_mapping.copy_to_gpu(end)
        self._gpu_slot_extent = min(end, self._cpu_slot_extent)

    def get_device_tensor(self, num_reqs: int) -> torch.Tensor:
        """The device table's first ``num_reqs`` rows."""
        if type(num_reqs) is not int or not 0 <= num_reqs <= self.max_num_reqs:
            num_reqs = _count(num_reqs, self.max_num_reqs, RowIndexError, "num_reqs")
        return self.block_table.gpu[:num_reqs]

    def get_cpu_tensor(self) -> torch.Tensor:
        """The host table (writes to it made later must be followed by ``mark_dirty()``)."""
        self.mark_dirty()
        return self.block_table.cpu

    def get_numpy_array(self) -> np.ndarray:
        """The host table as numpy (writes to it made later must be followed by
        ``mark_dirty()``)."""
        self.mark_dirty()
        return self._table_np


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _size_list(name: str, values: object) -> list[Any]:
    """One size per KV-cache group (each checked by the group's ``BlockTable``)."""
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        raise BlockTableConfigError(f"{name}={_describe(values)} is not a list of sizes")
    return list(values)


class MultiGroupBlockTable:
    """One ``BlockTable`` per KV-cache group; every call fans out (vLLM 0.13 API).

    A call that one group refuses changes no group: all groups' checks run first (the groups
    share their rows and slot buffer sizes, so for a row or a count the first group's checks
    are every group's).
    """

    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        pin_memory: bool,
        device: torch.device | str,
        block_sizes: list[int],
        kernel_block_sizes: list[int],
        num_speculative_tokens: int = 0,
        cp_kv_cache_interleave_size: int = 1,
        *,
        max_num_blocks: list[int] | None = None,
        pcp_world_size: int | None = None,
        pcp_rank: int | None = None,
        dcp_world_size: int | None = None,
        dcp_rank: int | None = None,
        num_blocks: int | None = None,
        slot_mapping_backend: str = "auto",
    ) -> None:
        pcp_world_size, pcp_rank, dcp_world_size, dcp_rank = _context_parallel(
            pcp_world_size, pcp_rank, dcp_world_size, dcp_rank)
        block_sizes = _size_list("block_sizes", block_sizes)
        kernel_block_sizes = _size_list("kernel_block_sizes", kernel_block_sizes)
        if len(kernel_block_sizes) != len(block_sizes):
            raise BlockTableConfigError(
                f"{len(kernel_block_sizes)} kernel block sizes for {len(block_sizes)} groups"
            )
        if max_num_blocks is not None:
            max_num_blocks = _size_list("max_num_blocks", max_num_blocks)
            if len(max_num_blocks) != len(block_sizes):
                raise BlockTableConfigError(
                    f"{len(max_num_blocks)} max_num_blocks entries for {len(block_sizes)} groups"
                )
        max_model_len = _positive("max_model_len", max_model_len)
        speculative = as_int(num_speculative_tokens)
        if speculative is None or speculative < 0:
            raise BlockTableConfigError(
                f"num_speculative_tokens={num_speculative_tokens!r} must be a non-negative "
                f"integer"
            )
        cp_world_size = _positive("pcp_world_size", pcp_world_size) * _positive(
            "dcp_world_size", dcp_world_size
        )
        if max_num_blocks is None:
            max_num_blocks = [
                max(_cdiv(max_model_len, _positive("block_size", size) * cp_world_size),
                    1 + speculative)
                for size in block_sizes
            ]
        self.block_tables: list[BlockTable] = []
        for group, (size, kernel_size, width) in enumerate(
            zip(block_sizes, kernel_block_sizes, max_num_blocks, strict=True)
        ):
            try:
                table = BlockTable(
                    size, max_num_reqs, width, max_num_batched_tokens, pin_memory, device,
                    kernel_size, cp_kv_cache_interleave_size, pcp_world_size=pcp_world_size,
                    pcp_rank=pcp_rank, dcp_world_size=dcp_world_size, dcp_rank=dcp_rank,
                    num_blocks=num_blocks, slot_mapping_backend=slot_mapping_backend,
                )
            except BlockTableConfigError as error:
                raise BlockTableConfigError(
                    f"KV-cache group {group} (block_size={size}, kernel_block_size="
                    f"{kernel_size}, {width!r} blocks a request for max_model_len="
                    f"{max_model_len} and num_speculative_tokens={speculative}): {error}"
                ) from error
            self.block_tables.append(table)

    def _per_group(self, block_ids: Sequence[Sequence[int]]) -> Sequence[Sequence[int]]:
        if type(block_ids) is not tuple and type(block_ids) is not list and (
            isinstance(block_ids, str | bytes) or not isinstance(block_ids, Sequence)
        ):
            raise BlockIdError(
                f"block_ids must be a sequence of one block id list per group, got "
                f"{_describe(block_ids)}"
            )
        if len(block_ids) != len(self.block_tables):
            raise BlockIdError(
                f"{len(block_ids)} block id lists for {len(self.block_tables)} groups"
            )
        return block_ids

    def append_row(self, block_ids: Sequence[Sequence[int]], row_idx: int) -> None:
        groups = self._per_group(block_ids)
        plans = [
            table._prepare_append(ids, row_idx)
            for table, ids in zip(self.block_tables, groups, strict=True)
        ]
        for table, plan in zip(self.block_tables, plans, strict=True):
            table._apply_append(*plan)

    def add_row(self, block_ids: Sequence[Sequence[int]], row_idx: int) -> None:
        groups = self._per_group(block_ids)
        plans = [
            table._prepare_add(ids, row_idx)
            for table, ids in zip(self.block_tables, groups, strict=True)
        ]
        for table, plan in zip(self.block_tables, plans, strict=True):
            table._apply_add(*plan)

    def move_row(self, src: int, tgt: int) -> None:
        for table in self.block_tables:
            table.move_row(src, tgt)

    def swap_row(self, src: int, tgt: int) -> None:
        for table in self.block_tables:
            table.swap_row(src, tgt)

    def clear_row(self, row_idx: int) -> None:
        for table in self.block_tables:
            table.clear_row(row_idx)

    def compute_slot_mapping(self, req_indices: Any, positions: Any) -> None:
        prepared = [table._prepare_batch(req_indices, positions) for table in self.block_tables]
        for table, batch in zip(self.block_tables, prepared, strict=True):
            table._compute_prepared(*batch)

    def commit_block_table(self, num_reqs: int) -> None:
        for table in self.block_tables:
            table.commit_block_table(num_reqs)

    def commit_slot_mapping(self, num_tokens: int) -> None:
        for table in self.block_tables:
            table.commit_slot_mapping(num_tokens)

    def clear(self) -> None:
        for table in self.block_tables:
            table.clear()

    def __getitem__(self, idx: int) -> BlockTable:
        if type(idx) is int and 0 <= idx < len(self.block_tables):
            return self.block_tables[idx]
        return self.block_tables[_index(idx, len(self.block_tables), GroupIndexError,
                                        "KV-cache group")]

    def __len__(self) -> int:
        return len(self.block_tables)
