"""Every typed error impl/ raises, in one place.

Each is a ``ValueError`` or ``LookupError`` (``UnsupportedKVCacheSpec`` a ``KeyError``, as
in vLLM), raised before anything changes, with a message that names the value. They live
apart from the classes that raise them because mypyc, which compiles those modules (see
scripts/compile.py), cannot compile a class with two built-in bases; each module re-exports
its own, so ``from kvspec.impl.block_pool import BlockNotInUseError`` works as before.

A compiled function checks its arguments' annotated types at the call and raises a bare
``TypeError``; public parameters that take user input are therefore annotated with abstract
types mypyc does not check (``SupportsIndex``, ``Sequence``, Protocols), so that the method's
own check block runs and raises one of these errors in both builds (docs/architecture.md).
"""

from __future__ import annotations

# ---------------------------------------- free queue and blocks


class NoFreeBlocksError(ValueError):
    """More blocks were asked of the free queue than it holds."""


class BlockNotFreeError(LookupError):
    """A block that is not in the free queue was asked to leave it."""


class InvalidFreeQueueArgument(ValueError):
    """A free queue was handed something that is not a block it may take: not a block, a
    block already queued (here or in another queue), a block listed twice, a bad count."""


class InvalidBlockFieldError(ValueError):
    """A ``KVCacheBlock`` field given a value of the wrong type (an id that is not an int, a
    hash that is not bytes, ...)."""


class BlockOwnershipError(ValueError):
    """A write that belongs to a block's owner: a pool block's ref count or hash set directly,
    a queue's links written, the pool's own free queue changed other than through the pool."""


# ---------------------------------------- block pool


class BlockPoolError(Exception):
    """A call the pool refused; the pool is unchanged."""


class InvalidBlockCountError(BlockPoolError, ValueError):
    """A negative or non-integer number of blocks."""


class InvalidPoolConfigError(BlockPoolError, ValueError):
    """A pool built with a setting no pool can have (a flag that is not a bool, a hash block
    size that is not a positive int, a metrics collector that is not one)."""


class InvalidBlockListError(BlockPoolError, ValueError):
    """A blocks (or block ids) argument that is not an iterable of them."""


class InvalidRequestForCachingError(BlockPoolError, ValueError):
    """A request ``cache_full_blocks`` cannot key blocks for: its hashes, token ids or LoRA
    are not what vLLM's Request holds."""


class NotEnoughFreeBlocksError(BlockPoolError, ValueError):
    """More blocks were asked for than are free."""


class BlockNotInPoolError(BlockPoolError, LookupError):
    """A block id outside the pool, or a block object from another pool."""


class BlockNotInUseError(BlockPoolError, ValueError):
    """A block freed more times than it was referenced."""


class BlockAlreadyCachedError(BlockPoolError, ValueError):
    """A block that already has a key was asked to take another."""


class InvalidBlockHashError(BlockPoolError, ValueError):
    """A block hash that is not bytes, or too few hashes for the blocks to cache."""


# ---------------------------------------- manager stack


class KVCacheManagerError(Exception):
    """A call the KV-cache manager stack refused; nothing changed."""


class InvalidKVCacheConfig(KVCacheManagerError, ValueError):
    """A KV-cache config the managers cannot serve (block sizes that do not divide, an
    attention type combination or option no coordinator supports)."""


class UnsupportedKVCacheSpec(KVCacheManagerError, KeyError):
    """A KV-cache spec type no manager handles (a ``KeyError`` as in vLLM)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class PrefixCachingNotSupported(KVCacheManagerError, ValueError):
    """Prefix caching was asked of an attention type that never caches (cross-attention)."""


class InvalidManagerArgument(KVCacheManagerError, ValueError):
    """A manager-stack call given an argument it cannot take: a request that is not one (an id
    that is not a str, counts that are not ints, block hashes that are not a list of bytes),
    a count out of range, blocks that are not this pool's or not in the state the call needs,
    ``KVCacheBlocks`` of another shape."""


# ---------------------------------------- KVCacheManager


class InvalidAllocationError(InvalidManagerArgument):
    """``allocate_slots`` arguments no allocation can have (zero new tokens, hits for a
    request that already holds blocks, hits that are not the request's, ...)."""


class UnknownRequestError(KVCacheManagerError, LookupError):
    """A request id the manager holds no blocks for (only with ``strict_free=True``)."""


# ---------------------------------------- block tables (impl/block_table.py)


class BlockTableError(Exception):
    """A call the block table refused; every table is unchanged."""


class RowIndexError(BlockTableError, IndexError):
    """A row index (or a token's request index) outside ``[0, max_num_reqs)``."""


class GroupIndexError(BlockTableError, IndexError):
    """A KV-cache group index outside ``[0, number of groups)``."""


class RowCapacityError(BlockTableError, ValueError):
    """A row would hold more blocks than ``max_num_blocks_per_req``."""


class BlockIdError(BlockTableError, ValueError):
    """A block id outside the pool, negative, or too large for an int32 kernel block id."""


class PositionError(BlockTableError, ValueError):
    """A token position that is negative or past the end of its row."""


class TokenBatchError(BlockTableError, ValueError):
    """Token arrays of different lengths, of a non-integer type, or longer than the buffer."""


class BlockTableConfigError(BlockTableError, ValueError):
    """Sizes no block table can have (e.g. a block size that is not a multiple of the
    kernel block size)."""


# ---------------------------------------- device slot mapping (impl/slot_mapping_triton.py)


class SlotMappingArgumentError(ValueError):
    """Buffers or parameters the device slot mapping cannot use."""


# ---------------------------------------- prefix hashing (impl/hashing.py)


class HashingError(ValueError):
    """Base class of the errors this module raises for bad input."""


class InvalidGroupIdError(HashingError):
    """A KV-cache group id outside [0, 2**32) or not an int."""


class BlockHashFormatError(HashingError):
    """A block hash that is not bytes, or a group-id key too short to hold a group id.
    impl/hashing.py exports it as ``InvalidBlockHashError`` (this module's
    ``InvalidBlockHashError`` is the pool's)."""


class UnknownHashFunctionError(HashingError):
    """A hash-function name that is none of sha256, sha256_cbor, xxhash, xxhash_cbor."""


class HashFunctionUnavailableError(HashingError):
    """A known hash function whose optional dependency (cbor2, xxhash) is not installed."""


class InvalidHashFunctionError(HashingError):
    """A hash function that is not callable, or that returned something other than a hash
    (bytes, or an int: vLLM 0.13's own tests hash with Python's builtin ``hash``)."""


class UnhashableValueError(HashingError):
    """A value a hash function cannot encode (pickle or CBOR refuses it)."""


class InvalidBlockSizeError(HashingError):
    """A block size that is not positive, or a target size not a multiple of the hash size."""


class InvalidBlockRangeError(HashingError):
    """A block's token range that is not ``[start, end)`` with ``0 <= start < end``."""


class InvalidBlockIndexError(HashingError, TypeError):
    """An index into a coarse hash view that is neither an int nor a slice (a ``TypeError``
    too, as vLLM raises)."""


class InvalidMultiModalIndexError(HashingError):
    """A multimodal feature index outside the request's features."""


class InvalidTokenIdsError(HashingError):
    """Token ids that are not a sequence of ints."""


class InvalidExtraKeysError(HashingError):
    """Extra keys that are neither ``None`` nor a tuple of str, bytes, int or such tuples."""


class InvalidExtraKeyFormatError(HashingError):
    """An extra-key format that is not an ``ExtraKeyFormat`` or one of its values."""


class InvalidTensorError(HashingError):
    """``tensor_data`` of something that is not a CPU torch tensor."""


class InvalidRequestError(ValueError):
    """A request (``request.Request`` or a duck-typed one, such as vLLM's) with malformed
    fields: ids, token ids, block hashes, LoRA, salt, multimodal features, prompt embeddings
    or block hasher. ``request.py`` re-exports it; it refuses the same values at its door."""


# ---------------------------------------- requests (impl/request.py)


class ReadOnlyListError(TypeError, ValueError):
    """An attempt to mutate a request's token list other than through the request."""


class ReadOnlyFieldError(AttributeError, ValueError):
    """An assignment to a field the request computes (``num_tokens`` and the like)."""


class InvalidMultiModalInputError(IndexError):
    """A multimodal input index the request does not have (an ``IndexError``, as before)."""


# ---------------------------------------- KV events (impl/kv_events.py)


class InvalidWorkerCountError(ValueError):
    """A worker count that is not a positive int."""


class InvalidEventsError(TypeError, ValueError):
    """Events handed to the aggregator that are not a list of ``KVCacheEvent``.

    A ``TypeError`` as in vLLM, and a ``ValueError`` like every other bad input here.
    """


# ---------------------------------------- KV-cache specs and configs (kv_cache_interface)


class InvalidKVCacheSpec(ValueError):
    """A KV-cache spec or config field has a value no KV cache can have."""


class KVCacheSpecMismatch(InvalidKVCacheSpec):
    """Specs that cannot stand for one KV-cache group: different kinds or shapes (vLLM's
    ``merge`` asserts)."""


class WindowSizeMismatch(InvalidKVCacheSpec):
    """Full-attention specs carrying different sliding windows or chunk sizes (vLLM's
    ``merge_window_sizes`` raises ``ValueError``)."""


class UnsupportedKVCacheSpecType(InvalidKVCacheSpec, NotImplementedError):
    """A spec kind ``UniformTypeKVCacheSpecs`` has no rule for (vLLM raises
    ``NotImplementedError``)."""


# ---------------------------------------- KV-cache planning (kv_cache_planning, kv_cache_sizing)


class InvalidPlanArgument(ValueError):
    """A planning parameter (block size, block count, token count) is out of range."""


class PageSizeNotUnifiable(ValueError, NotImplementedError):
    """Layers whose pages cannot be made one size by growing block sizes (a page that does not
    divide the largest, or a Mamba page, which does not grow with its block size). A
    ``NotImplementedError`` too, as vLLM raises. models/plan.py raises a subclass that is also
    its ``InvalidLayout``."""


class KVCachePlanningError(ValueError):
    """A KV-cache plan that cannot be made from these specs, configs or memory sizes."""


class InsufficientKVCacheMemory(KVCachePlanningError):
    """A worker's memory cannot hold the KV cache of one request of ``max_model_len`` tokens.
    ``needed_bytes`` and ``estimated_max_model_len`` (0: not even one token) say by how
    much; both are None when there is no memory at all."""

    def __init__(
        self,
        message: str,
        available_bytes: int,
        needed_bytes: int | None = None,
        estimated_max_model_len: int | None = None,
    ) -> None:
        super().__init__(message)
        self.available_bytes = available_bytes
        self.needed_bytes = needed_bytes
        self.estimated_max_model_len = estimated_max_model_len


class HybridKVCacheSpecsNotUnifiable(KVCachePlanningError):
    """The hybrid KV-cache manager is off, but the layers' specs cannot become one type."""


class InconsistentLayerSpec(KVCachePlanningError):
    """Two workers give one layer different specs (vLLM asserts)."""


class NonUniformPageSize(KVCachePlanningError):
    """Specs that must share one page size do not (vLLM asserts)."""


class InconsistentNumBlocks(KVCachePlanningError):
    """Workers' KV-cache configs with different block counts (vLLM asserts)."""


class EmptyKVCacheGroups(KVCachePlanningError):
    """KV-cache groups without layers where a layer is needed (vLLM asserts or fails on an
    empty list)."""


class UnknownLayerError(KeyError):
    """A group names a layer that has no KV-cache spec (a ``KeyError``, as in vLLM)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


# ---------------------------------------- eviction policies (impl/eviction.py; the pool raises
# them for its policy operations)


class PolicyNotSupportedError(BlockPoolError, ValueError):
    """A policy operation the pool's eviction policy does not have (pinning under lru)."""


class InvalidRetentionError(BlockPoolError, ValueError):
    """A retention hint or priority that cannot be honoured."""


class BlockNotCachedError(BlockPoolError, LookupError):
    """A retention priority or a pin asked for a block without a key."""


class ClockWentBackError(BlockPoolError, ValueError):
    """advance_clock to a time before the pool's."""


class PinRefusedError(BlockPoolError, ValueError):
    """A pin over the cap, a block pinned twice, or evicting or freeing what a pin holds."""


class BlockNotPinnedError(BlockPoolError, LookupError):
    """unpin of a block that is not pinned."""


# ---------------------------------------- metrics and stats (impl/kv_cache_metrics.py,
# impl/stats.py), host buffers (impl/utils.py)


class InvalidSampleRateError(ValueError):
    """A sample rate outside (0, 1] (vLLM asserts instead)."""


class InvalidMetricsArgumentError(ValueError):
    """Not a block, not a block id, or a clock or random source that cannot be called."""


class InvalidStatsError(ValueError):
    """A count that is not an int >= 0, or a duration that is not a number of seconds >= 0."""


class CpuGpuBufferError(ValueError):
    """A buffer that cannot be built, or a copy of more rows than it has."""


# ---------------------------------------- the offload tier (impl/kv_offload)


class OffloadingError(Exception):
    """A call the manager refused; the manager is unchanged."""


class UnknownOffloadKey(OffloadingError, KeyError):
    """A key the manager does not hold (never stored, evicted, or its store failed)."""

    def __str__(self) -> str:  # KeyError's str() is the repr of its argument
        return str(self.args[0]) if self.args else ""


class DuplicateOffloadKey(OffloadingError, ValueError):
    """A key listed twice in one call: its ref count would move twice for one block."""


class StoreNotComplete(OffloadingError, ValueError):
    """A load of a key whose store is still pending: there is nothing to read yet."""


class NotPinned(OffloadingError, ValueError):
    """``complete_load`` of a key no load holds (ref count 0, or a pending store)."""


class StoreNotPending(OffloadingError, ValueError):
    """``complete_store`` of a key whose store already completed (a double complete)."""
