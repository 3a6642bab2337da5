"""BlockPool033 (impl/block_pool_033.py), vLLM 0.33's pool: its operations and its
differences from 0.13's pool, example by example (the 0.33 pool machine,
tests/test_pool_machine.py, checks them against the spec); which class ``BlockPool(...)``
builds (``pool_class_for``, ``BlockPool.__new__``, ``new_pool``); and its refusals of bad
calls. The mutants of tests/mutants/impl_033_pool_mutants.py name these tests."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest

from kvspec.conformance.pool_machine import chain_hash
from kvspec.impl import COMPILED_MODULES, block_pool
from kvspec.impl.block_pool import (
    BlockAlreadyCachedError,
    BlockNotInPoolError,
    BlockNotInUseError,
    BlockPool,
    InvalidBlockCountError,
    InvalidBlockHashError,
    InvalidBlockListError,
    InvalidPoolConfigError,
    InvalidRequestForCachingError,
)
from kvspec.impl.block_pool_033 import BlockPool033
from kvspec.impl.errors import BlockOwnershipError
from kvspec.impl.hashing import BlockHash, maybe_convert_block_hash
from kvspec.impl.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from kvspec.impl.kv_cache_manager import KVCacheManager


def external(block_hash: bytes) -> bytes | int:
    """The external (event) form of a raw hash, as vLLM's maybe_convert_block_hash gives it."""
    return maybe_convert_block_hash(BlockHash(block_hash))


class _Request033:
    """What a 0.33 pool reads of a request to cache its blocks and report them."""

    def __init__(self, block_hashes: list[bytes]) -> None:
        self.block_hashes = block_hashes
        self.all_token_ids = list(range(2 * len(block_hashes)))
        self.lora_request = None
        self.mm_features: list[Any] = []
        self.cache_salt = None
        self.prompt_embeds = None
        self.session_id = "s"


def _pool_033(num_blocks: int = 8, caching: bool = True, events: bool = True) -> Any:
    return BlockPool(num_blocks, caching, 2, events, vllm_api="0.33")


def _ids(blocks: Any) -> list[int]:
    return [b.block_id for b in blocks]


# ------------------------------------------------------------------ 0.33's operations


def test_033_free_order_unkeyed_first_keyed_last() -> None:
    pool = _pool_033()
    hashes = [chain_hash(0, i) for i in range(2)]
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(_Request033(hashes), blocks, 0, 2, 2, 0)
    pool.free_blocks(blocks)
    free = _ids(pool.free_block_queue.get_all_free_blocks())
    # unkeyed 3 and 4 to the head (in order), keyed 1 and 2 to the tail (LRU)
    assert free[:2] == [3, 4] and free[-2:] == [1, 2]
    pool.check_representation()
    off = _pool_033(caching=False)
    taken = off.get_new_blocks(2)
    off.free_blocks(taken)
    assert _ids(off.free_block_queue.get_all_free_blocks())[:2] == [1, 2]


def test_033_partial_entry_promotion_and_events() -> None:
    pool = _pool_033()
    hashes = [chain_hash(0, i) for i in range(4)]
    request = _Request033(hashes)
    (block,) = pool.get_new_blocks(1)
    key = pool.cache_partial_block(request, block, 2, 0, 4)  # 2 of the block's 4 tokens
    assert key == hashes[0] + b"\0\0\0\0" and block.block_hash_num_tokens == 2
    assert pool.cached_block_hash_to_block.contain(key, block.block_id)
    pool.check_representation()
    pool.cache_full_blocks(request, [block], 0, 1, 4, 0)  # promoted: the full key replaces it
    assert block.block_hash == hashes[1] + b"\0\0\0\0" and block.block_hash_num_tokens == 4
    assert not pool.cached_block_hash_to_block.contain(key, block.block_id)
    events = pool.take_events()
    assert [type(e).__name__ for e in events] == [
        "BlockStoredV033", "BlockRemovedV033", "BlockStoredV033"]
    assert events[0].block_size == 2 and events[1].group_idx == 0
    assert events[2].block_hashes == [external(hashes[1])] and events[2].session_id == "s"
    pool.check_representation()


def test_033_partial_entries_leave_with_their_block() -> None:
    pool = _pool_033(num_blocks=3)
    hashes = [chain_hash(0, i) for i in range(2)]
    request = _Request033(hashes)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_blocks(request, [block], 0, 1, 2, 0)
    pool.cache_partial_block(request, block, 2, 1, 2)  # a second key, in group 1
    assert block.block_id in pool.cached_block_hashes_by_block
    pool.take_events()
    pool.free_blocks([block])
    pool.get_new_blocks(2)  # reuses it: both keys go, one BlockRemoved each
    removed = pool.take_events()
    assert sorted(e.group_idx for e in removed) == [0, 1]
    assert not pool.cached_block_hashes_by_block and block.block_hash is None
    pool.check_representation()


def test_033_move_block_hashes_copy_on_write() -> None:
    pool = _pool_033()
    hashes = [chain_hash(0, 0)]
    src, dst = pool.get_new_blocks(2)
    pool.cache_full_blocks(_Request033(hashes), [src], 0, 1, 2, 0)
    pool.take_events()
    pool.move_block_hashes(src, dst)
    assert src.block_hash is None and pool.get_cached_block(hashes[0], [0]) == [dst]
    assert pool.take_events() == []
    assert pool.is_block_writable(src) and not pool.is_block_writable(dst)
    assert not pool.is_block_writable(pool.null_block)
    with pytest.raises(ValueError):
        pool.move_block_hashes(src, dst)  # dst already keyed
    pool.check_representation()


def test_033_unpin_watcher_fires_on_reuse_and_reset() -> None:
    pool = _pool_033(num_blocks=3)
    seen: list[int] = []
    blocks = pool.get_new_blocks(2)
    pool.unpin_blocks(blocks, lambda block: seen.append(block.block_id))
    assert pool.get_num_free_blocks() == 2 and seen == []
    pool.get_new_blocks(1)  # the free queue's head: block 1
    assert seen == [1]
    pool.free_blocks([pool.blocks[1]])
    assert pool.reset_prefix_cache() and seen == [1, 2]
    pool.check_representation()


def test_033_touch_skips_null_and_ref_count_writes() -> None:
    pool = _pool_033()
    (block,) = pool.get_new_blocks(1)
    pool.touch([pool.null_block, block])
    assert block.ref_cnt == 2
    block.ref_cnt += 1  # 0.33's managers add a copy-on-write reference this way
    assert block.ref_cnt == 3
    pool.free_blocks([block, block, pool.null_block])
    assert block.ref_cnt == 1
    with pytest.raises(ValueError):
        block.ref_cnt = 0
    pool.check_representation()


def test_033_free_forwards_to_the_owning_pool() -> None:
    pool, other = _pool_033(), _pool_033()
    mine, theirs = pool.get_new_blocks(1), other.get_new_blocks(2)
    pool.free_blocks(mine + theirs)
    assert pool.get_num_free_blocks() == 7 and other.get_num_free_blocks() == 7
    pool.check_representation()
    other.check_representation()


def test_033_emit_cached_block_events() -> None:
    pool = _pool_033()
    hashes = [chain_hash(0, i) for i in range(3)]
    pool.emit_cached_block_events(_Request033(hashes), 2, 2, 0)
    (event,) = pool.take_events()
    assert event.block_hashes == [external(h) for h in hashes[:2]]
    assert event.parent_block_hash is None
    assert event.token_ids == [0, 1, 2, 3] and event.group_idx == 0


class _HostPool(BlockPool):
    """A pool that publishes into another pool's queue, as vLLM 0.33's hisparse host pool
    (``SharedEventQueueBlockPool``, vllm/v1/hisparse/block_pool.py) does: it overrides
    ``kv_event_queue`` with a property reading its owner's."""

    def __init__(self, *args: Any, event_owner: Any, **kwargs: Any) -> None:
        self._event_owner = event_owner
        super().__init__(*args, **kwargs)

    @property
    def kv_event_queue(self) -> list[Any]:
        return self._event_owner.kv_event_queue  # type: ignore[no-any-return]

    @kv_event_queue.setter
    def kv_event_queue(self, events: list[Any]) -> None:
        if events:
            raise AssertionError("only the owner drains the queue")


def test_033_subclass_queue_property_receives_the_events() -> None:
    """In both builds every event goes through ``kv_event_queue``, so a subclass that
    overrides it (vLLM 0.33's host pool) gets them, with its medium: compiled code would
    otherwise write the base class's own list (vLLM's test_hisparse_events_report_host_and_
    device_placement caught this in the compiled build)."""
    device = _pool_033()
    host = _HostPool(6, True, 2, True, medium="CPU", vllm_api="0.33", event_owner=device)
    hashes = [chain_hash(0, i) for i in range(2)]
    blocks = host.get_new_blocks(2)
    host.cache_full_blocks(_Request033(hashes), blocks, 0, 2, 2, 0)
    host.free_blocks(blocks)
    host.evict_blocks({blocks[0].block_id})
    events = device.take_events()
    assert [(type(e).__name__, e.medium) for e in events] == [
        ("BlockStoredV033", "CPU"), ("BlockRemovedV033", "CPU")]
    assert host.take_events() == [] and device.kv_event_queue == []
    host.check_representation()


def test_033_range_of_null_blocks_reports_an_empty_store() -> None:
    """vLLM 0.33's cache_full_blocks reports a BlockStored even when every block of the range
    is null (a sliding-window or Mamba group's skipped blocks): no hashes, the range's tokens
    (docs/findings.md, D2). Nothing is keyed."""
    pool = _pool_033()
    hashes = [chain_hash(0, i) for i in range(2)]
    null = pool.null_block
    pool.cache_full_blocks(_Request033(hashes), [null, null], 0, 2, 2, 0)
    (stored,) = pool.take_events()
    assert type(stored).__name__ == "BlockStoredV033"
    assert stored.block_hashes == [] and stored.token_ids == [0, 1, 2, 3]
    assert stored.parent_block_hash is None and stored.group_idx == 0
    assert not list(pool.cached_block_hash_to_block.items())
    quiet = BlockPool(8, True, 2, False, vllm_api="0.33")
    quiet.cache_full_blocks(_Request033(hashes), [quiet.null_block] * 2, 0, 2, 2, 0)
    assert quiet.take_events() == []
    pool.check_representation()


def test_033_bounded_snapshot_lists_partial_entries_after_primary_keys() -> None:
    """A collapsed event queue (kvspec's bound) replays to every key the pool holds: a clear,
    the primary keys by block id, then the partial entries by block id, in key order; and it
    is taken once the operation's keys are in place, not midway."""
    pool: Any = BlockPool(8, True, 2, True, vllm_api="0.33", max_pending_kv_events=2)
    hashes = [chain_hash(0, i) for i in range(2)]
    request = _Request033(hashes)
    first, second = pool.get_new_blocks(2)
    pool.cache_full_blocks(request, [first], 0, 1, 4, 0)  # a 4-token key: hashes[1]
    pool.cache_partial_block(request, first, 2, 0, 4)  # a partial entry beside it: hashes[0]
    pool.cache_partial_block(request, second, 2, 0, 4)  # second's primary key: hashes[0]
    for _ in range(3):  # new contents: a remove and a store each, until the queue collapses
        pool.cache_partial_block(request, second, 2, 0, 4, True)
    events: list[Any] = pool.take_events()
    assert pool.num_kv_event_collapses == 1
    assert [type(e).__name__ for e in events] == ["AllBlocksClearedV033"] + [
        "BlockStoredV033"] * 3
    assert [e.block_hashes for e in events[1:]] == [
        [external(hashes[1])], [external(hashes[0])], [external(hashes[0])]]
    assert [e.block_size for e in events[1:]] == [4, 4, 4]
    assert {e.group_idx for e in events[1:]} == {0} and events[1].medium == "GPU"
    pool.check_representation()


# ----------------------------------------------------- which class BlockPool(...) builds


def test_the_constructor_chooses_the_class_of_the_api_asked_for(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """BlockPool(..., vllm_api="0.33") and BlockPool(...) in a vLLM 0.33 process build
    BlockPool033; BlockPool033 is 0.33's whatever the default, and refuses 0.13."""
    pool: Any = BlockPool(8, True, 2, vllm_api="0.33")
    assert type(pool) is BlockPool033 and pool.vllm_api == "0.33"
    assert isinstance(pool, BlockPool)
    assert type(BlockPool033(8, True, 2)) is BlockPool033
    monkeypatch.setattr(block_pool, "_default_api", ["0.33"])
    assert type(BlockPool(8, True, 2)) is BlockPool033
    assert type(BlockPool(8, True, 2, vllm_api="0.13")) is BlockPool
    monkeypatch.setattr(block_pool, "_default_api", ["0.13"])
    assert type(BlockPool(8, True, 2)) is BlockPool
    assert BlockPool033(8, True, 2, medium="CPU").medium == "CPU"
    with pytest.raises(InvalidPoolConfigError, match=r"BlockPool033 serves vLLM 0\.33's"):
        BlockPool033(8, True, 2, vllm_api="0.13")
    with pytest.raises(InvalidPoolConfigError, match=r"0\.20"):
        BlockPool033(8, True, 2, vllm_api="0.20")


def test_compiled_code_builds_pools_as_python_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled manager stack builds its pool through block_pool.new_pool (a direct
    BlockPool(...) call in compiled code skips __init__ for a BlockPool033 and loses its
    refusals: new_pool's docstring): a 0.33 default gives an initialised BlockPool033, a bad
    argument a typed refusal. No compiled module calls either class directly."""
    config = KVCacheConfig(8, (), (KVCacheGroupSpec(("layer.0",),
                                                    FullAttentionSpec(2, 1, 8, "float16")),))
    monkeypatch.setattr(block_pool, "_default_api", ["0.33"])
    manager = KVCacheManager(config, 64, 2)
    pool: Any = manager.block_pool
    assert type(pool) is BlockPool033 and pool.medium == "GPU"
    assert [b.block_id for b in pool.get_new_blocks(2)] == [1, 2]
    pool.check_representation()
    with pytest.raises(InvalidPoolConfigError, match="metrics_collector"):
        KVCacheManager(config, 64, 2, metrics_collector=object())  # type: ignore[arg-type]
    impl = Path(block_pool.__file__).resolve().parent
    direct = [f"{module}.py:{node.lineno}" for module in COMPILED_MODULES
              for node in ast.walk(ast.parse((impl / f"{module}.py").read_text()))
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("BlockPool", "BlockPool033")]
    assert direct == []


class _Fork(BlockPool):
    """A subclass of the 0.13 class, as a fork or a test writes one."""

    def get_usage(self) -> float:
        return 0.5  # its own override must win over both classes'


def test_a_subclass_asked_for_033_is_itself_over_blockpool033() -> None:
    """A subclass of BlockPool asked for 0.33 gets 0.33's behaviour under its own methods
    (vLLM 0.33's hisparse host pool subclasses the class it imports as BlockPool), one class
    per subclass, with the subclass's name."""
    plain: Any = _Fork(8, True, 2, vllm_api="0.13")
    assert type(plain) is _Fork
    fork: Any = _Fork(8, True, 2, vllm_api="0.33")
    assert type(fork) is not _Fork and isinstance(fork, _Fork) and isinstance(fork, BlockPool033)
    assert type(fork).__name__ == "_Fork" and type(fork).__module__ == __name__
    assert type(_Fork(8, True, 2, vllm_api="0.33")) is type(fork)
    assert fork.get_usage() == 0.5
    taken = fork.get_new_blocks(2)
    fork.free_blocks(taken)  # 0.33's free order: unkeyed blocks to the head
    assert _ids(fork.free_block_queue.get_all_free_blocks())[:2] == [1, 2]
    assert block_pool.pool_class_for(_Fork, "0.33") is type(fork)
    assert block_pool.pool_class_for(BlockPool033, "0.33") is BlockPool033
    with pytest.raises(InvalidPoolConfigError, match="not a subclass of BlockPool"):
        block_pool.pool_class_for(int, "0.33")
    fork.check_representation()

# ------------------------------------------------ refusals: typed, naming the value, no change


def _snapshot(pool: Any) -> tuple[Any, ...]:
    """Everything a caller can see of a 0.33 pool: the free order, each block's ref count, key
    and covered tokens, both key maps, the pending events and the collapses."""
    return (
        _ids(pool.free_block_queue.get_all_free_blocks()),
        [(b.ref_cnt, b.block_hash, pool.block_hash_num_tokens_of(b)) for b in pool.blocks[1:]],
        sorted((key, _ids(blocks)) for key, blocks in pool.cached_block_hash_to_block.items()),
        {block_id: sorted(keys) for block_id, keys in pool.cached_block_hashes_by_block.items()},
        list(pool.kv_event_queue), pool.num_kv_event_collapses,
    )


class _Subject:
    """A 0.33 pool with blocks in every state a bad call may meet: keyed and in use (1, 2),
    block 1 also under a partial entry in group 1, unkeyed and in use (3), unpinned with a
    watcher (4), free; and another pool with a block in use (for forwarding)."""

    def __init__(self) -> None:
        self.pool: Any = _pool_033()
        self.other: Any = _pool_033(num_blocks=4)
        self.request = _Request033([chain_hash(0, i) for i in range(4)])
        self.blocks = self.pool.get_new_blocks(4)
        self.pool.cache_full_blocks(self.request, self.blocks, 0, 2, 2, 0)
        self.pool.cache_partial_block(self.request, self.blocks[0], 2, 1, 2)
        self.pool.unpin_blocks([self.blocks[3]], lambda block: None)
        self.foreign = self.other.get_new_blocks(1)


REFUSALS: dict[str, tuple[Any, type[Exception], str]] = {
    "partial: tokens not a multiple of the hash block": (
        lambda s: s.pool.cache_partial_block(s.request, s.blocks[2], 3, 0, 2),
        InvalidBlockCountError, "num_tokens 3"),
    "partial: tokens past the request's hashes": (
        lambda s: s.pool.cache_partial_block(s.request, s.blocks[2], 10, 0, 2),
        InvalidBlockCountError, "num_tokens 10"),
    "partial: not a request": (
        lambda s: s.pool.cache_partial_block("no request", s.blocks[2], 2, 0, 2),
        InvalidRequestForCachingError, "'no request' is not a request"),
    "partial: a hash not bytes": (
        lambda s: s.pool.cache_partial_block(
            _Request033(["x"]), s.blocks[2], 2, 0, 2),  # type: ignore[list-item]
        InvalidBlockHashError, "got 'x'"),
    "partial: a bad group": (
        lambda s: s.pool.cache_partial_block(s.request, s.blocks[2], 2, -1, 2),
        InvalidBlockHashError, "got -1"),
    "partial: replace_existing_hashes not a bool": (
        lambda s: s.pool.cache_partial_block(s.request, s.blocks[0], 2, 0, 2, "yes"),
        InvalidPoolConfigError, "'yes'"),
    "partial: another pool's block": (
        lambda s: s.pool.cache_partial_block(s.request, s.foreign[0], 2, 0, 2),
        BlockNotInPoolError, "not a block of this pool"),
    "move: to the null block": (
        lambda s: s.pool.move_block_hashes(s.blocks[0], s.pool.null_block),
        BlockNotInPoolError, "null block"),
    "move: to a keyed block": (
        lambda s: s.pool.move_block_hashes(s.blocks[0], s.blocks[1]),
        BlockAlreadyCachedError, "block 2 already has a key"),
    "unpin: on_reuse not callable": (
        lambda s: s.pool.unpin_blocks([s.blocks[2]], 5),
        InvalidPoolConfigError, "got 5"),
    "unpin: more times than referenced": (
        lambda s: s.pool.unpin_blocks([s.blocks[1], s.blocks[2], s.blocks[2]], print),
        BlockNotInUseError, "block 3 is unpinned with ref count 1"),
    "unpin: the null block": (
        lambda s: s.pool.unpin_blocks([s.pool.null_block], print),
        BlockNotInUseError, "block 0 is unpinned"),
    "emit: more blocks than hashes": (
        lambda s: s.pool.emit_cached_block_events(s.request, 9, 2, 0),
        InvalidBlockHashError, "cannot report 9 cached blocks with 4"),
    "emit: a block size not a multiple of the hash block": (
        lambda s: s.pool.emit_cached_block_events(s.request, 1, 3, 0),
        InvalidBlockCountError, "block size 3"),
    "cache: a block mask of the wrong length": (
        lambda s: s.pool.cache_full_blocks(s.request, s.blocks, 2, 3, 2, 0, [True, False]),
        InvalidBlockListError, "block_mask has 2 entries for 1 blocks"),
    "ref_cnt: set to 0": (
        lambda s: s.pool.set_ref_count(s.blocks[2], 0),
        BlockOwnershipError, "ref_cnt=0"),
    "free: another pool's block, then not a block": (
        lambda s: s.pool.free_blocks([s.foreign[0], "x"]),
        BlockNotInPoolError, "'x'"),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_033_operations_refuse_bad_input_typed_and_change_nothing(name: str) -> None:
    """Each of 0.33's own operations refuses a bad call with its typed ValueError/LookupError,
    naming the value, and neither the pool nor a pool it forwards to changes."""
    call, error, named = REFUSALS[name]
    subject = _Subject()
    before, other_before = _snapshot(subject.pool), _snapshot(subject.other)
    with pytest.raises(error, match=re.escape(named)) as raised:
        call(subject)
    assert isinstance(raised.value, ValueError | LookupError)
    assert _snapshot(subject.pool) == before and _snapshot(subject.other) == other_before
    subject.pool.check_representation()
    subject.other.check_representation()
