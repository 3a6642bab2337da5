"""BlockPool: vLLM 0.13's block pool API, laid out for batch moves (spec: spec/pool.py).

Two releases, two classes
-------------------------
``BlockPool`` here is vLLM 0.13's pool. vLLM 0.33's is ``BlockPool033``
(impl/block_pool_033.py), a subclass that overrides what 0.33 does differently (the free
order, partial prefix-cache entries, reuse watchers, copy-on-write moves, 0.33's events) and
keeps 0.33's state; this class holds none of it and its hot paths test no version. The
constructor chooses, as vLLM's callers build pools by this name: ``BlockPool(...,
vllm_api="0.33")``, or ``BlockPool(...)`` where ``default_pool_api()`` is "0.33" (inside a vLLM
0.33 process), builds a ``BlockPool033`` (``pool_class_for``). A subclass of this class asked
for 0.33 gets itself over ``BlockPool033``: its own methods first, then 0.33's (vLLM 0.33's
hisparse host pool subclasses the pool it imports by this name, and takes 0.33's behaviour).

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

import importlib
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import islice, repeat, takewhile
from operator import attrgetter, truth
from typing import TYPE_CHECKING, Any, Protocol, SupportsIndex, overload

from mypy_extensions import mypyc_attr

from kvspec.impl import host_profile, host_types
from kvspec.impl.checks import BlockLike, Flag, HashBytes, Text, as_int, check_flag
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
    maybe_convert_block_hash,
)
from kvspec.impl.kv_cache_metrics import MetricsCollectorLike
from kvspec.impl.kv_cache_utils import BlockOwner, FreeKVCacheBlockQueue, KVCacheBlock
from kvspec.impl.kv_events import MEDIUM_GPU, KVCacheEvent

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


# vLLM 0.33's pool, BlockPool033, subclasses BlockPool in kvspec.impl.block_pool_033, which
# imports this module: so this module names it by its path and imports it when the first 0.33
# pool is built (never at import, which would be an import circle).
POOL_033_CLASS = ("kvspec.impl.block_pool_033", "BlockPool033")
_pool_033: list[type[BlockPool]] = []
# A subclass of BlockPool asked for 0.33 -> that subclass over BlockPool033 (pool_class_for).
_over_033: dict[type[BlockPool], type[BlockPool]] = {}


def pool_033_class() -> type[BlockPool]:
    """vLLM 0.33's pool class, ``kvspec.impl.block_pool_033.BlockPool033``."""
    if not _pool_033:
        module, name = POOL_033_CLASS
        _pool_033.append(getattr(importlib.import_module(module), name))
    return _pool_033[0]


def pool_class_for(cls: object, vllm_api: object) -> type[BlockPool]:
    """The class ``cls(..., vllm_api=vllm_api)`` builds (``BlockPool.__new__``), ``cls`` a
    subclass of ``BlockPool``: ``cls`` itself, but for vLLM 0.33's API (``vllm_api``, or
    ``default_pool_api()`` without it): ``BlockPool`` gives ``BlockPool033``, and another
    subclass of ``BlockPool`` that is not one of ``BlockPool033`` gives itself over
    ``BlockPool033`` (one class per subclass, made once, with its name): its own methods
    first, then 0.33's. A value that is not one of ``POOL_APIS`` gives ``cls``, whose
    ``__init__`` refuses it."""
    if not (isinstance(cls, type) and issubclass(cls, BlockPool)):
        raise InvalidPoolConfigError(f"{cls!r} is not a subclass of BlockPool")
    api = default_pool_api() if vllm_api is None else vllm_api
    if api != "0.33":
        return cls
    served = pool_033_class()
    if issubclass(cls, served):
        return cls
    if cls is BlockPool:
        return served
    over = _over_033.get(cls)
    if over is None:
        # Named as the subclass; read with getattr, as mypyc reads no class object's __doc__.
        names = {name: getattr(cls, name) for name in ("__module__", "__qualname__", "__doc__")}
        over = _over_033[cls] = type(cls.__name__, (cls, served), names)
    return over


_GROUP_ID_SUFFIXES = tuple(gid.to_bytes(4, "big") for gid in range(256))
_GROUP_0 = _GROUP_ID_SUFFIXES[0]
_pool_of = attrgetter("owner")
_block_id_of = attrgetter("block_id")


def new_pool(*args: Any, **kwargs: Any) -> BlockPool:
    """``BlockPool(*args, **kwargs)``, as compiled code must build a pool. mypyc (2.4) compiles
    a direct ``BlockPool(...)`` call of compiled code into a constructor that runs ``__new__``
    and then runs ``__init__`` only when ``__new__`` gave a ``BlockPool`` itself (not when it
    gave vLLM 0.33's pool), ignoring a refusal it raises. Called as a plain object, the class
    is called as Python calls it (``type.__call__``). tests/test_block_pool.py checks that no
    compiled module calls the classes directly."""
    pool_class: Any = BlockPool
    pool: BlockPool = pool_class(*args, **kwargs)
    return pool


def check_group_id(group_id: object) -> int:
    """A group id: an integer (``as_int``) in [0, 2**32)."""
    checked = group_id if type(group_id) is int else as_int(group_id)
    if checked is None or not 0 <= checked < 2**32:
        raise InvalidBlockHashError(f"group id must be an int in [0, 2**32), got {group_id!r}")
    return checked


def check_block_count(name: str, value: object, low: int = 0) -> int:
    """A count argument of the pool's (blocks, or tokens): an integer (``as_int``) >= ``low``;
    ``InvalidBlockCountError`` naming it otherwise."""
    count = value if type(value) is int else as_int(value)
    if count is None or count < low:
        raise InvalidBlockCountError(f"{name} must be an int >= {low}, got {value!r}")
    return count


def _check_block_ids(block_ids: object, size: int) -> list[int]:
    """Block ids read whole (``as_list``) and checked: integers (``as_int``) in the pool."""
    ids: list[int] = []
    for given in as_list(block_ids, "block_ids"):
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


def as_list(values: object, what: str) -> list[Any]:
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


def check_lookahead(value: object) -> int:
    """``num_hash_lookahead_tokens``: an integer (``as_int``) >= 0; vLLM 0.33's managers pass
    their use_eagle flag there (True: one lookahead token)."""
    lookahead = int(value) if type(value) is bool else as_int(value)
    if lookahead is None or lookahead < 0:
        raise InvalidPoolConfigError(
            f"num_hash_lookahead_tokens must be an int >= 0, got {value!r}")
    return lookahead


def check_medium(value: object) -> str:
    """``medium``: a str."""
    if type(value) is not str:
        raise InvalidPoolConfigError(f"medium must be a str, got {value!r}")
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


def split_key(key: object) -> tuple[bytes, int]:
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
        block_hash, group_id = split_key(key)
        group = self.groups.get(group_id)
        return None if group is None else group.get(block_hash)

    def insert(self, key: HashBytes, block: BlockLike) -> None:
        self._refuse_for_pool("insert")
        block_hash, group_id = split_key(key)
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
        block_hash, group_id = split_key(key)
        checked_id = block_id if type(block_id) is int else as_int(block_id)
        if checked_id is None:
            raise BlockNotInPoolError(f"block id must be an int, got {block_id!r}")
        for block in self.blocks_under(group_id, block_hash):
            if block.block_id == checked_id:
                self.remove_unchecked(group_id, block_hash, block)
                return block
        return None

    def contain(self, key: HashBytes, block_id: SupportsIndex) -> bool:
        """vLLM 0.33: whether ``block_id`` is among the blocks cached under ``key``."""
        block_hash, group_id = split_key(key)
        checked_id = block_id if type(block_id) is int else as_int(block_id)
        if checked_id is None:
            raise BlockNotInPoolError(f"block id must be an int, got {block_id!r}")
        return any(b.block_id == checked_id for b in self.blocks_under(group_id, block_hash))

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
                yield block_hash + suffix, self.blocks_under(group_id, block_hash)

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

    def blocks_under(self, group_id: int, block_hash: bytes) -> list[KVCacheBlock]:
        """The blocks cached under the key (its parts), first inserted first."""
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

    vLLM 0.13's; ``BlockPool(..., vllm_api="0.33")`` builds vLLM 0.33's, ``BlockPool033``
    (module docstring). It implements ``BlockOwner`` (what its blocks read of it) and
    ``PolicyPool`` (what its eviction policy reads of it, impl/eviction.py)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> BlockPool:
        """An instance of ``pool_class_for(cls, vllm_api)``: of ``cls``, or of vLLM 0.33's pool
        where 0.33's API is asked for (``vllm_api`` or the default); its ``__init__`` then
        runs with the same arguments, as Python runs that of any instance of ``cls``."""
        target = pool_class_for(cls, kwargs.get("vllm_api"))
        if target is cls:
            return super().__new__(cls)
        return target.__new__(target, *args, **kwargs)

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
        caching = check_flag("enable_caching", enable_caching, InvalidPoolConfigError)
        events = check_flag("enable_kv_cache_events", enable_kv_cache_events,
                            InvalidPoolConfigError)
        collector = _collector(metrics_collector)
        event_bound = _event_bound(max_pending_kv_events)
        if eviction_policy is not None and not isinstance(eviction_policy, EvictionPolicy):
            raise InvalidPoolConfigError(
                f"eviction_policy must be None or an EvictionPolicy, got {eviction_policy!r}")
        # vLLM 0.33's settings, checked here for both classes (BlockPool033 keeps them).
        lookahead = check_lookahead(num_hash_lookahead_tokens)
        check_medium(medium)
        api = default_pool_api() if vllm_api is None else vllm_api
        if api not in POOL_APIS:
            raise InvalidPoolConfigError(f"vllm_api must be one of {POOL_APIS}, got {vllm_api!r}")
        served = self._pool_api()
        if api != served:  # BlockPool033(..., vllm_api="0.13"), say
            raise InvalidPoolConfigError(
                f"{type(self).__name__} serves vLLM {served}'s pool API, not vllm_api={api!r}: "
                f"BlockPool(..., vllm_api={api!r}) builds that pool")
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
        self.vllm_api: str = api  # which vLLM's pool API this is (POOL_APIS)
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

    def _pool_api(self) -> str:
        """The vLLM pool API this class serves (``POOL_APIS``); ``BlockPool033``'s is 0.33."""
        return "0.13"

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
        0.33's ``block_hash_num_tokens``): None, as a 0.13 pool records none."""
        self._own(block)
        return None

    def set_ref_count(self, block: BlockLike, value: SupportsIndex) -> None:
        """``block.ref_cnt = value`` on one of this pool's blocks: refused, as the pool moves
        its blocks itself (vLLM 0.33's pool takes what 0.33's managers write)."""
        self._own(block)
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
                     else as_list(kv_cache_group_ids, "kv_cache_group_ids"))
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
                checked = [check_group_id(g) for g in group_ids]
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
        limit = check_block_count("max_blocks", max_blocks)
        group = self._groups.get(check_group_id(kv_cache_group_id))
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
        first = check_block_count("num_cached_blocks", num_cached_blocks)
        end = check_block_count("num_full_blocks", num_full_blocks)
        size = block_size if type(block_size) is int else as_int(block_size)
        if size is None or size < 1 or size % self.hash_block_size:
            raise InvalidBlockCountError(
                f"block_size must be a positive multiple of the hash block size "
                f"{self.hash_block_size}, got {block_size!r}")
        group_id = check_group_id(kv_cache_group_id)
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
        self._cache_blocks(request, request_hashes, block_list, new_blocks, first, end, size,
                           group_id, block_mask)

    def _cache_blocks(
        self, request: Any, request_hashes: list[Any], block_list: list[KVCacheBlock],
        new_blocks: list[Any], first: int, end: int, size: int, group_id: int,
        block_mask: Sequence[bool] | None,
    ) -> None:
        """cache_full_blocks() once its arguments are checked and caching is on: key
        ``new_blocks`` (``block_list[first:end]``, each in use, or the null block) with the
        request's hashes at block size ``size``; vLLM 0.13's way (``BlockPool033`` overrides
        it). The request's hashes are read, and the event built, before the first key is set."""
        hashes: Sequence[BlockHash] | BlockHashListWithBlockSize = request_hashes
        if size != self.hash_block_size:
            hashes = BlockHashListWithBlockSize(request_hashes, self.hash_block_size, size)
        if end > len(hashes):
            raise InvalidBlockHashError(
                f"cannot cache blocks [{first}, {end}) with {len(hashes)} block hashes")
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
        self._taken(blocks)
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

    def _taken(self, blocks: list[KVCacheBlock]) -> None:
        """get_new_blocks(): ``blocks`` have just left the free queue, keys and ref counts
        still as they were. Nothing to do here; vLLM 0.33's pool calls its reuse watchers
        (``BlockPool033``), before the keys go, as vLLM 0.33 does."""

    def _evict_all(self, keyed: list[KVCacheBlock]) -> None:
        """Drop the keys of keyed blocks (each has one) from the blocks and from the map."""
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
        snapshot: a clear, then one store per key (``_snapshot``)."""
        queue = self.kv_event_queue
        pending = len(queue)
        bound = self.max_pending_kv_events
        if bound is None or pending <= bound:
            return
        if pending < 2 * (self._num_keys() + 1):
            return
        queue[:] = self._snapshot()  # in place: a caller may hold the queue
        self.num_kv_event_collapses += 1

    def _num_keys(self) -> int:
        """How many keys the cache holds: one per keyed block (``BlockPool033`` adds its
        partial entries)."""
        return len(self._key_of)

    def _snapshot(self) -> list[KVCacheEvent]:
        """The events that replay to the cache as it is: a clear, then one store per keyed
        block, by block id (``BlockPool033`` adds its partial entries after them)."""
        key_of, group_of = self._key_of, self._group_of
        snapshot: list[KVCacheEvent] = [self._all_blocks_cleared()]
        for block in sorted(key_of, key=_block_id_of):
            snapshot.append(self._snapshot_stored(key_of[block], group_of.get(block, 0)))
        return snapshot

    def _all_blocks_cleared(self) -> KVCacheEvent:
        """The event of a cleared cache, of the release's family."""
        cleared: KVCacheEvent = host_types.AllBlocksCleared()
        return cleared

    def _snapshot_stored(self, block_hash: bytes, group_id: int) -> KVCacheEvent:
        """A snapshot's store of one key: its hash, no parent, no token ids, its group's block
        size (recorded with the key's first store) and no LoRA; the pool keeps no more."""
        block_size = self._stored_block_sizes.get(group_id, self.hash_block_size)
        stored: KVCacheEvent = host_types.BlockStored(
            block_hashes=[maybe_convert_block_hash(BlockHash(block_hash))],
            parent_block_hash=None, token_ids=[], block_size=block_size, lora_id=None,
            medium=MEDIUM_GPU)
        return stored

    def touch(
        self, blocks: Sequence[Sequence[KVCacheBlock]] | Sequence[KVCacheBlock]
    ) -> None:
        """A prefix-cache hit: free blocks leave the free queue, every ref count + 1.

        Takes vLLM 0.13's tuple of per-group block lists, or one flat list (0.33).
        """
        items = as_list(blocks, "blocks")
        flat: list[Any]
        if items and not isinstance(items[0], KVCacheBlock):  # per-group lists
            flat = []
            for group in items:
                flat += as_list(group, "each group of blocks")
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
        blocks: list[Any] = as_list(ordered_blocks, "blocks")
        in_use, shared = self._in_use, self._shared
        if not _is_subset(blocks, in_use):
            null = self.null_block
            blocks = [b for b in blocks if b is not null]
            if self._free_foreign(blocks):
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

    def _free_foreign(self, blocks: list[Any]) -> bool:
        """free_blocks() where ``blocks`` (no null block) are not all in use: whether some are
        another pool's, and if so frees them all. vLLM 0.13's pool frees only its own blocks
        (False: free_blocks refuses the strangers); vLLM 0.33's forwards them to their pool
        (``BlockPool033``)."""
        return False

    def _release(self, zeroed: list[KVCacheBlock]) -> None:
        """Blocks that reached ref 0 (in that order) join the free queue where the policy
        puts them (LRU: the tail)."""
        if self._policy is not None:
            self._policy.freed(zeroed)
        else:
            self.free_block_queue.extend_unchecked(zeroed)

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
        self._clear_keys()
        if self._policy is not None:
            self._policy.reset()
        if self.metrics_collector is not None:
            self.metrics_collector.reset()
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(self._all_blocks_cleared())
            if self.max_pending_kv_events is not None:
                self._bound_kv_events()
        return True

    def _clear_keys(self) -> None:
        """reset_prefix_cache(), once allowed: forget every key."""
        self.cached_block_hash_to_block.clear_unchecked()
        self._key_of.clear()
        self._group_of.clear()

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
        self._check_keys()
        if self._policy is not None:
            self._policy.check()

    def _check_keys(self) -> None:
        """check_representation()'s keys: ``_key_of`` and ``_group_of`` list exactly the
        blocks the map holds, each under its one key (``BlockPool033`` allows more)."""
        self._check_keys_beside({})

    def _check_keys_beside(self, partial: dict[int, set[BlockHashWithGroupId]]) -> None:
        """The keys' part of the representation invariant, where block id -> ``partial`` are
        keys the map holds a block under besides its own (vLLM 0.33's partial entries)."""
        cache_map = self.cached_block_hash_to_block
        multi_key = [self._objects[i] for i in partial if 0 <= i < self.num_gpu_blocks]
        cache_map.check_representation(
            {b for b in multi_key if b is not None} if partial else ())
        mapped: dict[KVCacheBlock, bytes] = {}
        for key, blocks in cache_map.items():
            for block in blocks:
                if block.block_id not in partial or key not in partial[block.block_id]:
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

        ``on_reuse`` is vLLM 0.33's ``unpin_blocks(blocks, on_reuse)`` (``BlockPool033``),
        refused here."""
        if on_reuse is not None:
            raise PolicyNotSupportedError(
                "unpin_blocks(blocks, on_reuse) is vLLM 0.33's; this pool serves 0.13")
        policy = self._require(self._policy is not None and self._policy.has_pins, "pins")
        blocks = self._policy_blocks(block_ids, once=True)
        pinned = policy.pinned
        for block in blocks:
            if block not in pinned:
                raise BlockNotPinnedError(f"block {block.block_id} is not pinned")
        pinned.difference_update(blocks)
        self.free_blocks(blocks)

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
