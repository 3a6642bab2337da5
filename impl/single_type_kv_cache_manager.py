"""One manager per attention type: the block lists of every request in one KV-cache group.

vLLM 0.13's ``single_type_kv_cache_manager`` API (spec: spec/manager.py, the pure rules in
spec/attention_rules.py). Differences from vLLM, all in the direction of refusing bad input
before anything changes:

* reading a request's blocks never creates an entry for it (vLLM's ``defaultdict`` does, even
  when the allocation then fails); ``req_to_blocks`` is still a ``defaultdict(list)``;
* ``skipped_blocks_to_free`` lets the coordinator count, before anything changes, the blocks
  that freeing out-of-window blocks would return to the pool;
* ``SinkFullAttentionManager`` takes its shared sink blocks with ``get_new_blocks`` (they stay
  referenced for the manager's life) instead of popping them off the free queue;
* errors are impl/errors.py's typed exceptions, never bare assertions.

Every public method checks its arguments (a request id that is not a str, a count that is not
an int in range, blocks that are not this pool's or not in the state the call needs, more tokens
than the request's blocks hold) and raises ``InvalidManagerArgument`` before anything changes,
in one block at its top (impl/checks.py's helpers and the block checks below). Checked once
(docs/architecture.md): where the checks read the manager's state or scan a list, the work
after them is the method's twin, named with an ``_unchecked`` suffix
(``allocate_new_blocks_unchecked`` for ``allocate_new_blocks``, ...), which subclasses
override; the coordinators check once for all groups, before any group changes, then run
the twins. ``free`` and ``get_num_common_prefix_blocks`` check only that the request id is a
str and have no twin (a checked id costs them one type comparison).
``num_slots_held_unchecked`` is the query the coordinators' checks read.

The module-level functions with the names of spec/attention_rules.py are the same rules on the
same inputs; the managers run them over a lazily evaluated hit pattern, so each block hash is
looked up at most once and only as far as the rule reads.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from operator import attrgetter
from typing import Any, ClassVar, Protocol, SupportsIndex, cast, overload

from kvspec.impl.block_pool import BlockPool
from kvspec.impl.checks import (
    MAX_NUM_TOKENS as MAX_NUM_TOKENS,
    MAX_WORLD_SIZE as MAX_WORLD_SIZE,
    Flag,
    Text,
    block_hashes_of as block_hashes_of,
    check_count as check_count,
    check_flag as check_flag,
    check_request_id as check_request_id,
    check_world_sizes as check_world_sizes,
    request_id_of as request_id_of,
)
from kvspec.impl.errors import (
    InvalidKVCacheConfig as InvalidKVCacheConfig,
    InvalidManagerArgument as InvalidManagerArgument,
    KVCacheManagerError as KVCacheManagerError,
    PrefixCachingNotSupported as PrefixCachingNotSupported,
    UnsupportedKVCacheSpec as UnsupportedKVCacheSpec,
)
from kvspec.impl.hashing import BlockHash, BlockHashListWithBlockSize
from kvspec.impl.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    KVCacheSpecLike,
    MambaSpec,
    MLAAttentionSpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
    as_kv_cache_spec,
    spec_kind,
)
from kvspec.impl.kv_cache_utils import KVCacheBlock
from kvspec.impl.request import RequestLike

BlockHashList = list[BlockHash] | BlockHashListWithBlockSize

__all__ = [
    "MAX_NUM_TOKENS",
    "MAX_WORLD_SIZE",
    "ChunkedLocalAttentionManager",
    "CrossAttentionManager",
    "FullAttentionManager",
    "InvalidKVCacheConfig",
    "InvalidManagerArgument",
    "KVCacheManagerError",
    "MambaManager",
    "PrefixCachingNotSupported",
    "SingleTypeKVCacheManager",
    "SinkFullAttentionManager",
    "SlidingWindowManager",
    "UnsupportedKVCacheSpec",
    "blocks_needed",
    "cdiv",
    "chunked_local_hit",
    "chunked_local_skipped_tokens",
    "full_attention_hit_blocks",
    "get_manager_for_kv_cache_spec",
    "mamba_hit_blocks",
    "mamba_skipped_tokens",
    "num_blocks_to_allocate",
    "skipped_blocks",
    "sliding_window_blocks_for_hit",
    "sliding_window_hit",
    "sliding_window_skipped_tokens",
    "spec_manager_map",
]


# --------------------------------------------------------------------------- argument checks

_MAX_GROUP_ID = 2**32 - 1

_ref_cnt_of = attrgetter("ref_cnt")


def check_block_list(blocks: object, what: str) -> Sequence[KVCacheBlock]:
    """``blocks`` if it is a list or tuple of ``KVCacheBlock`` (one type check in C)."""
    if type(blocks) is not list and type(blocks) is not tuple:
        raise InvalidManagerArgument(f"{what} must be a list of KVCacheBlock, got {blocks!r}")
    if blocks and not set(map(type, blocks)) <= {KVCacheBlock}:
        stranger = next(b for b in blocks if type(b) is not KVCacheBlock)
        raise InvalidManagerArgument(f"{what} holds {stranger!r}, not a KVCacheBlock")
    return blocks


def check_block_hashes(block_hashes: object) -> BlockHashList:
    """``block_hashes`` if it is a list of bytes, or a ``BlockHashListWithBlockSize`` over
    one."""
    fine = (block_hashes.block_hashes if isinstance(block_hashes, BlockHashListWithBlockSize)
            else block_hashes)
    if type(fine) is not list:
        raise InvalidManagerArgument(f"block_hashes must be a list of bytes, got {block_hashes!r}")
    if list(map(type, fine)).count(bytes) != len(fine):
        bad = next(h for h in fine if type(h) is not bytes)
        raise InvalidManagerArgument(f"block hash must be bytes, got {bad!r}")
    return block_hashes  # type: ignore[return-value]


def check_group_ids(group_ids: object) -> list[int]:
    if (type(group_ids) is not list and type(group_ids) is not tuple) or not group_ids:
        raise InvalidManagerArgument(
            f"kv_cache_group_ids must be a non-empty list of group ids, got {group_ids!r}")
    return [check_count("a KV-cache group id", group_id, _MAX_GROUP_ID) for group_id in group_ids]


def check_block_pool(block_pool: object, error: type[ValueError] = InvalidManagerArgument
                     ) -> BlockPool:
    if not isinstance(block_pool, BlockPool):
        raise error(f"block_pool must be a BlockPool, got {block_pool!r}")
    return block_pool


# --------------------------------------------------------------------------- pure rules


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


def num_blocks_to_allocate(
    num_tokens: int,
    block_size: int,
    num_new_computed_blocks: int,
    num_held_blocks: int,
    num_evictable_computed_blocks: int,
) -> int:
    """New blocks one group needs for ``num_tokens`` tokens (free hits cost a block too)."""
    return (
        -(-num_tokens // block_size)
        - num_new_computed_blocks
        - num_held_blocks
        + num_evictable_computed_blocks
    )


def sliding_window_skipped_tokens(num_computed_tokens: int, sliding_window: int) -> int:
    return num_computed_tokens - sliding_window + 1


def chunked_local_skipped_tokens(num_computed_tokens: int, attention_chunk_size: int) -> int:
    return num_computed_tokens // attention_chunk_size * attention_chunk_size


def mamba_skipped_tokens(num_computed_tokens: int) -> int:
    return num_computed_tokens - 1


def skipped_blocks(num_skipped_tokens: int, block_size: int) -> int:
    """Leading blocks made entirely of skipped tokens."""
    return num_skipped_tokens // block_size if num_skipped_tokens > 0 else 0


def sliding_window_blocks_for_hit(sliding_window: int, block_size: int, use_eagle: bool) -> int:
    return -(-(sliding_window - 1) // block_size) + (1 if use_eagle else 0)


def _trim_full_hit(num_blocks: int, block_size: int, alignment_tokens: int, use_eagle: bool) -> int:
    if use_eagle and num_blocks > 0:
        num_blocks -= 1
    while num_blocks * block_size % alignment_tokens:
        num_blocks -= 1
    return num_blocks


def full_attention_hit_blocks(
    hits: Sequence[bool],
    max_length: int,
    block_size: int,
    alignment_tokens: int,
    use_eagle: bool,
) -> int:
    """The leading run of hits within ``max_length`` tokens, EAGLE- and alignment-trimmed."""
    max_blocks = max_length // block_size
    num_blocks = 0
    while num_blocks < max_blocks and hits[num_blocks]:
        num_blocks += 1
    return _trim_full_hit(num_blocks, block_size, alignment_tokens, use_eagle)


def sliding_window_hit(
    hits: Sequence[bool],
    max_length: int,
    block_size: int,
    sliding_window: int,
    alignment_tokens: int,
    use_eagle: bool,
) -> tuple[int, int]:
    """``(first, end)``: null blocks before ``first``, cached hits in ``[first, end)``."""
    need = sliding_window_blocks_for_hit(sliding_window, block_size, use_eagle)
    unaligned = block_size != alignment_tokens
    run = 0
    for i in range(max_length // block_size - 1, -1, -1):
        if not hits[i]:
            run = 0
        elif run == 0 and unaligned and (i + 1) * block_size % alignment_tokens:
            continue
        else:
            run += 1
            if run >= need:
                end = i + run
                if use_eagle:
                    end -= 1
                return min(i, end), end
    end = run
    while end * block_size % alignment_tokens:
        end -= 1
    if use_eagle and end > 0:
        end -= 1
    return 0, end


def chunked_local_hit(
    hits: Sequence[bool],
    max_length: int,
    block_size: int,
    attention_chunk_size: int,
) -> tuple[int, int]:
    """``(first, end)``: null blocks before the current chunk, then the run of hits."""
    max_blocks = max_length // block_size
    first = max_length // attention_chunk_size * attention_chunk_size // block_size
    end = first
    while end < max_blocks and hits[end]:
        end += 1
    return first, end


def mamba_hit_blocks(
    hits: Sequence[bool],
    max_length: int,
    block_size: int,
    alignment_tokens: int,
) -> int:
    """The last aligned hit (null blocks before it), as a block count; 0 if none."""
    unaligned = block_size != alignment_tokens
    for i in range(max_length // block_size - 1, -1, -1):
        if hits[i] and not (unaligned and (i + 1) * block_size % alignment_tokens):
            return i + 1
    return 0


class _HitPattern(Sequence[bool]):
    """Whether block i's hash is cached in every group, looked up on first read."""

    __slots__ = ("_block_hashes", "_block_pool", "_group_ids", "found")

    def __init__(
        self, block_hashes: BlockHashList, block_pool: BlockPool, group_ids: list[int]
    ) -> None:
        # Read untyped: the pool refuses a hash that is not bytes, typed and named, where
        # the compiled build would check each element's type with a bare TypeError.
        self._block_hashes: Any = block_hashes
        self._block_pool = block_pool
        self._group_ids = group_ids
        self.found: dict[int, list[KVCacheBlock] | None] = {}

    def __len__(self) -> int:
        return len(self._block_hashes)

    @overload
    def __getitem__(self, index: int) -> bool: ...

    @overload
    def __getitem__(self, index: slice) -> list[bool]: ...

    def __getitem__(self, index: int | slice) -> bool | list[bool]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        found = self.found
        if index in found:
            return found[index] is not None
        blocks = self._block_pool.get_cached_block(self._block_hashes[index], self._group_ids)
        found[index] = blocks
        return blocks is not None

    def blocks(self, first: int, end: int, num_groups: int, null: KVCacheBlock) -> tuple[
        list[KVCacheBlock], ...
    ]:
        """Per group: ``first`` null blocks, then the hits of ``[first, end)``."""
        found = self.found
        hit_rows = [found[i] for i in range(first, end)]
        return tuple(
            [null] * first + [row[g] for row in hit_rows]  # type: ignore[index]
            for g in range(num_groups)
        )


def _max_length_within(block_hashes: BlockHashList, max_length: int, block_size: int) -> int:
    return min(max_length, len(block_hashes) * block_size)


# --------------------------------------------------------------------------- managers


class BlockPoolLike(Protocol):
    """The annotation of a ``block_pool`` parameter: impl's ``BlockPool`` (the check block
    refuses anything else, typed; mypyc, which would refuse it with a bare ``TypeError`` at
    the call for a ``BlockPool`` annotation, does not check a Protocol)."""

    @property
    def num_gpu_blocks(self) -> int: ...

    def get_num_free_blocks(self) -> int: ...


def _is_block_of(pool: BlockPool, block: KVCacheBlock) -> bool:
    """Whether ``block`` is the pool's own block object of its id (not another pool's, not
    one made outside a pool)."""
    block_id = block.block_id
    return 0 <= block_id < pool.num_gpu_blocks and pool.blocks[block_id] is block


class SingleTypeKVCacheManager:
    """The blocks of every request in one KV-cache group, for one attention type.

    Not an ``abc.ABC`` (vLLM's is): compiled by mypyc, every subclass of ``ABC`` shares
    ``abc.ABC``'s own instance-check cache, so once any of them had been checked,
    ``isinstance(full_attention_manager, CrossAttentionManager)`` answered True. The abstract
    methods raise ``NotImplementedError``.

    Each public method checks its arguments in one block at its top; where the checks read
    state or scan a list it then runs its ``..._unchecked`` twin, which subclasses override
    (the coordinators call the twins, having checked for every group).
    """

    # Whether get_num_skipped_tokens can be positive (blocks slide out of the window).
    skips_blocks: ClassVar[bool] = False
    # The spec type this manager requires (None: any), and, for attention types that do
    # not support context parallelism, their name for the error message.
    served_spec: ClassVar[type[KVCacheSpec] | None] = None
    no_context_parallel: ClassVar[str] = ""

    @classmethod
    def _check_serves(
        cls, kv_cache_spec: KVCacheSpec, dcp_world_size: int, pcp_world_size: int
    ) -> None:
        """Refuse a spec of another type, or context parallelism where it is unsupported."""
        if cls.served_spec is not None and not isinstance(kv_cache_spec, cls.served_spec):
            raise InvalidKVCacheConfig(f"{cls.__name__} cannot serve {kv_cache_spec!r}")
        if cls.no_context_parallel:
            _require_no_context_parallel(cls.no_context_parallel, dcp_world_size,
                                         pcp_world_size)

    def __init__(
        self,
        kv_cache_spec: KVCacheSpecLike,
        block_pool: BlockPoolLike,
        kv_cache_group_id: SupportsIndex,
        dcp_world_size: SupportsIndex = 1,
        pcp_world_size: SupportsIndex = 1,
    ) -> None:
        spec = as_kv_cache_spec(kv_cache_spec)
        pool = check_block_pool(block_pool, InvalidKVCacheConfig)
        group_id = check_count("kv_cache_group_id", kv_cache_group_id, _MAX_GROUP_ID,
                               error=InvalidKVCacheConfig)
        dcp, pcp = check_world_sizes(dcp_world_size, pcp_world_size)
        self._check_serves(spec, dcp, pcp)
        # The caller's spec as given (vLLM's own, in vLLM); impl computes with its equal spec.
        self.kv_cache_spec = kv_cache_spec
        self.spec: KVCacheSpec = spec
        self.block_pool: BlockPool = pool
        self.kv_cache_group_id: int = group_id
        self.dcp_world_size: int = dcp
        self.pcp_world_size: int = pcp
        self.block_size: int = spec.block_size * dcp * pcp
        self.req_to_blocks: defaultdict[str, list[KVCacheBlock]] = defaultdict(list)
        self.num_cached_block: dict[str, int] = {}
        self._null_block = pool.null_block

    # -- checks --------------------------------------------------------------------------

    def num_slots_held_unchecked(self, request_id: str) -> int:
        """Tokens the request's blocks in this group have room for (0 if it holds none)."""
        blocks = self.req_to_blocks.get(request_id)
        return len(blocks) * self.block_size if blocks else 0

    def _check_within_slots(self, request_id: str, name: str, num_tokens: object) -> int:
        """``num_tokens`` if it is a count of tokens the request's blocks hold."""
        count = check_count(name, num_tokens)
        if count > self.num_slots_held_unchecked(request_id):
            raise InvalidManagerArgument(
                f"{name}={count} is more than the {self.num_slots_held_unchecked(request_id)} "
                f"tokens the blocks of request {request_id!r} hold in KV-cache group "
                f"{self.kv_cache_group_id}")
        return count

    def check_hits(self, request_id: Text, new_computed_blocks: Sequence[KVCacheBlock]
                   ) -> Sequence[KVCacheBlock]:
        """``new_computed_blocks`` if they are cache hits the request may take: it holds no
        blocks, and they are blocks of this pool, each listed once and already touched (in
        use), null blocks only before the real ones and only where blocks slide out of the
        window."""
        checked_id = check_request_id(request_id)
        hits = check_block_list(new_computed_blocks, "new_computed_blocks")
        if not hits:
            return hits
        if self.req_to_blocks.get(checked_id) or checked_id in self.num_cached_block:
            raise InvalidManagerArgument(
                f"request {checked_id!r} already holds blocks and cannot take "
                f"{len(hits)} cache hits")
        null = self._null_block
        num_null = hits.count(null)
        if num_null and (not self.skips_blocks or null in hits[num_null:]):
            raise InvalidManagerArgument(
                f"{type(self).__name__} takes null blocks only before the real hits, got "
                f"{[b.block_id for b in hits]}")
        real = hits[num_null:]
        pool = self.block_pool
        for block in real:
            if not _is_block_of(pool, block):
                raise InvalidManagerArgument(f"{block!r} is not a block of this pool")
        if 0 in map(_ref_cnt_of, real):
            free = next(b for b in real if b.ref_cnt == 0)
            raise InvalidManagerArgument(
                f"block {free.block_id} is free: cache hits are touched before they are saved")
        if len(set(real)) != len(real):
            raise InvalidManagerArgument(
                f"a block appears twice in the hits {[b.block_id for b in real]}")
        return hits

    # -- allocation ----------------------------------------------------------------------

    def get_num_blocks_to_allocate(
        self, request_id: Text, num_tokens: SupportsIndex,
        new_computed_blocks: Sequence[KVCacheBlock],
    ) -> int:
        """New blocks this group needs so that the request holds ``num_tokens`` tokens (a
        count: blocks made outside the pool are counted as hits, as vLLM's tests do)."""
        checked_id = check_request_id(request_id)
        count = check_count("num_tokens", num_tokens)
        hits = check_block_list(new_computed_blocks, "new_computed_blocks")
        return self.get_num_blocks_to_allocate_unchecked(checked_id, count, hits)

    def get_num_blocks_to_allocate_unchecked(
        self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        held = self.req_to_blocks.get(request_id)
        num_evictable = 0
        if new_computed_blocks:
            null = self._null_block
            num_evictable = sum(
                1 for b in new_computed_blocks if b.ref_cnt == 0 and b is not null
            )
        return (
            -(-num_tokens // self.block_size)
            - len(new_computed_blocks)
            - (len(held) if held else 0)
            + num_evictable
        )

    def save_new_computed_blocks(
        self, request_id: Text, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> None:
        """Attach a new request's cache hits (already touched) as its first blocks."""
        checked_id = check_request_id(request_id)
        hits = self.check_hits(checked_id, new_computed_blocks)
        self.save_new_computed_blocks_unchecked(checked_id, hits)

    def save_new_computed_blocks_unchecked(
        self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> None:
        if request_id not in self.num_cached_block and not self.req_to_blocks.get(request_id):
            self.req_to_blocks[request_id].extend(new_computed_blocks)
            self.num_cached_block[request_id] = len(new_computed_blocks)
        elif new_computed_blocks:
            raise InvalidManagerArgument(
                f"request {request_id!r} already holds blocks and cannot take "
                f"{len(new_computed_blocks)} cache hits"
            )

    def allocate_new_blocks(
        self, request_id: Text, num_tokens: SupportsIndex
    ) -> list[KVCacheBlock]:
        """Append the blocks needed to hold ``num_tokens`` tokens; return the new ones.
        More than the pool has free is refused before the request's list is touched."""
        checked_id = check_request_id(request_id)
        count = check_count("num_tokens", num_tokens)
        wanted = self.get_num_blocks_to_allocate_unchecked(checked_id, count, ())
        if wanted > self.block_pool.get_num_free_blocks():
            raise InvalidManagerArgument(
                f"num_tokens={count} needs {wanted} new blocks, the pool has "
                f"{self.block_pool.get_num_free_blocks()} free")
        return self.allocate_new_blocks_unchecked(checked_id, count)

    def allocate_new_blocks_unchecked(self, request_id: str, num_tokens: int
                                      ) -> list[KVCacheBlock]:
        req_blocks = self.req_to_blocks[request_id]
        num_new = -(-num_tokens // self.block_size) - len(req_blocks)
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new)
        req_blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: RequestLike, num_tokens: SupportsIndex) -> None:
        """Key the request's blocks that ``num_tokens`` tokens fill and are not keyed yet
        (the pool checks the request's hashes, token ids and LoRA before it keys any)."""
        request_id = request_id_of(request)
        block_hashes_of(request)
        count = self._check_within_slots(request_id, "num_tokens", num_tokens)
        self.cache_blocks_unchecked(request, count)

    def cache_blocks_unchecked(self, request: RequestLike, num_tokens: int) -> None:
        request_id = request.request_id
        num_full = num_tokens // self.block_size
        num_cached = self.num_cached_block.get(request_id, 0)
        if num_cached >= num_full:
            return
        self.block_pool.cache_full_blocks(
            request, self.req_to_blocks.get(request_id) or [], num_cached, num_full,
            self.block_size, self.kv_cache_group_id,
        )
        self.num_cached_block[request_id] = num_full

    def free(self, request_id: Text) -> None:
        """Release the request's blocks, last block first (so the chain tail is evicted first)."""
        checked_id = request_id if type(request_id) is str else check_request_id(request_id)
        blocks = self.req_to_blocks.pop(checked_id, None)
        if blocks:
            # A reversed copy: the caller may still hold this list (get_blocks returns it).
            self.block_pool.free_blocks(blocks[::-1])
        self.num_cached_block.pop(checked_id, None)

    # -- skipped (out-of-window) blocks --------------------------------------------------

    def get_num_skipped_tokens(self, num_computed_tokens: SupportsIndex) -> int:
        """Leading tokens no future token attends to (none by default)."""
        count = check_count("num_computed_tokens", num_computed_tokens)
        return self._num_skipped_tokens(count)

    def _num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return 0

    def skipped_blocks_to_free(
        self, request_id: Text, num_computed_tokens: SupportsIndex
    ) -> list[int]:
        """Indices of the request's blocks that ``remove_skipped_blocks`` would free, highest
        first (it stops at the first null block: everything before it is already null)."""
        checked_id = check_request_id(request_id)
        count = self._check_within_slots(checked_id, "num_computed_tokens", num_computed_tokens)
        return self._skipped_blocks_to_free(checked_id, count)

    def _skipped_blocks_to_free(self, request_id: str, num_computed_tokens: int) -> list[int]:
        if not self.skips_blocks:
            return []
        num_skipped = self._num_skipped_tokens(num_computed_tokens)
        if num_skipped <= 0:
            return []
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return []
        null = self._null_block
        indices = []
        for i in range(min(num_skipped // self.block_size, len(blocks)) - 1, -1, -1):
            if blocks[i] is null:
                break
            indices.append(i)
        return indices

    def remove_skipped_blocks(
        self, request_id: Text, num_computed_tokens: SupportsIndex
    ) -> None:
        """Replace out-of-window blocks by the null block and free them, highest index first.
        ``num_computed_tokens`` beyond the tokens the request's blocks hold is refused: no
        token was computed without a slot."""
        checked_id = check_request_id(request_id)
        count = self._check_within_slots(checked_id, "num_computed_tokens", num_computed_tokens)
        self.remove_skipped_blocks_unchecked(checked_id, count)

    def remove_skipped_blocks_unchecked(self, request_id: str, num_computed_tokens: int) -> None:
        indices = self._skipped_blocks_to_free(request_id, num_computed_tokens)
        if not indices:
            return
        blocks = self.req_to_blocks[request_id]
        removed = [blocks[i] for i in indices]
        null = self._null_block
        for i in indices:
            blocks[i] = null
        self.block_pool.free_blocks(removed)

    def num_blocks_freed_by_skip(
        self, request_id: Text, num_computed_tokens: SupportsIndex
    ) -> int:
        """Blocks ``remove_skipped_blocks`` would return to the free queue."""
        checked_id = check_request_id(request_id)
        count = self._check_within_slots(checked_id, "num_computed_tokens", num_computed_tokens)
        return self.num_blocks_freed_by_skip_unchecked(checked_id, count)

    def num_blocks_freed_by_skip_unchecked(self, request_id: str, num_computed_tokens: int
                                           ) -> int:
        indices = self._skipped_blocks_to_free(request_id, num_computed_tokens)
        if not indices:
            return 0
        blocks = self.req_to_blocks[request_id]
        return sum(1 for i in indices if blocks[i].ref_cnt == 1)

    # -- prefix caching ------------------------------------------------------------------

    def get_num_common_prefix_blocks(self, running_request_id: Text) -> int:
        """Leading blocks every running request shares (for cascade attention): none but
        full attention's."""
        if type(running_request_id) is not str:
            check_request_id(running_request_id)
        return 0

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: SupportsIndex,
        kv_cache_group_ids: Sequence[SupportsIndex],
        block_pool: BlockPoolLike,
        kv_cache_spec: KVCacheSpecLike,
        use_eagle: Flag,
        alignment_tokens: SupportsIndex,
        dcp_world_size: SupportsIndex = 1,
        pcp_world_size: SupportsIndex = 1,
    ) -> tuple[list[KVCacheBlock], ...]:
        """Per group in ``kv_cache_group_ids``: the blocks of the longest cache hit within
        ``max_length`` tokens (the same length in every group): null blocks up to the first
        hit block, then the hits of ``[first, end)`` that ``_hit_range`` picks.
        ``block_hashes``: a list of bytes, or a ``BlockHashListWithBlockSize`` over one."""
        hashes = check_block_hashes(block_hashes)
        length = check_count("max_length", max_length)
        group_ids = check_group_ids(kv_cache_group_ids)
        pool = check_block_pool(block_pool)
        spec = as_kv_cache_spec(kv_cache_spec)
        eagle = check_flag("use_eagle", use_eagle)
        alignment = check_count("alignment_tokens", alignment_tokens, low=1)
        dcp, pcp = check_world_sizes(dcp_world_size, pcp_world_size, InvalidManagerArgument)
        return cls.find_longest_cache_hit_unchecked(hashes, length, group_ids, pool, spec,
                                                    eagle, alignment, dcp, pcp)

    @classmethod
    def find_longest_cache_hit_unchecked(
        cls,
        block_hashes: BlockHashList,
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpecLike,
        use_eagle: bool,
        alignment_tokens: int,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
    ) -> tuple[list[KVCacheBlock], ...]:
        spec = as_kv_cache_spec(kv_cache_spec)
        cls._check_serves(spec, dcp_world_size, pcp_world_size)
        block_size = spec.block_size
        hits = _HitPattern(block_hashes, block_pool, kv_cache_group_ids)
        first, end = cls._hit_range(
            hits, _max_length_within(block_hashes, max_length, block_size), block_size,
            spec, use_eagle, alignment_tokens,
        )
        return hits.blocks(first, end, len(kv_cache_group_ids), block_pool.null_block)

    @classmethod
    def _hit_range(
        cls, hits: Sequence[bool], max_length: int, block_size: int,
        kv_cache_spec: KVCacheSpec, use_eagle: bool, alignment_tokens: int,
    ) -> tuple[int, int]:
        """This attention type's hit rule: ``[first, end)``, the block indices of the hit
        (the managers that override ``find_longest_cache_hit_unchecked`` have none)."""
        raise NotImplementedError(f"{cls.__name__} has no hit rule over block positions")


class FullAttentionManager(SingleTypeKVCacheManager):
    """Full attention (and MLA): a hit is the leading run of cached blocks."""

    @classmethod
    def find_longest_cache_hit_unchecked(
        cls,
        block_hashes: BlockHashList,
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpecLike,
        use_eagle: bool,
        alignment_tokens: int,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
    ) -> tuple[list[KVCacheBlock], ...]:
        block_size = as_kv_cache_spec(kv_cache_spec).block_size * dcp_world_size * pcp_world_size
        max_blocks = max(min(max_length // block_size, len(block_hashes)), 0)
        hits = [block_pool.get_cached_prefix(block_hashes, group_id, max_blocks)
                for group_id in kv_cache_group_ids]
        num_blocks = _trim_full_hit(min(map(len, hits)), block_size, alignment_tokens,
                                    use_eagle)
        for hit in hits:
            del hit[num_blocks:]
        return tuple(hits)

    def get_num_common_prefix_blocks(self, running_request_id: Text) -> int:
        checked_id = (running_request_id if type(running_request_id) is str
                      else check_request_id(running_request_id))
        blocks = self.req_to_blocks.get(checked_id)
        if not blocks:
            return 0
        num_requests = len(self.req_to_blocks)
        count = 0
        for block in blocks:
            if block.ref_cnt != num_requests:
                break
            count += 1
        return count


class SinkFullAttentionManager(FullAttentionManager):
    """Full attention whose ``sink_len`` sink tokens live in blocks shared by every request,
    taken from the pool once, when the manager is built."""

    def __init__(
        self,
        kv_cache_spec: KVCacheSpecLike,
        block_pool: BlockPoolLike,
        kv_cache_group_id: SupportsIndex,
        dcp_world_size: SupportsIndex = 1,
        pcp_world_size: SupportsIndex = 1,
    ) -> None:
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id, dcp_world_size,
                         pcp_world_size)
        sink_len = getattr(self.spec, "sink_len", None)
        if type(sink_len) is not int or sink_len <= 0 or sink_len % self.block_size:
            raise InvalidKVCacheConfig(
                f"sink_len must be a positive multiple of the block size {self.block_size}, "
                f"got {sink_len!r}"
            )
        num_sink_blocks = sink_len // self.block_size
        pool = self.block_pool
        if num_sink_blocks > pool.get_num_free_blocks():
            raise InvalidKVCacheConfig(
                f"{num_sink_blocks} sink blocks do not fit a pool with "
                f"{pool.get_num_free_blocks()} free blocks"
            )
        self.sink_blocks = pool.get_new_blocks(num_sink_blocks)


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Sliding-window attention: blocks that slid out of the window become null blocks; a
    hit is the last run of blocks covering a window, searched right to left."""

    skips_blocks = True
    served_spec = SlidingWindowSpec
    no_context_parallel = "sliding-window"

    def __init__(
        self,
        kv_cache_spec: KVCacheSpecLike,
        block_pool: BlockPoolLike,
        kv_cache_group_id: SupportsIndex,
        dcp_world_size: SupportsIndex = 1,
        pcp_world_size: SupportsIndex = 1,
    ) -> None:
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id, dcp_world_size,
                         pcp_world_size)
        self.sliding_window = cast(SlidingWindowSpec, self.spec).sliding_window

    @classmethod
    def _hit_range(
        cls, hits: Sequence[bool], max_length: int, block_size: int,
        kv_cache_spec: KVCacheSpec, use_eagle: bool, alignment_tokens: int,
    ) -> tuple[int, int]:
        return sliding_window_hit(
            hits, max_length, block_size, cast(SlidingWindowSpec, kv_cache_spec).sliding_window,
            alignment_tokens, use_eagle,
        )

    def _num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return num_computed_tokens - self.sliding_window + 1


class ChunkedLocalAttentionManager(SingleTypeKVCacheManager):
    """Chunked local attention: blocks of earlier chunks become null blocks; a hit is null
    blocks up to the current chunk, then the run of cached blocks."""

    skips_blocks = True
    served_spec = ChunkedLocalAttentionSpec
    no_context_parallel = "chunked local"

    def __init__(
        self,
        kv_cache_spec: KVCacheSpecLike,
        block_pool: BlockPoolLike,
        kv_cache_group_id: SupportsIndex,
        dcp_world_size: SupportsIndex = 1,
        pcp_world_size: SupportsIndex = 1,
    ) -> None:
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id, dcp_world_size,
                         pcp_world_size)
        self.attention_chunk_size = cast(ChunkedLocalAttentionSpec,
                                         self.spec).attention_chunk_size

    @classmethod
    def _hit_range(
        cls, hits: Sequence[bool], max_length: int, block_size: int,
        kv_cache_spec: KVCacheSpec, use_eagle: bool, alignment_tokens: int,
    ) -> tuple[int, int]:
        if use_eagle:
            raise InvalidKVCacheConfig("chunked local attention does not support EAGLE")
        if alignment_tokens != block_size:
            raise InvalidKVCacheConfig(
                f"chunked local attention needs the hit alignment ({alignment_tokens} tokens) "
                f"to equal its block size {block_size}"
            )
        return chunked_local_hit(
            hits, max_length, block_size,
            cast(ChunkedLocalAttentionSpec, kv_cache_spec).attention_chunk_size,
        )

    def _num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return num_computed_tokens // self.attention_chunk_size * self.attention_chunk_size


class MambaManager(SingleTypeKVCacheManager):
    """A state-space layer: only the latest state block matters; a hit is the last cached
    block, searched right to left, with null blocks before it."""

    skips_blocks = True
    served_spec = MambaSpec
    no_context_parallel = "Mamba"

    def __init__(
        self,
        kv_cache_spec: KVCacheSpecLike,
        block_pool: BlockPoolLike,
        kv_cache_group_id: SupportsIndex,
        dcp_world_size: SupportsIndex = 1,
        pcp_world_size: SupportsIndex = 1,
    ) -> None:
        super().__init__(kv_cache_spec, block_pool, kv_cache_group_id, dcp_world_size,
                         pcp_world_size)
        spec_blocks = cast(MambaSpec, self.spec).num_speculative_blocks
        self.num_speculative_tokens = self.spec.block_size * spec_blocks

    @classmethod
    def _hit_range(
        cls, hits: Sequence[bool], max_length: int, block_size: int,
        kv_cache_spec: KVCacheSpec, use_eagle: bool, alignment_tokens: int,
    ) -> tuple[int, int]:
        end = mamba_hit_blocks(hits, max_length, block_size, alignment_tokens)
        return max(end - 1, 0), end

    def get_num_blocks_to_allocate_unchecked(
        self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        return super().get_num_blocks_to_allocate_unchecked(
            request_id, num_tokens + self.num_speculative_tokens, new_computed_blocks
        )

    def allocate_new_blocks_unchecked(self, request_id: str, num_tokens: int
                                      ) -> list[KVCacheBlock]:
        return super().allocate_new_blocks_unchecked(
            request_id, num_tokens + self.num_speculative_tokens)

    def _num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return num_computed_tokens - 1


class CrossAttentionManager(SingleTypeKVCacheManager):
    """Decoder-to-encoder attention: blocks for the encoder tokens, allocated once, never
    prefix-cached."""

    def save_new_computed_blocks(
        self, request_id: Text, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> None:
        checked_id = check_request_id(request_id)
        hits = check_block_list(new_computed_blocks, "new_computed_blocks")
        self.save_new_computed_blocks_unchecked(checked_id, hits)

    def save_new_computed_blocks_unchecked(
        self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> None:
        if new_computed_blocks:
            raise PrefixCachingNotSupported(
                f"cross-attention never has cache hits, got {len(new_computed_blocks)} for "
                f"request {request_id!r}"
            )

    def cache_blocks(self, request: RequestLike, num_tokens: SupportsIndex) -> None:
        raise PrefixCachingNotSupported("Should not be called as prefix caching is disabled.")

    def cache_blocks_unchecked(self, request: RequestLike, num_tokens: int) -> None:
        raise PrefixCachingNotSupported("Should not be called as prefix caching is disabled.")

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: SupportsIndex,
        kv_cache_group_ids: Sequence[SupportsIndex],
        block_pool: BlockPoolLike,
        kv_cache_spec: KVCacheSpecLike,
        use_eagle: Flag,
        alignment_tokens: SupportsIndex,
        dcp_world_size: SupportsIndex = 1,
        pcp_world_size: SupportsIndex = 1,
    ) -> tuple[list[KVCacheBlock], ...]:
        raise PrefixCachingNotSupported("cross-attention blocks are never prefix-cached")

    @classmethod
    def find_longest_cache_hit_unchecked(
        cls,
        block_hashes: BlockHashList,
        max_length: int,
        kv_cache_group_ids: list[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpecLike,
        use_eagle: bool,
        alignment_tokens: int,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
    ) -> tuple[list[KVCacheBlock], ...]:
        raise PrefixCachingNotSupported("cross-attention blocks are never prefix-cached")


def _require_no_context_parallel(kind: str, dcp_world_size: int, pcp_world_size: int) -> None:
    if dcp_world_size != 1 or pcp_world_size != 1:
        raise InvalidKVCacheConfig(
            f"{kind} attention does not support context parallelism "
            f"(dcp_world_size={dcp_world_size}, pcp_world_size={pcp_world_size})"
        )


spec_manager_map: dict[type[KVCacheSpec], type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: FullAttentionManager,
    MLAAttentionSpec: FullAttentionManager,
    SinkFullAttentionSpec: SinkFullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    ChunkedLocalAttentionSpec: ChunkedLocalAttentionManager,
    MambaSpec: MambaManager,
    CrossAttentionSpec: CrossAttentionManager,
}

_MANAGER_ARGUMENTS = ("block_pool", "kv_cache_group_id", "dcp_world_size", "pcp_world_size")


def get_manager_for_kv_cache_spec(
    kv_cache_spec: KVCacheSpecLike, **kwargs: Any
) -> SingleTypeKVCacheManager:
    """The manager of ``kv_cache_spec``'s exact kind (``UnsupportedKVCacheSpec`` if none);
    vLLM's spec objects are recognised by kind (``kv_cache_interface.spec_kind``)."""
    kind = spec_kind(kv_cache_spec)
    manager_class = None if kind is None else spec_manager_map.get(kind)
    if manager_class is None:
        raise UnsupportedKVCacheSpec(
            f"no KV-cache manager handles {type(kv_cache_spec).__name__} "
            f"({kv_cache_spec!r}); known: {sorted(t.__name__ for t in spec_manager_map)}"
        )
    unknown = sorted(set(kwargs) - set(_MANAGER_ARGUMENTS))
    missing = [name for name in _MANAGER_ARGUMENTS[:2] if name not in kwargs]
    if unknown or missing:
        raise InvalidKVCacheConfig(
            f"a KV-cache manager takes {', '.join(_MANAGER_ARGUMENTS)}; got unknown "
            f"{unknown}, missing {missing}")
    return manager_class(kv_cache_spec, **kwargs)
