"""impl's representation invariants (``check_representation()``) of the hash map and the pool:
they hold through normal use, and each fails with a message naming the broken property on
hand-corrupted state. The free queue's are tests/test_kv_cache_blocks.py's.

`test_pool_check_holds_through_random_use` drives a BlockPool through allocation, prefix
hits (sharing), caching in two groups, eviction, freeing and resets, checking
``check_representation()`` after every call: the representation mutants of the pool
(tests/mutants/representation_mutants.py) are caught here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from hypothesis import given, strategies as st

from kvspec.impl.block_pool import BlockHashToBlockMap, BlockPool
from kvspec.impl.kv_cache_utils import KVCacheBlock

HASHES = [bytes([n]) * 8 for n in range(1, 4)]


@dataclass
class _Request:
    """What cache_full_blocks reads of a request with events off: its block hashes."""

    block_hashes: list[bytes] = field(default_factory=lambda: list(HASHES))
    all_token_ids: list[int] = field(default_factory=list)
    lora_request: None = None


# --- the hash map --------------------------------------------------------------------------------


def test_map_check_names_the_broken_property() -> None:
    cache = BlockHashToBlockMap()
    blocks = [KVCacheBlock(i) for i in range(3)]
    key = HASHES[0] + bytes(4)
    cache.insert(key, blocks[1])
    cache.insert(key, blocks[2])
    cache.pop(key, 2)
    cache.check_representation()
    cache.later[(0, HASHES[0])] = []
    with pytest.raises(AssertionError, match="empty later list"):
        cache.check_representation()
    cache.later[(0, HASHES[1])] = [blocks[0]]
    del cache.later[(0, HASHES[0])]
    with pytest.raises(AssertionError, match="which has no first block"):
        cache.check_representation()
    cache.later[(0, HASHES[0])] = [blocks[1]]
    del cache.later[(0, HASHES[1])]
    with pytest.raises(AssertionError, match="block 1 is cached twice"):
        cache.check_representation()


# --- the block pool ------------------------------------------------------------------------------


@given(num_blocks=st.integers(2, 10), data=st.data())
def test_pool_check_holds_through_random_use(num_blocks: int, data: st.DataObject) -> None:
    pool = BlockPool(num_blocks, True, 1)
    held: list[list[KVCacheBlock]] = []
    request = _Request()
    pool.check_representation()
    for _ in range(data.draw(st.integers(1, 40), label="steps")):
        action = data.draw(st.sampled_from(["allocate", "hit", "cache", "free", "evict",
                                            "reset"]), label="action")
        if action == "allocate":
            n = data.draw(st.integers(0, 3), label="n")
            if n <= pool.get_num_free_blocks():
                held.append(pool.get_new_blocks(n))
        elif action == "hit":
            group = data.draw(st.sampled_from([0, 1]), label="group")
            hits = []
            for block_hash in HASHES:
                found = pool.get_cached_block(block_hash, [group])
                if found is None:
                    break
                hits.append(found[0])
            pool.touch([hits])
            held.append(hits)
        elif action == "cache" and held:
            blocks = data.draw(st.sampled_from(held), label="blocks")
            keyed = [b.block_hash is not None for b in blocks]
            first = keyed.index(False) if False in keyed else len(blocks)
            if first < len(blocks) <= len(HASHES) and not any(keyed[first:]):
                pool.cache_full_blocks(request, blocks, first, len(blocks), 1,
                                       data.draw(st.sampled_from([0, 1]), label="group"))
        elif action == "free" and held:
            blocks = held.pop(data.draw(st.integers(0, len(held) - 1), label="which"))
            pool.free_blocks(list(reversed(blocks)))
        elif action == "evict":
            pool.evict_blocks(data.draw(st.sets(st.integers(0, num_blocks - 1), max_size=3),
                                        label="evicted"))
        elif action == "reset":
            pool.reset_prefix_cache()
        pool.check_representation()


def _pool_with_a_shared_keyed_block() -> tuple[BlockPool, KVCacheBlock]:
    pool = BlockPool(6, True, 1)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(_Request(), blocks, 0, 2, 1, 1)
    pool.touch([[blocks[0]]])
    pool.check_representation()
    return pool, blocks[0]


@pytest.mark.parametrize(("corrupt", "message"), [
    (lambda p, b: p._in_use.discard(b), "shared blocks not in use"),
    (lambda p, b: setattr(b, "extra_refs", 0), "has extra refs 0 but is shared"),
    (lambda p, b: (p._key_of.pop(b), p._group_of.pop(b)), "the map holds blocks"),
    (lambda p, b: p._group_of.__setitem__(p.blocks[4], 1), "_group_of lists a block"),
    (lambda p, b: p._key_of.__setitem__(b, HASHES[2]), "is keyed"),
    (lambda p, b: p._in_use.add(p.null_block), "null block"),
    (lambda p, b: setattr(p.free_block_queue, "num_free_blocks", 0), "num_free_blocks"),
])
def test_pool_check_names_the_broken_property(
        corrupt: Callable[[BlockPool, KVCacheBlock], object], message: str) -> None:
    pool, block = _pool_with_a_shared_keyed_block()
    corrupt(pool, block)
    with pytest.raises(AssertionError, match=message):
        pool.check_representation()


