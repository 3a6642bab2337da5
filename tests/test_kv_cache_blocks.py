"""The blocks and the free-block queue (impl/kv_cache_blocks.py): vLLM's ``KVCacheBlock``
constructor, the queue in vLLM's linked-list terms, a queue that never changes the caller's
list, read-only links, and the queue's representation check (it holds through normal use,
names each broken property on hand-corrupted state, and needs no ``assert``, so it works under
``python -O``). The queue inside a pool: tests/test_vllm_compat.py and
tests/test_free_queue_machine.py.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest

from kvspec.impl.block_pool import BlockPool
from kvspec.impl.errors import BlockOwnershipError
from kvspec.impl.kv_cache_blocks import FreeKVCacheBlockQueue, KVCacheBlock


def _queue(n: int = 4) -> tuple[list[KVCacheBlock], FreeKVCacheBlockQueue]:
    blocks = [KVCacheBlock(i) for i in range(n)]
    return blocks, FreeKVCacheBlockQueue(list(blocks))


# --- vLLM's blocks and the queue in linked-list terms ---------------------------------------


def test_kv_cache_block_has_vllms_constructor() -> None:
    before, after = KVCacheBlock(1), KVCacheBlock(3)
    block = KVCacheBlock(2, 0, None, before, after, True)
    assert (block.prev_free_block, block.next_free_block, block.is_null) == (before, after, True)


def test_standalone_queue_links() -> None:
    blocks = [KVCacheBlock(i) for i in range(4)]
    queue = FreeKVCacheBlockQueue(blocks)
    head, tail = queue.fake_free_list_head, queue.fake_free_list_tail
    assert head.next_free_block is blocks[0] and blocks[0].prev_free_block is head
    assert blocks[3].next_free_block is tail and tail.prev_free_block is blocks[3]
    queue.remove(blocks[1])
    assert blocks[0].next_free_block is blocks[2] and blocks[2].prev_free_block is blocks[0]
    assert blocks[1].prev_free_block is None and blocks[1].next_free_block is None
    popped = queue.popleft_n(3)
    assert popped == [blocks[0], blocks[2], blocks[3]]
    assert all(b.prev_free_block is None and b.next_free_block is None for b in popped)
    assert head.next_free_block is tail and tail.prev_free_block is head
    queue.append_n([blocks[3], blocks[0]])
    assert head.next_free_block is blocks[3] and blocks[3].next_free_block is blocks[0]


def test_a_queue_never_changes_the_list_it_was_built_from() -> None:
    """vLLM's FreeKVCacheBlockQueue copies its blocks into its own links; a caller's list
    stays as it was while the queue is popped, emptied of a block and appended to (vLLM's
    own test_free_kv_cache_block_queue_get_all_free_blocks reads it afterwards)."""
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.popleft()
    queue.remove(blocks[2])
    queue.append(blocks[2])
    assert [block.block_id for block in blocks] == [0, 1, 2, 3, 4]
    assert queue.get_all_free_blocks() == [blocks[1], blocks[3], blocks[4], blocks[2]]


def test_queue_links_are_read_only_inside_a_queue() -> None:
    queue = FreeKVCacheBlockQueue([KVCacheBlock(0)])
    with pytest.raises(BlockOwnershipError, match="read-only"):
        queue.fake_free_list_tail.prev_free_block = None
    assert queue.fake_free_list_tail.prev_free_block is not None
    # A typed refusal, not an AttributeError: getattr(block, name, default) and hasattr
    # must not swallow it (it subclassed AttributeError before issue 10).
    assert issubclass(BlockOwnershipError, ValueError)
    assert not issubclass(BlockOwnershipError, AttributeError)


# --- the representation check ---------------------------------------------------------------


def test_queue_check_holds_through_normal_use() -> None:
    blocks, queue = _queue(6)
    queue.check_representation()
    taken = queue.popleft_n(2)
    queue.check_representation()
    queue.remove(blocks[4])
    queue.check_representation()
    queue.append_n([*taken, blocks[4]])
    queue.check_representation()
    queue.remove(blocks[0])  # a stale entry in the middle, then popped past
    queue.popleft_n(4)
    queue.check_representation()
    queue.append(blocks[0])
    queue.check_representation()


def test_queue_check_holds_on_a_pools_fresh_run() -> None:
    pool = BlockPool(8, True, 1)
    pool.free_block_queue.check_representation()
    blocks = pool.get_new_blocks(3)
    pool.free_blocks(blocks)
    pool.free_block_queue.check_representation()


def _queue_twice(queue: FreeKVCacheBlockQueue, block: KVCacheBlock) -> None:
    """A second live entry for a queued block, counted: the queue holds it twice."""
    queue._entries.append(block)
    queue.num_free_blocks += 1


@pytest.mark.parametrize(("corrupt", "message"), [
    (lambda q, b: setattr(q, "num_free_blocks", q.num_free_blocks + 1), "num_free_blocks"),
    (lambda q, b: setattr(q, "_num_stale", 1), "stale count total"),
    (lambda q, b: setattr(q, "_head", 99), "head 99 outside"),
    (lambda q, b: q._stale.__setitem__(b[1], 0), "stale counts must be positive"),
    (lambda q, b: _queue_twice(q, b[1]), "two live entries"),
    (lambda q, b: setattr(b[2], "_queue", None), "not marked as queued"),
])
def test_queue_check_names_the_broken_property(
        corrupt: Callable[[FreeKVCacheBlockQueue, list[KVCacheBlock]], object],
        message: str) -> None:
    blocks, queue = _queue()
    corrupt(queue, blocks)
    with pytest.raises(AssertionError, match=message):
        queue.check_representation()


def test_checks_work_under_optimize_flag() -> None:
    """No bare ``assert``: under ``python -O`` a corrupted queue still fails its check."""
    program = (
        "from kvspec.impl.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock\n"
        "q = FreeKVCacheBlockQueue([KVCacheBlock(i) for i in range(3)])\n"
        "q.num_free_blocks = 7\n"
        "try:\n    q.check_representation()\nexcept AssertionError as e:\n    print('caught', e)\n")
    out = subprocess.run([sys.executable, "-O", "-c", program], capture_output=True, text=True,
                         check=True).stdout
    assert out.startswith("caught free queue: num_free_blocks 7")
