"""impl/kv_cache_utils.py, vLLM's ``vllm.v1.core.kv_cache_utils`` names: each is the very object
of the module that defines it (blocks and the free queue, hashing, planning, the errors), and
the module survives ``importlib.reload``, as vLLM 0.13's own ``test_none_hash`` does it.

vLLM's test reloads ``vllm.v1.core.kv_cache_utils``, which is kvspec's module once kvspec is in
place. Blocks, free queues and pools made before the reload must keep working with the names
read from the module after it: the classes are defined in impl/kv_cache_blocks.py, which a
reload of ``kv_cache_utils`` does not re-create, and ``kv_cache_utils`` (not compiled, in
either build) only re-exports them. The file runs the same in both builds.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator

import pytest

from kvspec.impl import errors, hashing, kv_cache_blocks, kv_cache_planning, kv_cache_utils
from kvspec.impl.block_pool import BlockPool

NAMES = ("KVCacheBlock", "FreeKVCacheBlockQueue", "BlockOwner", "BlockNotFreeError",
         "InvalidFreeQueueArgument", "NoFreeBlocksError", "hash_block_tokens",
         "get_request_block_hasher", "init_none_hash")


@pytest.fixture(autouse=True)
def _restore_seed() -> Iterator[None]:
    """The reload test seeds the chains again: put the seed back for the tests after it."""
    seed = hashing.NONE_HASH
    yield
    hashing.NONE_HASH = seed
    vars(sys.modules["kvspec.impl.kv_cache_utils"])["NONE_HASH"] = seed


def test_reload_keeps_the_classes_and_the_blocks_made_before() -> None:
    before = {name: getattr(kv_cache_utils, name) for name in NAMES}
    loose = [kv_cache_utils.KVCacheBlock(i) for i in range(3)]
    pool = BlockPool(8, True, 4)
    taken = pool.get_new_blocks(3)

    reloaded = importlib.reload(kv_cache_utils)

    assert reloaded is kv_cache_utils
    changed = [name for name, value in before.items() if getattr(reloaded, name) is not value]
    assert not changed, f"a reload of kv_cache_utils made new objects: {changed}"
    # vLLM's test_free_kv_cache_block_queue_* after test_none_hash: blocks made before the
    # reload, a queue made after it.
    queue = reloaded.FreeKVCacheBlockQueue(loose)
    assert queue.fake_free_list_head.next_free_block is loose[0]
    assert queue.popleft() is loose[0]
    queue.append(loose[0])
    assert queue.get_all_free_blocks() == [loose[1], loose[2], loose[0]]
    assert all(isinstance(block, reloaded.KVCacheBlock) for block in loose + taken)
    # A pool made before the reload takes back its blocks, and a pool made after it works.
    pool.free_blocks(taken)
    assert pool.get_num_free_blocks() == 7
    fresh = BlockPool(4, True, 4)
    reloaded.FreeKVCacheBlockQueue([reloaded.KVCacheBlock(9)])
    fresh.free_blocks(fresh.get_new_blocks(2))


def test_reload_then_init_none_hash_seeds_both_names() -> None:
    reloaded = importlib.reload(kv_cache_utils)
    reloaded.init_none_hash(hashing.sha256)
    assert isinstance(reloaded.NONE_HASH, bytes) and reloaded.NONE_HASH
    assert reloaded.NONE_HASH == hashing.NONE_HASH


# --- what it re-exports ---------------------------------------------------------------------


# The modules kv_cache_utils re-exports from, each name the very object of its source.
SOURCES = (kv_cache_blocks, hashing, kv_cache_planning, errors)


def test_every_name_is_its_sources_object() -> None:
    """Every public name (``__all__``) but ``NONE_HASH`` and the ``BlockHashList`` alias is
    one of the source modules' objects, under the same name; the private names vLLM's tests
    call are the planning functions' own."""
    missing = [name for name in kv_cache_utils.__all__ if not hasattr(kv_cache_utils, name)]
    assert missing == []
    own = {"NONE_HASH", "BlockHashList"}
    sourced = {name: [module.__name__ for module in SOURCES
                      if getattr(module, name, None) is getattr(kv_cache_utils, name)]
               for name in kv_cache_utils.__all__ if name not in own}
    assert [name for name, found in sourced.items() if not found] == []
    assert sourced["KVCacheBlock"] == [kv_cache_blocks.__name__]
    assert sourced["FreeKVCacheBlockQueue"] == [kv_cache_blocks.__name__]
    assert kv_cache_utils.BlockOwnershipError is errors.BlockOwnershipError
    for name, source in (("_get_kv_cache_groups_uniform_page_size",
                          "get_kv_cache_groups_uniform_page_size"),
                         ("_get_kv_cache_groups_uniform_spec", "get_kv_cache_groups_uniform_spec"),
                         ("_get_kv_cache_groups_uniform_type", "get_kv_cache_groups_uniform_type"),
                         ("_report_kv_cache_config", "report_kv_cache_config")):
        assert getattr(kv_cache_utils, name) is getattr(kv_cache_planning, source), name


def test_kv_cache_utils_exports_vllms_planning_names() -> None:
    for name in ("get_kv_cache_configs", "estimate_max_model_len", "tensor_data",
                 "_get_kv_cache_groups_uniform_page_size", "_report_kv_cache_config"):
        assert hasattr(kv_cache_utils, name), name
