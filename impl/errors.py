"""Every typed error the compiled modules of impl/ raise, in one place.

Each is a ``ValueError`` or ``LookupError`` (``UnsupportedKVCacheSpec`` a ``KeyError``, as
in vLLM), raised before anything changes, with a message that names the value. They live
apart from the classes that raise them because mypyc, which compiles those modules (see
scripts/compile.py), cannot compile a class with two built-in bases; each module re-exports
its own, so ``from kvspec.impl.block_pool import BlockNotInUseError`` works as before.

A compiled function checks its arguments' annotated types at the call and raises a bare
``TypeError``; public parameters that take user input are therefore annotated ``int |
object`` (or an abstract collection type), so that the function's own check runs and raises
one of these errors in both builds.
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
