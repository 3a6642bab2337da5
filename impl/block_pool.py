"""BlockPool: vLLM 0.13's block pool API, laid out for batch moves (spec: spec/pool.py).

Where the state lives
---------------------
* ref counts: ``_in_use`` is the set of blocks with ref >= 1 and ``_shared`` the subset
  with ref >= 2, whose ``block.extra_refs`` holds ref - 1. A request's unshared blocks
  are allocated and freed with one set update each instead of a loop over ref counts.
* the free order: ``free_block_queue`` (see impl/kv_cache_utils.py).
* keys: ``_key_of`` maps a keyed block to its block hash and ``_group_of`` to its group id
  when that is not 0 (a one-group pool builds no key tuples); ``cached_block_hash_to_block``
  maps a key to its blocks. Both empty means nothing to evict, which is checked once per call.
* block objects are made the first time a block is handed out (``blocks`` is lazy), so a
  pool of a million blocks costs a list of a million empty slots to build.

Every input is checked before anything changes: a refused call leaves the pool as it was.
Integer arguments follow impl's one rule (impl/checks.py): an int or a numpy integer, never a
bool or a float.

Seams
-----
The pool meets the modules below it through public, named members only: a block's
``owner`` and ``extra_refs`` (``BlockOwner``, impl/kv_cache_utils.py, which the pool
implements: ``ref_count``, ``block_hash_of``), its free queue's ``*_unchecked`` moves, and the
map's ``insert_unchecked``, ``remove_unchecked``, ``groups`` and ``later``. An eviction policy
reads the pool through ``PolicyPool`` (impl/eviction.py): ``blocks``, ``cached_blocks``,
``blocks_in_use``, ``clock``, ``free_block_queue``, ... ``check_representation()`` checks the
layout of the pool, its queue, its map and its policy (tests, debugging).

Bounded events
--------------
``BlockPool(..., max_pending_kv_events=N)`` (kvspec's, off by default: vLLM's pool keeps
every event until ``take_events``) bounds the events a stalled consumer leaves pending. After
a call that queues events, when more than N are pending and at least twice as many as a
snapshot of the cache would take, they are replaced, in place, by that snapshot:
``AllBlocksCleared``, then one ``BlockStored`` per cached block in block id order, and
``num_kv_event_collapses`` counts it. A consumer that replays what it takes (Stored adds
keys, Removed takes them away, Cleared empties) still ends with exactly the cached keys; at
most max(N, 2 x cached blocks + 1) events are pending after any call, and collapsing costs
O(1) amortised per event (spec: ``spec/pool.py`` ``_bound_events``).

A snapshot ``BlockStored`` carries what the pool keeps of a cached block: its hash, the
block size of its group (the last one ``cache_full_blocks`` was given for the group), and
``medium``; ``parent_block_hash`` and ``lora_id`` are None and ``token_ids`` empty, as in the
``BlockStored`` events vLLM's offloading connector sends. A router that indexes blocks by
hash (the replay above) loses nothing; one that needs the tokens or the parent of a block
learns them again when the block is next stored. Keeping them would cost every cached block
a list of its token ids (some 630 B at 16 tokens once its request is gone), a parent and a
LoRA id, and the caching hot path the work of storing them, to serve only the rare collapse
(docs/bounded-events.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import islice, repeat, takewhile
from operator import attrgetter, truth
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, SupportsIndex, overload

from mypy_extensions import mypyc_attr

from kvspec.impl import host_profile, host_types
from kvspec.impl.checks import BlockLike, Flag, HashBytes, Text, as_int
from kvspec.impl.errors import (
    BlockAlreadyCachedError as BlockAlreadyCachedError,
    BlockNotCachedError as BlockNotCachedError,
    BlockNotInPoolError as BlockNotInPoolError,
    BlockNotInUseError as BlockNotInUseError,
    BlockNotPinnedError as BlockNotPinnedError,
    BlockOwnershipError as BlockOwnershipError,
    BlockPoolError as BlockPoolError,
    ClockWentBackError as ClockWentBackError,
    InvalidBlockCountError as InvalidBlockCountError,
    InvalidBlockHashError as InvalidBlockHashError,
    InvalidBlockListError as InvalidBlockListError,
    InvalidPoolConfigError as InvalidPoolConfigError,
    InvalidRequestForCachingError as InvalidRequestForCachingError,
    NotEnoughFreeBlocksError as NotEnoughFreeBlocksError,
    PinRefusedError as PinRefusedError,
    PolicyNotSupportedError as PolicyNotSupportedError,
)
from kvspec.impl.eviction import EvictionPolicy, check_retention
from kvspec.impl.hashing import (
    BlockHash,
    BlockHashListWithBlockSize,
    BlockHashWithGroupId,
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
)
from kvspec.impl.kv_cache_metrics import MetricsCollectorLike
from kvspec.impl.kv_cache_utils import BlockOwner, FreeKVCacheBlockQueue, KVCacheBlock
from kvspec.impl.kv_events import MEDIUM_GPU, KVCacheEvent, event_classes

if TYPE_CHECKING:
    from collections.abc import Collection, Set as AbstractSet

logger = logging.getLogger(__name__)


class RequestToCache(Protocol):
    """What the pool reads of a request when it keys the request's blocks: vLLM's
    ``Request``, impl's, or any object with these fields (read, never checked by class)."""

    @property
    def block_hashes(self) -> Sequence[bytes]: ...

    @property
    def all_token_ids(self) -> Sequence[int]: ...

    @property
    def lora_request(self) -> object: ...

# Block ids are int32 in vLLM's block tables and kernels: a pool holds at most 2**31 blocks.
MAX_NUM_GPU_BLOCKS = 2**31

# The vLLM pool APIs a BlockPool serves (module docstring, vLLM 0.33).
POOL_APIS = ("0.13", "0.33")
_default_api: list[str] = []  # the process's choice, made once (default_pool_api)


def pool_api_of_vllm(version: str) -> str:
    """The pool API of a vLLM release: 0.33's for 0.33.x, 0.13's for everything else."""
    return "0.33" if version.startswith("0.33.") or version == "0.33" else "0.13"


def default_pool_api() -> str:
    """The API a ``BlockPool`` built without ``vllm_api`` serves: that of this Python's vLLM
    (``host_profile.host_vllm_version``; vLLM itself is not imported), 0.13's without one.
    So ``kvspec.impl`` inside a vLLM 0.33 process is 0.33's pool with or without the plugin."""
    if not _default_api:
        version = host_profile.host_vllm_version()  # the one rule for "this Python's vLLM"
        _default_api.append(pool_api_of_vllm("0.13" if version is None else version))
    return _default_api[0]


def set_default_pool_api(api: Text) -> None:
    """Make ``api`` (one of ``POOL_APIS``) the default of pools built from now on (the plugin
    sets the running vLLM's)."""
    if api not in POOL_APIS:
        raise InvalidPoolConfigError(f"vllm_api must be one of {POOL_APIS}, got {api!r}")
    _default_api[:] = [str(api)]


def _event_extra_keys(extra_keys: list[tuple[Any, ...] | None]) -> list[Any] | None:
    """vLLM 0.33's KV-event form of per-block tagged extra keys: untagged again (a LoRA name, a
    salt, an ``(identifier, offset)`` pair, a prompt-embeddings digest), None for no blocks."""
    if not extra_keys:
        return None
    return [None if keys is None else
            tuple(key[1:] if key[0] == "mm" else key[1] for key in keys)
            for keys in extra_keys]


class _VllmEvents(NamedTuple):
    """vLLM's own event classes, in ``kv_events.EventClasses``'s names."""

    BlockStored: Any
    BlockRemoved: Any
    AllBlocksCleared: Any


def _view_033(hashes: list[Any], hash_block_size: int, block_size: int) -> list[Any]:
    """vLLM 0.33's hashes at a coarser block size: each block's is the last hash-block hash
    inside it (it already chains over the whole prefix; 0.13 joined them all)."""
    if block_size % hash_block_size:
        raise InvalidBlockCountError(f"block size {block_size} is not a multiple of the hash "
                                     f"block size {hash_block_size}")
    scale = block_size // hash_block_size
    return hashes[scale - 1 :: scale]


def _first_mm_feature_ending_after(mm_features: Sequence[Any], start: int) -> int:
    """The index of the first multimodal feature (sorted, disjoint) that ends after ``start``."""
    for index, feature in enumerate(mm_features):
        position = feature.mm_position
        if position.offset + position.length > start:
            return index
    return len(mm_features)

_GROUP_ID_SUFFIXES = tuple(gid.to_bytes(4, "big") for gid in range(256))
_GROUP_0 = _GROUP_ID_SUFFIXES[0]
_pool_of = attrgetter("owner")
_block_id_of = attrgetter("block_id")


def _check_group_id(group_id: object) -> int:
    """A group id: an integer (``as_int``) in [0, 2**32)."""
    checked = group_id if type(group_id) is int else as_int(group_id)
    if checked is None or not 0 <= checked < 2**32:
        raise InvalidBlockHashError(f"group id must be an int in [0, 2**32), got {group_id!r}")
    return checked


def _check_count(name: str, value: object, low: int = 0) -> int:
    """A block count: an integer (``as_int``) >= ``low``."""
    count = value if type(value) is int else as_int(value)
    if count is None or count < low:
        raise InvalidBlockCountError(f"{name} must be an int >= {low}, got {value!r}")
    return count


def _check_block_ids(block_ids: object, size: int) -> list[int]:
    """Block ids read whole (``_listed``) and checked: integers (``as_int``) in the pool."""
    ids: list[int] = []
    for given in _listed(block_ids, "block_ids"):
        block_id = given if type(given) is int else as_int(given)
        if block_id is None or not 0 <= block_id < size:
            raise BlockNotInPoolError(f"block id {given!r} is outside the pool of {size} blocks")
        ids.append(block_id)
    return ids


def _new_block(pool: BlockPool, block_id: int) -> KVCacheBlock:
    """Block ``block_id`` of ``pool``, made (a handle whose ref count and key the pool keeps)."""
    block = KVCacheBlock(block_id)
    block.owner = pool
    return block


def _made_block(pool: BlockPool, objects: list[KVCacheBlock | None], block_id: int
                ) -> KVCacheBlock:
    """The pool's block ``block_id`` (in range), made the first time it is asked for."""
    block = objects[block_id]
    if block is None:
        block = objects[block_id] = _new_block(pool, block_id)
    return block


def _listed(values: object, what: str) -> list[Any]:
    """``values`` read whole into a list (a list is taken as it is), or a typed refusal when it
    is not iterable. An iterator that fails while read raises its own error, before the pool
    changes anything."""
    if type(values) is list:
        return values
    try:
        iterator = iter(values)  # type: ignore[call-overload]
    except TypeError:
        raise InvalidBlockListError(f"{what} must be an iterable, got {values!r}") from None
    return list(iterator)


def _is_subset(items: list[Any], members: set[KVCacheBlock]) -> bool:
    """Whether every item is in ``members``; False for a list holding an unhashable stranger."""
    try:
        return members.issuperset(items)
    except TypeError:
        return False


def _flag(name: str, value: object) -> bool:
    """A setting that is a bool."""
    if type(value) is not bool:
        raise InvalidPoolConfigError(f"{name} must be a bool, got {value!r}")
    return value


def _event_bound(value: object) -> int | None:
    """None, or an integer (``as_int``) >= 1."""
    if value is None:
        return None
    bound = as_int(value)
    if bound is None or bound < 1:
        raise InvalidPoolConfigError(
            f"max_pending_kv_events must be None or a positive int, got {value!r}")
    return bound


def _collector(value: object) -> MetricsCollectorLike | None:
    if value is not None and not callable(getattr(value, "on_block_allocated", None)):
        raise InvalidPoolConfigError(
            f"metrics_collector must be a KVCacheMetricsCollector, got {value!r}")
    return value  # type: ignore[return-value]


def _split_key(key: object) -> tuple[bytes, int]:
    if type(key) is not bytes or len(key) < 4:
        raise InvalidBlockHashError(f"a block hash key must be bytes of length >= 4, got {key!r}")
    return key[:-4], int.from_bytes(key[-4:], "big")


class BlockHashToBlockMap:
    """Prefix-cache key -> the blocks cached under it, first inserted first.

    Keys are ``BlockHashWithGroupId`` (block hash + 4-byte group id) as in vLLM, but they are
    stored split, so that a lookup is one dict ``get`` on the bare hash (whose hash the bytes
    object has cached) and a request's whole prefix is looked up with ``map`` at C speed:

    * ``groups[group_id][block_hash]``: the first block cached under the key;
    * ``later[(group_id, block_hash)]``: the blocks cached under it after the first, in
      order. The same content may be cached in several blocks (two requests computed it at
      once; block tables are append-only, so there is no de-duplication), which is rare:
      ``later`` is usually empty, and then every keyed block is its key's first.

    The owner's seam (the pool's): it reads ``groups`` and ``later`` (never writes them)
    and moves blocks with ``insert_unchecked``, ``remove_unchecked`` and ``clear_unchecked``;
    everyone else uses vLLM's checked ``get_one_block``, ``insert``, ``pop`` and ``clear``.

    A pool's own map (``for_pool``) is read-only from outside, as the pool's free queue is:
    ``insert``, ``pop`` and ``clear`` raise ``BlockOwnershipError`` and change nothing, while
    reads (``get_one_block``, ``len``, ``items``, iteration, truth) work as in vLLM. An edit
    from outside would leave the pool's own record of a block's key disagreeing with the map:
    after a foreign ``pop`` the next ``get_new_blocks`` that evicts the block raised a bare
    ``KeyError`` half-way through, with the pool left inconsistent.
    """

    def __init__(self) -> None:
        self.groups: dict[int, dict[bytes, KVCacheBlock]] = {}
        self.later: dict[tuple[int, bytes], list[KVCacheBlock]] = {}
        self.pool_owned: bool = False

    @classmethod
    def for_pool(cls) -> BlockHashToBlockMap:
        """A pool's own map: its public edits are refused (the pool edits it through the
        ``..._unchecked`` seam)."""
        cache_map = cls()
        cache_map.pool_owned = True
        return cache_map

    def _refuse_for_pool(self, operation: str) -> None:
        if self.pool_owned:
            raise BlockOwnershipError(
                f"{operation} on a BlockPool's own prefix-cache map: the pool keys and evicts "
                f"its blocks itself (cache_full_blocks, evict_blocks, reset_prefix_cache), or "
                f"its record of each block's key would disagree with the map")

    def get_one_block(self, key: HashBytes) -> KVCacheBlock | None:
        block_hash, group_id = _split_key(key)
        group = self.groups.get(group_id)
        return None if group is None else group.get(block_hash)

    def insert(self, key: HashBytes, block: BlockLike) -> None:
        self._refuse_for_pool("insert")
        block_hash, group_id = _split_key(key)
        if not isinstance(block, KVCacheBlock):
            raise BlockNotInPoolError(f"only a KVCacheBlock can be cached, got {block!r}")
        # A block has at most one key. The pool keys only unkeyed blocks and calls
        # insert_unchecked; this public entry checks, by a scan (off the pool's hot path).
        for mapped_key, blocks in self.items():
            if any(b is block for b in blocks):
                raise BlockAlreadyCachedError(
                    f"block {block.block_id} is already cached under key {mapped_key!r}")
        self.insert_unchecked(group_id, block_hash, block)

    def pop(self, key: HashBytes, block_id: SupportsIndex) -> KVCacheBlock | None:
        self._refuse_for_pool("pop")
        block_hash, group_id = _split_key(key)
        checked_id = block_id if type(block_id) is int else as_int(block_id)
        if checked_id is None:
            raise BlockNotInPoolError(f"block id must be an int, got {block_id!r}")
        for block in self._blocks(group_id, block_hash):
            if block.block_id == checked_id:
                self.remove_unchecked(group_id, block_hash, block)
                return block
        return None

    def contain(self, key: HashBytes, block_id: SupportsIndex) -> bool:
        """vLLM 0.33: whether ``block_id`` is among the blocks cached under ``key``."""
        block_hash, group_id = _split_key(key)
        checked_id = block_id if type(block_id) is int else as_int(block_id)
        if checked_id is None:
            raise BlockNotInPoolError(f"block id must be an int, got {block_id!r}")
        return any(b.block_id == checked_id for b in self._blocks(group_id, block_hash))

    def __len__(self) -> int:
        return sum(len(group) for group in self.groups.values())

    def clear(self) -> None:
        self._refuse_for_pool("clear")
        self.clear_unchecked()

    def clear_unchecked(self) -> None:
        """Forget every key. The owner's seam (``reset_prefix_cache``)."""
        self.groups.clear()
        self.later.clear()

    def items(self) -> Iterator[tuple[bytes, list[KVCacheBlock]]]:
        """Each key (hash + group id) with its blocks, first inserted first (for audits)."""
        for group_id, group in self.groups.items():
            suffix = group_id.to_bytes(4, "big")
            for block_hash in group:
                yield block_hash + suffix, self._blocks(group_id, block_hash)

    def _check(self) -> None:
        """``check_representation()``, by its former name."""
        self.check_representation()

    def check_representation(self, multi_key_blocks: Collection[KVCacheBlock] = ()) -> None:
        """The representation invariant, for tests and debugging (O(blocks)); raises an
        ``AssertionError`` naming the broken property. No ``assert``: it runs under -O.

        Every ``later`` list extends a key that has a first block, and is not empty; no
        block is cached twice under one key, nor under two unless it is one of
        ``multi_key_blocks`` (vLLM 0.33's blocks with partial entries, the pool says which)."""
        for group_id, group in self.groups.items():
            if type(group_id) is not int or not 0 <= group_id < 2**32:
                raise AssertionError(f"hash map: group id {group_id!r} is not a 4-byte int")
            for block_hash, block in group.items():
                if type(block_hash) is not bytes or not isinstance(block, KVCacheBlock):
                    raise AssertionError(f"hash map: entry {block_hash!r} -> {block!r} is not "
                                         f"bytes -> KVCacheBlock")
        for (group_id, block_hash), later in self.later.items():
            if not later:
                raise AssertionError(f"hash map: empty later list under group {group_id} "
                                     f"hash {block_hash!r}")
            if block_hash not in self.groups.get(group_id, {}):
                raise AssertionError(f"hash map: later blocks under group {group_id} hash "
                                     f"{block_hash!r}, which has no first block")
        seen: set[KVCacheBlock] = set()
        for _, blocks in self.items():
            under_key: set[KVCacheBlock] = set()
            for block in blocks:
                if block in under_key or (block in seen and block not in multi_key_blocks):
                    raise AssertionError(f"hash map: block {block.block_id} is cached twice")
                under_key.add(block)
                seen.add(block)

    def _blocks(self, group_id: int, block_hash: bytes) -> list[KVCacheBlock]:
        first = self.groups.get(group_id, {}).get(block_hash)
        if first is None:
            return []
        return [first, *self.later.get((group_id, block_hash), ())]

    def insert_unchecked(self, group_id: int, block_hash: bytes, block: KVCacheBlock) -> None:
        """Cache ``block`` under the key, after any already there. The owner's seam: the
        caller guarantees the block has no key and the key's parts are a group id in
        [0, 2**32) and bytes."""
        group = self.groups.get(group_id)
        if group is None:
            self.groups[group_id] = {block_hash: block}
        elif block_hash in group:
            self.later.setdefault((group_id, block_hash), []).append(block)
        else:
            group[block_hash] = block

    def remove_unchecked(self, group_id: int, block_hash: bytes, block: KVCacheBlock) -> None:
        """Drop one block cached under the key. The owner's seam: the caller guarantees it is
        there."""
        group = self.groups[group_id]
        later = self.later.get((group_id, block_hash)) if self.later else None
        if group[block_hash] is block:
            if later:
                group[block_hash] = later.pop(0)
            else:
                del group[block_hash]
        else:
            later.remove(block)  # type: ignore[union-attr]
        if later is not None and not later:
            del self.later[(group_id, block_hash)]


class _LazyBlocks(Sequence[KVCacheBlock]):
    """``pool.blocks``: block i's object, made on first access."""

    __slots__ = ("_objects", "_pool")

    def __init__(self, pool: BlockPool, objects: list[KVCacheBlock | None]) -> None:
        self._pool = pool
        self._objects = objects  # the pool's own list of block objects, None until made

    def __len__(self) -> int:
        return self._pool.num_gpu_blocks

    @overload
    def __getitem__(self, index: int) -> KVCacheBlock: ...

    @overload
    def __getitem__(self, index: slice) -> list[KVCacheBlock]: ...

    def __getitem__(self, index: SupportsIndex | slice) -> KVCacheBlock | list[KVCacheBlock]:
        pool, objects = self._pool, self._objects
        size = pool.num_gpu_blocks
        if isinstance(index, slice):
            return [_made_block(pool, objects, i) for i in range(*index.indices(size))]
        checked = index if type(index) is int else as_int(index)
        if checked is None or not -size <= checked < size:
            raise BlockNotInPoolError(
                f"block index {index!r} is not an int in range for {size} blocks")
        return _made_block(pool, objects, checked % size)

    def __iter__(self) -> Iterator[KVCacheBlock]:
        pool, objects = self._pool, self._objects
        return (_made_block(pool, objects, i) for i in range(pool.num_gpu_blocks))


@mypyc_attr(allow_interpreted_subclasses=True)  # forks and tests subclass it
class BlockPool(BlockOwner):
    """The pool of KV-cache blocks: allocation, freeing, prefix-cache lookup and eviction.

    It implements ``BlockOwner`` (what its blocks read of it) and ``PolicyPool`` (what its
    eviction policy reads of it, impl/eviction.py)."""

    def __init__(
        self,
        num_gpu_blocks: SupportsIndex,
        enable_caching: Flag,
        hash_block_size: SupportsIndex,
        enable_kv_cache_events: Flag = False,
        metrics_collector: MetricsCollectorLike | None = None,
        num_hash_lookahead_tokens: SupportsIndex = 0,
        medium: Text = MEDIUM_GPU,
        *,
        max_pending_kv_events: SupportsIndex | None = None,
        eviction_policy: EvictionPolicy | None = None,
        vllm_api: Text | None = None,
    ) -> None:
        num_blocks = as_int(num_gpu_blocks)
        if num_blocks is None or not 1 <= num_blocks <= MAX_NUM_GPU_BLOCKS:
            raise InvalidBlockCountError(
                f"num_gpu_blocks must be an int in [1, 2**31], got {num_gpu_blocks!r}")
        block_size = as_int(hash_block_size)
        if block_size is None or block_size < 1:
            raise InvalidPoolConfigError(
                f"hash_block_size must be a positive int, got {hash_block_size!r}")
        caching = _flag("enable_caching", enable_caching)
        events = _flag("enable_kv_cache_events", enable_kv_cache_events)
        collector = _collector(metrics_collector)
        event_bound = _event_bound(max_pending_kv_events)
        if eviction_policy is not None and not isinstance(eviction_policy, EvictionPolicy):
            raise InvalidPoolConfigError(
                f"eviction_policy must be None or an EvictionPolicy, got {eviction_policy!r}")
        # vLLM 0.33's managers pass their use_eagle flag here (True: one lookahead token).
        lookahead = (int(num_hash_lookahead_tokens) if type(num_hash_lookahead_tokens) is bool
                     else as_int(num_hash_lookahead_tokens))
        if lookahead is None or lookahead < 0:
            raise InvalidPoolConfigError(f"num_hash_lookahead_tokens must be an int >= 0, got "
                                         f"{num_hash_lookahead_tokens!r}")
        if type(medium) is not str:
            raise InvalidPoolConfigError(f"medium must be a str, got {medium!r}")
        api = default_pool_api() if vllm_api is None else vllm_api
        if api not in POOL_APIS:
            raise InvalidPoolConfigError(f"vllm_api must be one of {POOL_APIS}, got {vllm_api!r}")
        if api == "0.13" and (lookahead or medium != MEDIUM_GPU):
            raise InvalidPoolConfigError(
                "num_hash_lookahead_tokens and medium are vLLM 0.33's; this pool serves 0.13")
        try:
            objects: list[KVCacheBlock | None] = [None] * num_blocks
        except MemoryError:
            raise InvalidBlockCountError(
                f"num_gpu_blocks={num_gpu_blocks!r}: no memory for that many blocks") from None

        self.num_gpu_blocks = num_blocks
        self.enable_caching = caching
        self.hash_block_size: int = block_size
        self.enable_kv_cache_events = events
        self.metrics_collector = collector
        self.num_hash_lookahead_tokens: int = lookahead
        self.medium: str = medium
        # Which vLLM's pool this is (module docstring, vLLM 0.33): 0.13's code paths never
        # read anything below but this flag.
        self.vllm_api: str = api
        self._v033 = api == "0.33"
        # vLLM 0.33's multi-key blocks: block id -> the keys (hash + group id) it is cached
        # under besides its primary one (partial entries); public, as vLLM's offloading reads it.
        self.cached_block_hashes_by_block: dict[int, set[BlockHashWithGroupId]] = {}
        self._tokens_of: dict[KVCacheBlock, int] = {}  # 0.33: prefix tokens a primary key covers
        # 0.33's unpin_blocks: block id -> the callback to run when the block is reused.
        self._reuse_watchers: dict[int, Callable[[KVCacheBlock], object]] = {}
        # The bound on pending events (None: unbounded); module docstring, Bounded events.
        self.max_pending_kv_events: int | None = event_bound
        self.num_kv_event_collapses = 0
        self._stored_block_sizes: dict[int, int] = {}  # group -> block size of its events
        self._objects = objects
        self.null_block = _new_block(self, 0)
        self.null_block.is_null = True
        self._objects[0] = self.null_block
        self.blocks: Sequence[KVCacheBlock] = _LazyBlocks(self, objects)
        self.free_block_queue = FreeKVCacheBlockQueue.for_pool(1, num_blocks, self._materialize)
        self.cached_block_hash_to_block = BlockHashToBlockMap.for_pool()
        self._groups = self.cached_block_hash_to_block.groups
        self._in_use: set[KVCacheBlock] = set()
        self._shared: set[KVCacheBlock] = set()  # ref >= 2; block.extra_refs = ref - 1
        self._key_of: dict[KVCacheBlock, bytes] = {}  # keyed block -> its block hash
        self._group_of: dict[KVCacheBlock, int] = {}  # keyed block -> its group, if not 0
        # Behind the kv_event_queue property (see there why).
        self._pending_events: list[KVCacheEvent] = []
        # The eviction policy (impl/eviction.py); None is vLLM 0.13's LRU, with no hook
        # called. The clock is the policies' time (advance_clock).
        self._policy: EvictionPolicy | None = eviction_policy
        self._now = 0
        if eviction_policy is not None:
            eviction_policy.attach(self)

    # -- block objects (BlockOwner, PolicyPool) -------------------------------------------

    def _block(self, block_id: int) -> KVCacheBlock:
        return _made_block(self, self._objects, block_id)

    def _materialize(self, first: int, end: int) -> list[KVCacheBlock]:
        chunk = self._objects[first:end]
        if chunk.count(None) == len(chunk):
            made = [_new_block(self, i) for i in range(first, end)]
            self._objects[first:end] = made
            return made
        return [self._block(i) for i in range(first, end)]

    def _ref_count(self, block: KVCacheBlock) -> int:
        if block in self._in_use:
            return block.extra_refs + 1
        return 0

    def _own(self, block: BlockLike) -> KVCacheBlock:
        """``block`` if it is one of this pool's blocks (``BlockNotInPoolError`` otherwise)."""
        if not isinstance(block, KVCacheBlock) or block.owner is not self:
            raise BlockNotInPoolError(f"{block!r} is not a block of this pool")
        return block

    def ref_count(self, block: BlockLike) -> int:
        """The ref count of one of this pool's blocks (what its ``ref_cnt`` reads)."""
        return self._ref_count(self._own(block))

    def block_hash_of(self, block: BlockLike) -> BlockHashWithGroupId | None:
        """The key one of this pool's blocks is cached under (what its ``block_hash``
        reads): its block hash and 4-byte group id, None if it has none."""
        owned = self._own(block)
        block_hash = self._key_of.get(owned)
        if block_hash is None:
            return None
        group_id = self._group_of.get(owned, 0)
        return BlockHashWithGroupId(block_hash + group_id.to_bytes(4, "big"))

    def block_hash_num_tokens_of(self, block: BlockLike) -> int | None:
        """The prefix length its primary key covers, for one of this pool's blocks (vLLM
        0.33's ``block_hash_num_tokens``; a 0.13 pool records none)."""
        return self._tokens_of.get(self._own(block))

    def set_ref_count(self, block: BlockLike, value: SupportsIndex) -> None:
        """``block.ref_cnt = value``: a 0.33 pool takes a new count >= 1 for a block in use
        (0.33's managers add the reference of a copy-on-write pair that way); anything else,
        and anything on a 0.13 pool, is refused (the pool moves its blocks itself)."""
        owned = self._own(block)
        count = value if type(value) is int else as_int(value)
        if self._v033 and count is not None and count >= 1 and owned in self._in_use:
            owned.extra_refs = count - 1
            if count > 1:
                self._shared.add(owned)
            else:
                self._shared.discard(owned)
            return
        super().set_ref_count(block, value)

    @property
    def cached_blocks(self) -> Collection[KVCacheBlock]:
        """The blocks that have a key, as a live read-only view (membership at C speed)."""
        return self._key_of.keys()

    @property
    def blocks_in_use(self) -> AbstractSet[KVCacheBlock]:
        """The blocks of ref count >= 1, as a live read-only view (never the null block)."""
        return self._in_use

    def _check_owned(self, blocks: list[Any]) -> None:
        """Refuse anything in ``blocks`` that is not a block of this pool."""
        try:
            if set(map(_pool_of, blocks)) <= {self}:
                return
        except AttributeError:
            pass
        stranger = next(b for b in blocks if not isinstance(b, KVCacheBlock) or b.owner is not self)
        raise BlockNotInPoolError(f"{stranger!r} is not a block of this pool")

    # -- prefix-cache lookup -------------------------------------------------------------

    def get_cached_block(
        self, block_hash: HashBytes, kv_cache_group_ids: Iterable[SupportsIndex]
    ) -> list[KVCacheBlock] | None:
        """The first block cached under block_hash in each group, or None if any group misses."""
        if type(block_hash) is not bytes:
            raise InvalidBlockHashError(f"block hash must be bytes, got {block_hash!r}")
        group_ids = (kv_cache_group_ids if type(kv_cache_group_ids) is list
                     else _listed(kv_cache_group_ids, "kv_cache_group_ids"))
        groups = self._groups
        found = []
        for group_id in group_ids:
            # Only an int is looked up (1.0 and True would find group 1). A group the pool
            # has is a checked id, so a full hit needs no other check: this runs once per
            # block of every lookup through vLLM's API.
            group = groups.get(group_id) if type(group_id) is int else None
            block = None if group is None else group.get(block_hash)
            if block is None:
                # All of them, also those after the miss; numpy ids are looked up again.
                checked = [_check_group_id(g) for g in group_ids]
                if any(type(g) is not int for g in group_ids):
                    return self.get_cached_block(block_hash, checked)
                return None
            found.append(block)
        return found

    def get_cached_prefix(
        self,
        block_hashes: Sequence[BlockHash] | BlockHashListWithBlockSize,
        kv_cache_group_id: SupportsIndex,
        max_blocks: SupportsIndex,
    ) -> list[KVCacheBlock]:
        """The leading run of ``block_hashes[:max_blocks]`` cached in one group, first block
        under each key: ``get_cached_block`` until the first miss, in one call (kvspec's
        bulk lookup; vLLM 0.13 has none)."""
        limit = _check_count("max_blocks", max_blocks)
        group = self._groups.get(_check_group_id(kv_cache_group_id))
        if group is None:
            group = {}
        if type(block_hashes) is list:
            wanted = block_hashes[:limit]
        else:
            try:
                wanted = list(islice(block_hashes, limit))
            except TypeError:
                raise InvalidBlockHashError(
                    f"block_hashes must be a sequence of bytes, got {block_hashes!r}") from None
        try:
            hit: list[KVCacheBlock] = list(takewhile(truth, map(group.get, wanted)))  # type: ignore[arg-type]
        except TypeError:  # an unhashable "hash" before the first miss
            hit = []
            for block_hash in wanted:
                block = group.get(block_hash) if type(block_hash) is bytes else None
                if block is None:
                    break
                hit.append(block)
        if len(hit) < len(wanted) and type(wanted[len(hit)]) is not bytes:
            raise InvalidBlockHashError(f"block hash must be bytes, got {wanted[len(hit)]!r}")
        return hit

    def cache_full_blocks(
        self,
        request: RequestToCache,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: SupportsIndex,
        num_full_blocks: SupportsIndex,
        block_size: SupportsIndex,
        kv_cache_group_id: SupportsIndex,
        block_mask: Sequence[bool] | None = None,
    ) -> None:
        """Key blocks[num_cached_blocks:num_full_blocks] with the request's chain hashes.

        ``block_mask`` (vLLM 0.33) leaves out the blocks where it is False, as null blocks are.

        Everything is read and checked, and the event built, before the first key is set."""
        first = _check_count("num_cached_blocks", num_cached_blocks)
        end = _check_count("num_full_blocks", num_full_blocks)
        size = block_size if type(block_size) is int else as_int(block_size)
        if size is None or size < 1 or size % self.hash_block_size:
            raise InvalidBlockCountError(
                f"block_size must be a positive multiple of the hash block size "
                f"{self.hash_block_size}, got {block_size!r}")
        group_id = _check_group_id(kv_cache_group_id)
        request_hashes = getattr(request, "block_hashes", None)
        if type(request_hashes) is not list:
            raise InvalidRequestForCachingError(
                f"{request!r} is not a request: it has no list of block hashes")
        if type(blocks) is list:
            block_list: list[KVCacheBlock] = blocks
        elif isinstance(blocks, Sequence):
            block_list = list(blocks)
        else:
            raise InvalidBlockListError(f"blocks must be a list of KVCacheBlock, got {blocks!r}")
        if first >= end:
            return
        if end > len(block_list):
            raise InvalidBlockCountError(
                f"cannot cache blocks [{first}, {end}) of a list of {len(block_list)} blocks")
        new_blocks: list[Any] = block_list[first:end]
        if not _is_subset(new_blocks, self._in_use):  # free, foreign or null blocks
            self._check_owned([b for b in new_blocks if b is not self.null_block])
        if not self.enable_caching:
            return
        hashes: Sequence[BlockHash] | BlockHashListWithBlockSize = request_hashes
        if size != self.hash_block_size:
            hashes = (_view_033(request_hashes, self.hash_block_size, size) if self._v033
                      else BlockHashListWithBlockSize(request_hashes, self.hash_block_size, size))
        if end > len(hashes):
            raise InvalidBlockHashError(
                f"cannot cache blocks [{first}, {end}) with {len(hashes)} block hashes")
        if self._v033:
            self._cache_full_blocks_033(request, block_list, first, end, size, group_id,
                                        hashes, block_mask)
            return
        if block_mask is not None:
            raise InvalidPoolConfigError("block_mask is vLLM 0.33's; this pool serves 0.13")
        new_hashes = hashes[first:end]
        if type(new_hashes) is not list:
            new_hashes = list(new_hashes)
        null = self.null_block
        if null in new_blocks:
            kept = [i for i, b in enumerate(new_blocks) if b is not null]
            new_blocks = [new_blocks[i] for i in kept]
            new_hashes = [new_hashes[i] for i in kept]
        if not new_blocks:
            return
        key_of = self._key_of
        if not key_of.keys().isdisjoint(new_blocks):
            keyed = next(b for b in new_blocks if b in key_of)
            raise BlockAlreadyCachedError(
                f"block {keyed.block_id} already has a key {keyed.block_hash!r}"
            )
        if len(set(new_blocks)) != len(new_blocks):
            raise BlockAlreadyCachedError(
                f"a block appears twice in {[b.block_id for b in new_blocks]}")
        if list(map(type, new_hashes)).count(bytes) != len(new_hashes):
            bad = next(h for h in new_hashes if type(h) is not bytes)
            raise InvalidBlockHashError(f"block hash must be bytes, got {bad!r}")
        stored = None
        if self.enable_kv_cache_events:
            stored = self._stored_event(request, hashes, new_hashes, first, end, size)
        policy = self._policy
        hints = None if policy is None else policy.check_hints(request)
        # Nothing has changed yet; from here on nothing can fail.
        key_of.update(zip(new_blocks, new_hashes, strict=True))
        if group_id:
            self._group_of.update(zip(new_blocks, repeat(group_id)))
        group = self._groups.get(group_id)
        if group is None:
            group = self._groups[group_id] = {}
        num_hashes = len(group)
        if group.keys().isdisjoint(new_hashes):
            group.update(zip(new_hashes, new_blocks, strict=True))
            inserted = len(group) - num_hashes == len(new_blocks)
            if not inserted:  # a hash listed twice: the first of its blocks must stay first
                for block_hash in new_hashes:
                    group.pop(block_hash, None)
        else:
            inserted = False
        if not inserted:
            insert = self.cached_block_hash_to_block.insert_unchecked
            for block_hash, block in zip(new_hashes, new_blocks, strict=True):
                insert(group_id, block_hash, block)
        if stored is not None:
            self.kv_event_queue.append(stored)
            self._stored_block_sizes[group_id] = size
            if self.max_pending_kv_events is not None:
                self._bound_kv_events()
        if hints:
            policy.cached(hints, block_list[first:end], first, size)  # type: ignore[union-attr]

    def _stored_event(
        self, request: object, hashes: Sequence[BlockHash] | BlockHashListWithBlockSize,
        new_hashes: list[BlockHash], first: int, end: int, block_size: int,
    ) -> Any:
        """The ``BlockStored`` event of keying blocks [first, end), or a typed refusal when the
        request's token ids or LoRA cannot make one (checked before anything is keyed)."""
        tokens = getattr(request, "all_token_ids", None)
        try:
            token_ids = list(tokens[first * block_size : end * block_size])  # type: ignore[index]
        except TypeError:
            raise InvalidRequestForCachingError(
                f"the request's all_token_ids must be a sequence of ints, got {tokens!r}"
            ) from None
        if len(token_ids) != (end - first) * block_size or sum(
                1 for t in token_ids if type(t) is int) != len(token_ids):
            raise InvalidRequestForCachingError(
                f"the request's all_token_ids {tokens!r} do not hold "
                f"{(end - first) * block_size} int token ids from {first * block_size}")
        lora = getattr(request, "lora_request", None)
        lora_id = None if lora is None else getattr(lora, "adapter_id", None)
        if lora is not None and type(lora_id) is not int:
            raise InvalidRequestForCachingError(
                f"the request's lora_request {lora!r} has no int adapter_id")
        parent = hashes[first - 1] if first > 0 else None
        return host_types.BlockStored(
            block_hashes=[maybe_convert_block_hash(h) for h in new_hashes],
            parent_block_hash=None if parent is None else maybe_convert_block_hash(parent),
            token_ids=token_ids,
            block_size=block_size,
            lora_id=lora_id,
            medium=MEDIUM_GPU,
        )

    # -- allocation ----------------------------------------------------------------------

    def get_new_blocks(self, num_blocks: SupportsIndex) -> list[KVCacheBlock]:
        """Take num_blocks from the head of the free queue, evicting their keys; ref 0 -> 1."""
        count = num_blocks if type(num_blocks) is int else as_int(num_blocks)
        if count is None or count < 0:
            raise InvalidBlockCountError(
                f"num_blocks must be a non-negative int, got {num_blocks!r}"
            )
        if count > self.free_block_queue.num_free_blocks:
            raise NotEnoughFreeBlocksError(f"Cannot get {count} free blocks from the pool")
        policy = self._policy
        blocks = (self.free_block_queue.take_unchecked(count) if policy is None
                  else policy.take(count))
        if self._reuse_watchers:
            self._notify_reuse(blocks)
        key_of = self._key_of
        if key_of and not key_of.keys().isdisjoint(blocks):
            self._evict_all(list(filter(key_of.__contains__, blocks)))
        collector = self.metrics_collector
        if collector is not None:
            for block in blocks:
                if self.enable_caching:
                    collector.on_block_evicted(block)
                collector.on_block_allocated(block)
        self._in_use.update(blocks)
        return blocks

    def _evict_all(self, keyed: list[KVCacheBlock]) -> None:
        """Drop the keys of keyed blocks (each has one) from the blocks and from the map."""
        if self._v033:
            for block in keyed:
                self._removed_events(self._remove_keys(block))
            if self.enable_kv_cache_events and self.max_pending_kv_events is not None:
                self._bound_kv_events()
            return
        hashes = list(map(self._key_of.pop, keyed))
        if self._policy is not None:
            self._policy.uncached(keyed)
        cache_map, group_of = self.cached_block_hash_to_block, self._group_of
        if group_of or cache_map.later:
            for block_hash, block in zip(hashes, keyed, strict=True):
                cache_map.remove_unchecked(group_of.pop(block, 0), block_hash, block)
        else:  # group 0 only, and every key's one block is the one evicted
            group = self._groups[0]
            for block_hash in hashes:
                del group[block_hash]
        if self.enable_kv_cache_events:
            removed = host_types.BlockRemoved
            self.kv_event_queue.extend(
                removed(block_hashes=[maybe_convert_block_hash(BlockHash(block_hash))],
                        medium=MEDIUM_GPU)
                for block_hash in hashes)
            if self.max_pending_kv_events is not None:
                self._bound_kv_events()

    def _bound_kv_events(self) -> None:
        """Collapse the pending events into a snapshot of the cache, when more than the bound
        are pending and at least twice as many as the snapshot takes (module docstring). The
        snapshot: a clear, then one store per key, the blocks' primary keys in block id order,
        then 0.33's partial entries by block id, each block's in key order."""
        queue = self.kv_event_queue
        pending = len(queue)
        bound = self.max_pending_kv_events
        key_of = self._key_of
        if bound is None or pending <= bound:
            return
        partial = self.cached_block_hashes_by_block
        num_keys = len(key_of) + (sum(map(len, partial.values())) if partial else 0)
        if pending < 2 * (num_keys + 1):
            return
        group_of = self._group_of
        cleared = (self._events_033().AllBlocksCleared if self._v033
                   else host_types.AllBlocksCleared)
        snapshot: list[KVCacheEvent] = [cleared()]
        for block in sorted(key_of, key=_block_id_of):
            snapshot.append(self._snapshot_stored(key_of[block], group_of.get(block, 0)))
        for block_id in sorted(partial):
            for key in sorted(partial[block_id]):
                snapshot.append(self._snapshot_stored(key[:-4], int.from_bytes(key[-4:], "big")))
        queue[:] = snapshot  # in place: a caller may hold the queue
        self.num_kv_event_collapses += 1

    def _snapshot_stored(self, block_hash: bytes, group_id: int) -> KVCacheEvent:
        """A snapshot's store of one key: its hash, no parent, no token ids, its group's block
        size (recorded with the key's first store) and no LoRA; the pool keeps no more."""
        block_size = self._stored_block_sizes.get(group_id, self.hash_block_size)
        external = maybe_convert_block_hash(BlockHash(block_hash))
        if self._v033:
            stored_033: KVCacheEvent = self._events_033().BlockStored(
                block_hashes=[external], parent_block_hash=None, token_ids=[],
                block_size=block_size, lora_id=None, medium=self.medium, lora_name=None,
                group_idx=group_id)
            return stored_033
        stored_013: KVCacheEvent = host_types.BlockStored(
            block_hashes=[external], parent_block_hash=None, token_ids=[],
            block_size=block_size, lora_id=None, medium=MEDIUM_GPU)
        return stored_013

    def touch(
        self, blocks: Sequence[Sequence[KVCacheBlock]] | Sequence[KVCacheBlock]
    ) -> None:
        """A prefix-cache hit: free blocks leave the free queue, every ref count + 1.

        Takes vLLM 0.13's tuple of per-group block lists, or one flat list (0.33).
        """
        items = _listed(blocks, "blocks")
        flat: list[Any]
        if items and not isinstance(items[0], KVCacheBlock):  # per-group lists
            flat = []
            for group in items:
                flat += _listed(group, "each group of blocks")
        else:
            flat = items
        in_use = self._in_use
        if _is_subset(flat, in_use):
            self._share(flat)
        else:  # some are free (or the null block, which is never in use), or strangers
            null = self.null_block
            flat = [b for b in flat if b is not null]
            self._check_owned(flat)
            leaving = [b for b in flat if b not in in_use]
            if len(set(leaving)) == len(leaving):
                self.free_block_queue.remove_unchecked(leaving)
                if len(leaving) < len(flat):
                    self._share([b for b in flat if b in in_use])
                in_use.update(leaving)
            else:
                self._touch_one_by_one(flat)
        if self.metrics_collector is not None:
            for block in flat:
                self.metrics_collector.on_block_accessed(block)

    def _share(self, blocks: list[KVCacheBlock]) -> None:
        """One more reference to each listing of blocks already in use."""
        self._shared.update(blocks)
        for block in blocks:
            block.extra_refs += 1

    def _touch_one_by_one(self, flat: list[KVCacheBlock]) -> None:
        """touch() when a free block is listed twice: the first hit takes it out of the queue."""
        leaving = [b for b in dict.fromkeys(flat) if b not in self._in_use]
        self._check_owned(leaving)
        self.free_block_queue.remove_unchecked(leaving)
        self._in_use.update(leaving)
        rest = list(flat)
        for block in leaving:
            rest.remove(block)
        self._share(rest)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Ref - 1 for each block; blocks reaching 0 go to the free queue's tail in order."""
        blocks: list[Any] = _listed(ordered_blocks, "blocks")
        in_use, shared = self._in_use, self._shared
        if not _is_subset(blocks, in_use):
            null = self.null_block
            blocks = [b for b in blocks if b is not null]
            if self._v033:
                foreign = self._foreign_blocks(blocks)
                if foreign:
                    self._free_and_forward(blocks, foreign)
                    return
            self._check_owned(blocks)
            if not in_use.issuperset(blocks):
                stranger = next(b for b in blocks if b not in in_use)
                raise BlockNotInUseError(f"block {stranger.block_id} is freed with ref count 0")
        if self._policy is not None:
            self._policy.check_free(blocks)
        listed, still_shared = blocks, None
        if shared and not shared.isdisjoint(blocks):
            still_shared = [b for b in blocks if b in shared]
            if len(set(still_shared)) != len(still_shared):
                self._free_one_by_one(listed)
                return
            blocks = [b for b in blocks if b not in shared]
        before = len(in_use)
        in_use.difference_update(blocks)
        if before - len(in_use) != len(blocks):  # a block listed twice
            in_use.update(blocks)
            self._free_one_by_one(listed)
            return
        if still_shared:
            for block in still_shared:
                block.extra_refs -= 1
                if not block.extra_refs:
                    shared.discard(block)
        self._release(blocks)

    def _release(self, zeroed: list[KVCacheBlock]) -> None:
        """Blocks that reached ref 0 (in that order) join the free queue where the policy
        puts them (LRU: the tail)."""
        if self._policy is not None:
            self._policy.freed(zeroed)
        elif not self._v033:
            self.free_block_queue.extend_unchecked(zeroed)
        elif not self.enable_caching:  # vLLM 0.33: every block LIFO (reused first)
            self.free_block_queue.prepend_unchecked(zeroed)
        else:  # vLLM 0.33: unkeyed blocks to the head (LIFO), keyed ones to the tail (LRU)
            key_of = self._key_of
            if key_of.keys().isdisjoint(zeroed):
                self.free_block_queue.prepend_unchecked(zeroed)
            else:
                self.free_block_queue.prepend_unchecked(
                    [b for b in zeroed if b not in key_of])
                self.free_block_queue.extend_unchecked(list(filter(key_of.__contains__, zeroed)))

    def _free_one_by_one(self, blocks: list[KVCacheBlock]) -> None:
        """free_blocks() when a block is listed twice: each listing drops one reference."""
        remaining: dict[KVCacheBlock, int] = {}
        zeroed = []
        for block in blocks:
            refs = remaining[block] if block in remaining else self._ref_count(block)
            if refs == 0:
                raise BlockNotInUseError(f"block {block.block_id} is freed with ref count 0")
            remaining[block] = refs - 1
            if refs == 1:
                zeroed.append(block)
        for block, refs in remaining.items():
            if refs == 0:
                self._in_use.discard(block)
            block.extra_refs = max(refs - 1, 0)
            if refs <= 1:
                self._shared.discard(block)
        self._release(zeroed)

    def evict_blocks(self, block_ids: Iterable[SupportsIndex]) -> None:
        """Drop the keys of the given blocks, in the order the set iterates (as vLLM does);
        ref counts and the free queue stay. Every id is checked before any key goes."""
        ids: list[int] = list(dict.fromkeys(_check_block_ids(block_ids, self.num_gpu_blocks)))
        keyed: list[KVCacheBlock] = []
        for block_id in ids:
            block = self._objects[block_id]
            if block is not None:
                if self.metrics_collector is not None:
                    self.metrics_collector.on_block_evicted(block)
                if block in self._key_of:
                    keyed.append(block)
        if keyed and self._policy is not None:
            self._policy.check_evict(keyed)
        if keyed:  # in one go: the events come in the same order, the bound is checked once
            self._evict_all(keyed)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached key; refused (False) while any block but the null one is in use."""
        num_used = self.num_gpu_blocks - self.get_num_free_blocks()
        if num_used != 1:
            logger.warning(
                "Failed to reset prefix cache because some blocks (%d) are not freed yet",
                num_used - 1,
            )
            return False
        self.cached_block_hash_to_block.clear_unchecked()
        self._key_of.clear()
        self._group_of.clear()
        if self._v033:
            self.cached_block_hashes_by_block.clear()
            self._tokens_of.clear()
            if self._reuse_watchers:
                self._notify_reuse([self._block(i) for i in list(self._reuse_watchers)])
            logger.info("Successfully reset prefix cache")
        if self._policy is not None:
            self._policy.reset()
        if self.metrics_collector is not None:
            self.metrics_collector.reset()
        if self.enable_kv_cache_events:
            cleared = (self._events_033().AllBlocksCleared if self._v033
                       else host_types.AllBlocksCleared)
            self.kv_event_queue.append(cleared())
            if self.max_pending_kv_events is not None:
                self._bound_kv_events()
        return True

    def _check(self) -> None:
        """``check_representation()``, by its former name."""
        self.check_representation()

    def check_representation(self) -> None:
        """The representation invariant, for tests and debugging (O(blocks)); raises an
        ``AssertionError`` naming the broken property. No ``assert``: it runs under -O.

        Ref counts: ``_shared`` is within ``_in_use`` and a block's ``extra_refs`` is
        positive exactly while it is shared. The free queue holds exactly the pool's blocks
        that are not in use, but the null block. Keys: ``_key_of`` and ``_group_of`` list
        exactly the blocks the map holds, each under its own key."""
        queue, in_use, shared = self.free_block_queue, self._in_use, self._shared
        queue.check_representation()
        if not shared <= in_use:
            raise AssertionError(f"block pool: shared blocks not in use: "
                                 f"{sorted(b.block_id for b in shared - in_use)}")
        for block in self._objects:
            if block is None:
                continue
            if block.owner is not self:
                raise AssertionError(f"block pool: block {block.block_id} belongs elsewhere")
            if (block.extra_refs > 0) != (block in shared) or block.extra_refs < 0:
                raise AssertionError(f"block pool: block {block.block_id} has extra refs "
                                     f"{block.extra_refs} but is "
                                     f"{'' if block in shared else 'not '}shared")
        null = self.null_block
        if null in in_use or null in self._key_of:
            raise AssertionError("block pool: the null block is in use or keyed")
        if any(block.owner is not self for block in in_use):
            raise AssertionError("block pool: a block in use belongs to another pool")
        free = queue.get_all_free_blocks()
        free_set = set(free)
        if null in free_set or not free_set.isdisjoint(in_use) or any(
                block.owner is not self for block in free_set):
            raise AssertionError("block pool: the free queue holds the null block, a block in "
                                 "use or another pool's block")
        if len(free) + len(in_use) != self.num_gpu_blocks - 1:
            raise AssertionError(f"block pool: {len(free)} free and {len(in_use)} in use do "
                                 f"not add up to {self.num_gpu_blocks - 1} blocks")
        if not self._group_of.keys() <= self._key_of.keys() or 0 in self._group_of.values():
            raise AssertionError("block pool: _group_of lists a block without a key, or group 0")
        cache_map = self.cached_block_hash_to_block
        by_block = self.cached_block_hashes_by_block
        multi_key = [self._objects[i] for i in by_block if 0 <= i < self.num_gpu_blocks]
        cache_map.check_representation(
            {b for b in multi_key if b is not None} if by_block else ())
        self._check_033_state()
        mapped: dict[KVCacheBlock, bytes] = {}
        for key, blocks in cache_map.items():
            for block in blocks:
                if block.block_id not in by_block or key not in by_block[block.block_id]:
                    mapped[block] = key
        if mapped.keys() != self._key_of.keys():
            raise AssertionError(f"block pool: the map holds blocks "
                                 f"{sorted(b.block_id for b in mapped)} but _key_of keys "
                                 f"{sorted(b.block_id for b in self._key_of)}")
        for block, block_hash in self._key_of.items():
            key = block_hash + self._group_of.get(block, 0).to_bytes(4, "big")
            if mapped[block] != key:
                raise AssertionError(f"block pool: block {block.block_id} is keyed {key!r} but "
                                     f"mapped under {mapped[block]!r}")
        if self._policy is not None:
            self._policy.check()

    # -- eviction policy operations (impl/eviction.py) --------------------------------

    @property
    def eviction_policy(self) -> EvictionPolicy | None:
        return self._policy

    @property
    def clock(self) -> int:
        """The policies' time: what the last advance_clock set (0 at first)."""
        return self._now

    def _policy_blocks(self, block_ids: object, once: bool) -> list[KVCacheBlock]:
        """Block ids read whole and checked (ints in the pool; with ``once``, none listed
        twice: a pin is taken or dropped once) as blocks."""
        listed = _check_block_ids(block_ids, self.num_gpu_blocks)
        if once and len(set(listed)) != len(listed):
            raise PinRefusedError(f"a block is listed twice in {listed}")
        return [self._block(i) for i in listed]

    def _require(self, has: bool, what: str) -> EvictionPolicy:
        policy = self._policy
        if policy is None or not has:
            name = "lru" if policy is None else policy.name
            raise PolicyNotSupportedError(f"the pool's eviction policy {name!r} has no {what}")
        return policy

    def set_retention(self, block_ids: Iterable[SupportsIndex], priority: SupportsIndex,
                      duration: SupportsIndex | None = None) -> None:
        """Give cached blocks a retention priority in [0, 100] (``priority`` policy), that
        reverts to the default ``duration`` after now (None: never); null block skipped."""
        policy = self._require(self._policy is not None and self._policy.has_priorities,
                               "retention priorities")
        _, _, checked_priority, checked_duration = check_retention(0, None, priority, duration)
        blocks = self._policy_blocks(block_ids, once=False)
        null = self.null_block
        for block in blocks:
            if block is not null and block not in self._key_of:
                raise BlockNotCachedError(f"block {block.block_id} has no key: only a cached "
                                          f"block has a retention priority")
        for block in blocks:
            if block is not null:
                policy.set(block, checked_priority, checked_duration)

    def advance_clock(self, now: SupportsIndex) -> None:
        """Time moves to ``now`` (an int, never back): expired priorities revert."""
        time = now if type(now) is int else as_int(now)
        if time is None or time < self._now:
            raise ClockWentBackError(f"the clock is at {self._now}; it cannot go to {now!r}")
        self._now = time
        if self._policy is not None:
            self._policy.advance_clock(time)

    def pin_blocks(self, block_ids: Iterable[SupportsIndex]) -> None:
        """Pin cached blocks (``pinned`` policy): a pinned block holds a reference of the
        pool's, so it is never free and never evicted. Refused over the policy's cap."""
        policy = self._require(self._policy is not None and self._policy.has_pins, "pins")
        blocks = self._policy_blocks(block_ids, once=True)
        pinned = policy.pinned
        for block in blocks:
            if block in pinned:
                raise PinRefusedError(f"block {block.block_id} is already pinned")
            if block not in self._key_of:
                raise BlockNotCachedError(
                    f"block {block.block_id} has no key: only a cached block can be pinned")
        cap = policy.cap
        if len(pinned) + len(blocks) > cap:
            raise PinRefusedError(f"pinning {len(blocks)} more blocks would pin "
                                  f"{len(pinned) + len(blocks)}, over the cap of {cap}")
        self.touch(blocks)
        pinned.update(blocks)

    def unpin_blocks(self, block_ids: Iterable[Any],
                     on_reuse: Callable[[KVCacheBlock], object] | None = None) -> None:
        """Drop pins: each releases its reference (a block reaching 0 becomes free).

        With ``on_reuse``, vLLM 0.33's ``unpin_blocks(blocks, on_reuse)`` instead: blocks (not
        ids) drop a reference, those reaching 0 join the tail of the free queue while they
        stay readable, and ``on_reuse(block)`` runs when the pool hands the block out again
        or the prefix cache is reset."""
        if on_reuse is not None:
            self._unpin_watched(block_ids, on_reuse)
            return
        policy = self._require(self._policy is not None and self._policy.has_pins, "pins")
        blocks = self._policy_blocks(block_ids, once=True)
        pinned = policy.pinned
        for block in blocks:
            if block not in pinned:
                raise BlockNotPinnedError(f"block {block.block_id} is not pinned")
        pinned.difference_update(blocks)
        self.free_blocks(blocks)

    # -- vLLM 0.33's pool operations (vllm_api="0.33"; module docstring) -----------------

    def _check_033_state(self) -> None:
        """The 0.33 part of the representation invariant: partial entries and token counts
        belong to keyed blocks only (a partial key never outlives its block's primary key),
        watchers to blocks of the pool, and a 0.13 pool has none of them."""
        if not self._v033 and (self.cached_block_hashes_by_block or self._tokens_of
                               or self._reuse_watchers):
            raise AssertionError("block pool: 0.33 state in a vLLM 0.13 pool")
        for block_id, keys in self.cached_block_hashes_by_block.items():
            block = self._objects[block_id] if 0 <= block_id < self.num_gpu_blocks else None
            if block is None or block not in self._key_of or not keys:
                raise AssertionError(f"block pool: partial keys of block {block_id}, which "
                                     f"has no primary key")
            for key in keys:
                block_hash, group_id = key[:-4], int.from_bytes(key[-4:], "big")
                if not any(b is block for b in
                           self.cached_block_hash_to_block._blocks(group_id, block_hash)):
                    raise AssertionError(f"block pool: partial key {key!r} of block "
                                         f"{block_id} is not in the map")
        if not self._tokens_of.keys() <= self._key_of.keys():
            raise AssertionError("block pool: a token count for a block without a key")
        if any(not 0 < i < self.num_gpu_blocks for i in self._reuse_watchers):
            raise AssertionError("block pool: a reuse watcher on a block outside the pool")

    def _require_033(self, operation: str) -> None:
        if not self._v033:
            raise PolicyNotSupportedError(f"{operation} is vLLM 0.33's; this pool serves 0.13")
        if self._policy is not None:
            raise PolicyNotSupportedError(
                f"{operation} moves keys between blocks, which the pool's eviction policy "
                f"{self._policy.name!r} does not follow")

    def _remove_keys(self, block: KVCacheBlock) -> list[tuple[int, bytes]]:
        """Drop every key of ``block`` (its primary key, then its partial entries) from the
        block and the map; returns them as (group id, block hash)."""
        block_hash = self._key_of.pop(block, None)
        if block_hash is None:
            return []
        group_id = self._group_of.pop(block, 0)
        self._tokens_of.pop(block, None)
        cache_map = self.cached_block_hash_to_block
        cache_map.remove_unchecked(group_id, block_hash, block)
        removed = [(group_id, block_hash)]
        extra = (self.cached_block_hashes_by_block.pop(block.block_id, None)
                 if self.cached_block_hashes_by_block else None)
        if extra:
            for key in extra:
                other_hash, other_group = key[:-4], int.from_bytes(key[-4:], "big")
                cache_map.remove_unchecked(other_group, other_hash, block)
                removed.append((other_group, other_hash))
        if self._policy is not None:
            self._policy.uncached([block])
        return removed

    def _events_033(self) -> Any:
        """The classes of 0.33's events: vLLM's own inside vLLM 0.33 (``host_types``), else
        impl's map-encoded 0.33 family (``kv_events.event_classes``): next to vLLM 0.13 the
        host's classes lack 0.33's fields, so a pool serving 0.33's API uses impl's."""
        if host_types.bound_to() == "vllm" and host_profile.current().profile == "vllm-0.33":
            return _VllmEvents(host_types.BlockStored, host_types.BlockRemoved,
                               host_types.AllBlocksCleared)
        return event_classes("vllm-0.33")

    def _removed_events(self, removed: list[tuple[int, bytes]]) -> None:
        """One 0.33 ``BlockRemoved`` per key, with its group."""
        if not self.enable_kv_cache_events or not removed:
            return
        event, medium = self._events_033().BlockRemoved, self.medium
        self.kv_event_queue.extend(
            event(block_hashes=[maybe_convert_block_hash(BlockHash(block_hash))],
                  medium=medium, group_idx=group_id)
            for group_id, block_hash in removed)
        # Not bounded here: the operation that removed the keys bounds once at its end, when
        # its keys are in place (a snapshot taken midway would miss them).

    def _insert_key(self, group_id: int, block_hash: bytes, block: KVCacheBlock,
                    num_tokens: int | None) -> None:
        """Cache ``block`` under the key: its primary key (with ``num_tokens``) if it has none,
        else a partial entry; nothing when it is already cached under it."""
        primary = self._key_of.get(block)
        if primary is None:
            self._key_of[block] = block_hash
            if group_id:
                self._group_of[block] = group_id
            if num_tokens is not None:
                self._tokens_of[block] = num_tokens
        else:
            if primary == block_hash and self._group_of.get(block, 0) == group_id:
                return
            key = BlockHashWithGroupId(block_hash + group_id.to_bytes(4, "big"))
            extra = self.cached_block_hashes_by_block.get(block.block_id)
            if extra is None:
                self.cached_block_hashes_by_block[block.block_id] = {key}
            elif key in extra:
                return
            else:
                extra.add(key)
        self.cached_block_hash_to_block.insert_unchecked(group_id, block_hash, block)

    def _insert_block_hash(self, block_hash_with_group_id: HashBytes, block: BlockLike,
                           num_tokens: SupportsIndex | None) -> None:
        """vLLM 0.33's name, which its CPU-offloading manager calls: cache ``block`` under the
        key (primary key or partial entry), no event."""
        self._require_033("_insert_block_hash")
        block_hash, group_id = _split_key(block_hash_with_group_id)
        owned = self._own(block)
        if owned is self.null_block:
            raise BlockNotInPoolError("the null block is never cached")
        tokens = None if num_tokens is None else _check_count("num_tokens", num_tokens)
        self._insert_key(_check_group_id(group_id), block_hash, owned, tokens)

    def _maybe_evict_cached_block(self, block: BlockLike) -> bool:
        """vLLM 0.33's name, which its Mamba manager calls: drop every key of ``block`` (with
        their events); whether it had any."""
        owned = self._own(block)
        if self.metrics_collector is not None:
            self.metrics_collector.on_block_evicted(owned)
        removed = self._remove_keys(owned)
        self._removed_events(removed)
        if removed and self.enable_kv_cache_events and self.max_pending_kv_events is not None:
            self._bound_kv_events()
        return bool(removed)

    def _notify_reuse(self, blocks: Iterable[KVCacheBlock]) -> None:
        watchers = self._reuse_watchers
        for block in blocks:
            watcher = watchers.pop(block.block_id, None)
            if watcher is not None:
                watcher(block)

    def _foreign_blocks(self, blocks: list[Any]) -> dict[Any, list[Any]]:
        """vLLM 0.33: the blocks another pool owns, by pool (a null block of any pool is
        skipped). Empty when all are this pool's, the common case."""
        foreign: dict[Any, list[Any]] = {}
        for block in blocks:
            pool = getattr(block, "pool", None)
            if pool is not None and pool is not self and callable(
                    getattr(pool, "free_blocks", None)):
                foreign.setdefault(pool, []).append(block)
        return foreign

    def _free_and_forward(self, blocks: list[Any], foreign: dict[Any, list[Any]]) -> None:
        """free_blocks() with other pools' blocks: this pool's first, then each other pool's
        list, forwarded to it in order (vLLM 0.33's multi-pool deferred frees)."""
        strangers = {id(b) for listed in foreign.values() for b in listed}
        own = [b for b in blocks if id(b) not in strangers
               and getattr(b, "is_null", False) is not True]
        self.free_blocks(own)
        for pool, listed in foreign.items():
            pool.free_blocks([b for b in listed if getattr(b, "is_null", False) is not True])

    def _unpin_watched(self, blocks: Iterable[Any],
                       on_reuse: Callable[[KVCacheBlock], object]) -> None:
        """vLLM 0.33's unpin_blocks(blocks, on_reuse) (see unpin_blocks)."""
        listed: list[Any] = _listed(blocks, "blocks")
        if not callable(on_reuse):
            raise InvalidPoolConfigError(f"on_reuse must be callable, got {on_reuse!r}")
        self._check_owned(listed)
        counts: dict[KVCacheBlock, int] = {}
        for block in listed:
            counts[block] = counts.get(block, 0) + 1
        for block, times in counts.items():
            if block is self.null_block or self._ref_count(block) < times:
                raise BlockNotInUseError(f"block {block.block_id} is unpinned with ref count "
                                         f"{self._ref_count(block)}")
        released = []
        in_use, shared, watchers = self._in_use, self._shared, self._reuse_watchers
        for block in listed:
            if block.extra_refs:
                block.extra_refs -= 1
                if not block.extra_refs:
                    shared.discard(block)
            else:
                in_use.discard(block)
                released.append(block)
            watchers[block.block_id] = on_reuse
        if self._policy is not None:
            self._policy.freed(released)
        else:
            self.free_block_queue.extend_unchecked(released)

    def is_block_writable(self, block: BlockLike) -> bool:
        """vLLM 0.33: whether its sole owner may write the block (ref count 1, no key)."""
        if block is self.null_block:
            return False
        owned = self._own(block)
        return self._ref_count(owned) == 1 and owned not in self._key_of

    def move_block_hashes(self, src_block: BlockLike, dst_block: BlockLike) -> None:
        """vLLM 0.33's copy-on-write: every key of ``src_block`` moves to ``dst_block`` (the
        private copy), which has none; the entries stay live and no event is sent."""
        self._require_033("move_block_hashes")
        src, dst = self._own(src_block), self._own(dst_block)
        null = self.null_block
        if src is null or dst is null:
            raise BlockNotInPoolError("the null block holds no keys")
        if dst in self._key_of or dst.block_id in self.cached_block_hashes_by_block:
            raise BlockAlreadyCachedError(
                f"block {dst.block_id} already has a key {dst.block_hash!r}")
        num_tokens = self._tokens_of.get(src)
        for group_id, block_hash in self._remove_keys(src):
            self._insert_key(group_id, block_hash, dst, num_tokens)

    def _event_keys(self, request: Any, start: int, end: int, mm_idx: int
                    ) -> tuple[tuple[Any, ...] | None, int]:
        """The tagged extra keys of tokens [start, end) for an event (with the lookahead
        tokens when the pool hashes them) and the next block's multimodal index."""
        lookahead = self.num_hash_lookahead_tokens
        if not lookahead:
            return generate_block_hash_extra_keys(request, start, end, mm_idx)
        keys, next_idx = generate_block_hash_extra_keys(request, start, end + lookahead, mm_idx)
        features = request.mm_features
        while next_idx > 0:  # rewind to the features that reach into the next block
            position = features[next_idx - 1].mm_position
            if position.offset + position.length <= end:
                break
            next_idx -= 1
        return keys, next_idx

    def _stored_event_033(self, request: Any, block_hashes: list[Any], parent: Any,
                          start: int, end: int, block_size: int, group_id: int,
                          extra_keys: list[tuple[Any, ...] | None],
                          lookahead_token_ids: list[list[int]] | None) -> Any:
        """vLLM 0.33's ``BlockStored``, with its optional fields."""
        lora = request.lora_request
        return self._events_033().BlockStored(
            block_hashes=block_hashes,
            parent_block_hash=parent,
            token_ids=list(request.all_token_ids[start:end]),
            block_size=block_size,
            lora_id=None if lora is None else lora.adapter_id,
            medium=self.medium,
            lora_name=None if lora is None else lora.name,
            extra_keys=_event_extra_keys(extra_keys),
            group_idx=group_id,
            session_id=getattr(request, "session_id", None),
            lookahead_token_ids=lookahead_token_ids,
        )

    def _lookahead_ids(self, request: Any, end: int) -> list[int]:
        return list(request.all_token_ids[end : end + self.num_hash_lookahead_tokens])

    def _cache_full_blocks_033(
        self, request: Any, block_list: list[Any], first: int, end: int, size: int,
        group_id: int, hashes: Sequence[BlockHash] | BlockHashListWithBlockSize,
        block_mask: Sequence[bool] | None,
    ) -> None:
        """cache_full_blocks() of a 0.33 pool: null and masked-out blocks skipped, a block
        keyed by a shorter (partial) prefix promoted to its full key, 0.33's events."""
        new_blocks = block_list[first:end]
        if block_mask is not None:
            mask = _listed(block_mask, "block_mask")
            if len(mask) != len(new_blocks):
                raise InvalidBlockListError(f"block_mask has {len(mask)} entries for "
                                            f"{len(new_blocks)} blocks")
        null = self.null_block
        kept = [i for i, b in enumerate(new_blocks)
                if b is not null and (block_mask is None or mask[i])]
        key_of, tokens_of = self._key_of, self._tokens_of
        # Read as objects: the compiled build would unbox a non-bytes entry with a TypeError.
        raw_hashes: Any = hashes
        seen: set[KVCacheBlock] = set()
        for i in kept:
            block = new_blocks[i]
            if block in seen:
                raise BlockAlreadyCachedError(f"block {block.block_id} appears twice")
            seen.add(block)
            if block in key_of:
                covered = tokens_of.get(block)
                if covered is None or covered >= (first + i + 1) * size:
                    raise BlockAlreadyCachedError(
                        f"block {block.block_id} already has a key {block.block_hash!r}")
            if type(raw_hashes[first + i]) is not bytes:
                raise InvalidBlockHashError(f"block hash must be bytes, got "
                                            f"{raw_hashes[first + i]!r}")
        if not kept and not self.enable_kv_cache_events:
            return
        # With events on, a range of only null (or masked-out) blocks still reports an empty
        # BlockStored, as vLLM 0.33's cache_full_blocks does (docs/findings.md, D2).
        stored = None
        if self.enable_kv_cache_events:
            extra_keys: list[tuple[Any, ...] | None] = []
            lookahead: list[list[int]] | None = [] if self.num_hash_lookahead_tokens else None
            mm_idx = 0
            for i in kept:
                start = (first + i) * size
                keys, mm_idx = self._event_keys(request, start, start + size, mm_idx)
                extra_keys.append(keys)
                if lookahead is not None:
                    lookahead.append(self._lookahead_ids(request, start + size))
            parent = None if first == 0 else maybe_convert_block_hash(hashes[first - 1])
            stored = self._stored_event_033(
                request, [maybe_convert_block_hash(hashes[first + i]) for i in kept], parent,
                first * size, end * size, size, group_id, extra_keys, lookahead)
        policy = self._policy
        hints = None if policy is None else policy.check_hints(request)
        # Nothing has changed yet; from here on nothing can fail.
        for i in kept:
            block = new_blocks[i]
            if block in key_of:  # a partial entry's block, now full: its keys go first
                self._removed_events(self._remove_keys(block))
            self._insert_key(group_id, hashes[first + i], block, (first + i + 1) * size)
        if stored is not None:
            self.kv_event_queue.append(stored)
            self._stored_block_sizes[group_id] = size
            if self.max_pending_kv_events is not None:
                self._bound_kv_events()
        if hints:  # the request's retention hints, as in 0.13's path
            policy.cached(hints, block_list[first:end], first, size)  # type: ignore[union-attr]

    def emit_cached_block_events(self, request: RequestToCache, num_cached_blocks: SupportsIndex,
                                 block_size: SupportsIndex, kv_cache_group_id: SupportsIndex
                                 ) -> None:
        """vLLM 0.33's "full" report mode: one ``BlockStored`` for the request's first
        ``num_cached_blocks`` blocks, hit in the prefix cache; the pool does not change."""
        count = _check_count("num_cached_blocks", num_cached_blocks)
        size = _check_count("block_size", block_size, 1)
        group_id = _check_group_id(kv_cache_group_id)
        if not self.enable_kv_cache_events or count == 0:
            return
        request_hashes = list(getattr(request, "block_hashes", ()))
        hashes: Sequence[BlockHash] = request_hashes
        if size != self.hash_block_size:
            hashes = _view_033(request_hashes, self.hash_block_size, size)
        if count > len(hashes):
            raise InvalidBlockHashError(
                f"cannot report {count} cached blocks with {len(hashes)} block hashes")
        extra_keys: list[tuple[Any, ...] | None] = []
        lookahead: list[list[int]] | None = [] if self.num_hash_lookahead_tokens else None
        mm_idx = 0
        for i in range(count):
            keys, mm_idx = self._event_keys(request, i * size, (i + 1) * size, mm_idx)
            extra_keys.append(keys)
            if lookahead is not None:
                lookahead.append(self._lookahead_ids(request, (i + 1) * size))
        self.kv_event_queue.append(self._stored_event_033(
            request, [maybe_convert_block_hash(hashes[i]) for i in range(count)], None, 0,
            count * size, size, group_id, extra_keys, lookahead))
        if self.max_pending_kv_events is not None:
            self._bound_kv_events()

    def cache_partial_block(
        self,
        request: RequestToCache,
        block: BlockLike,
        num_tokens: SupportsIndex,
        kv_cache_group_id: SupportsIndex,
        block_size: SupportsIndex,
        replace_existing_hashes: Flag = False,
    ) -> BlockHashWithGroupId | None:
        """vLLM 0.33: make ``block`` reachable from the prefix of ``num_tokens`` tokens (a
        multiple of the hash block size), the request's chain hash there: its primary key if
        it has none, else a partial entry. A block keyed by a shorter prefix, or every key
        with ``replace_existing_hashes``, loses its keys first. Returns the key (None for the
        null block)."""
        self._require_033("cache_partial_block")
        if block is self.null_block:
            return None
        owned = self._own(block)
        tokens = _check_count("num_tokens", num_tokens, 1)
        size = _check_count("block_size", block_size, 1)
        group_id = _check_group_id(kv_cache_group_id)
        replace = _flag("replace_existing_hashes", replace_existing_hashes)
        unit = self.hash_block_size
        request_hashes = getattr(request, "block_hashes", None)
        if type(request_hashes) is not list:
            raise InvalidRequestForCachingError(
                f"{request!r} is not a request: it has no list of block hashes")
        if size % unit or tokens % unit or tokens // unit > len(request_hashes):
            raise InvalidBlockCountError(
                f"num_tokens {tokens} and block_size {size} must be multiples of the hash "
                f"block size {unit}, within the request's {len(request_hashes)} hashes")
        num_hash_blocks = tokens // unit
        block_hash = request_hashes[num_hash_blocks - 1]
        if type(block_hash) is not bytes:
            raise InvalidBlockHashError(f"block hash must be bytes, got {block_hash!r}")
        key = BlockHashWithGroupId(block_hash + group_id.to_bytes(4, "big"))
        primary = self._key_of.get(owned)
        extra = self.cached_block_hashes_by_block.get(owned.block_id, ())
        already = (primary == block_hash and self._group_of.get(owned, 0) == group_id) or (
            key in extra)
        stored = None
        if self.enable_kv_cache_events and (replace or not already):
            start = (num_hash_blocks - 1) * unit
            parent = request_hashes[num_hash_blocks - 2] if num_hash_blocks > 1 else None
            mm_idx = 0
            features = request.mm_features if hasattr(request, "mm_features") else None
            if start > 0 and features:
                mm_idx = _first_mm_feature_ending_after(features, start)
            keys, _ = self._event_keys(request, start, tokens, mm_idx)
            stored = self._stored_event_033(
                request, [maybe_convert_block_hash(BlockHash(block_hash))],
                None if parent is None else maybe_convert_block_hash(parent), start, tokens,
                tokens - start, group_id, [keys],
                [self._lookahead_ids(request, tokens)] if self.num_hash_lookahead_tokens
                else None)
        # Nothing has changed yet; from here on nothing can fail.
        covered = self._tokens_of.get(owned)
        if replace or (not already and primary is not None and covered is not None
                       and covered < tokens):
            self._removed_events(self._remove_keys(owned))
        self._insert_key(group_id, block_hash, owned, tokens)
        if stored is not None:
            self.kv_event_queue.append(stored)
            # The group's block size, for a snapshot's BlockStored of this key (a group whose
            # keys are all partial entries has stored no full block to take it from).
            self._stored_block_sizes[group_id] = size
        if self.enable_kv_cache_events and self.max_pending_kv_events is not None:
            self._bound_kv_events()
        return key

    # -- accounting ----------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        total = self.num_gpu_blocks - 1
        if total == 0:
            return 0.0
        return 1.0 - self.free_block_queue.num_free_blocks / total

    @property
    def kv_event_queue(self) -> list[KVCacheEvent]:
        """The events not yet taken (``take_events``), oldest first.

        A property, not a plain attribute, because vLLM 0.33's hisparse host pool
        (``SharedEventQueueBlockPool`` in vllm/v1/hisparse/block_pool.py) subclasses the pool
        and overrides ``kv_event_queue`` to publish into its owner's queue: compiled code
        reads a plain attribute's slot directly, past a subclass's property, while a
        property's getter is dispatched to the subclass's."""
        return self._pending_events

    @kv_event_queue.setter
    def kv_event_queue(self, events: list[KVCacheEvent]) -> None:
        self._pending_events = events

    def take_events(self) -> list[KVCacheEvent]:
        if not self.enable_kv_cache_events:
            return []
        events, self.kv_event_queue = self.kv_event_queue, []
        return events
