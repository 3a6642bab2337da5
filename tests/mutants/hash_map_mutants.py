"""Prefix-cache map mutants: bugs in BlockHashToBlockMap's own API, each planted into impl/.

The pool reaches the map through ``insert_unchecked``/``remove_unchecked`` and its own group
dicts, so bugs in the map's public ``pop``/``get_one_block``/``len`` pass the pool machine;
the hash-map layer (tests/test_hash_map_machine.py) must kill each one.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from kvspec.impl import block_pool as bp
from kvspec.impl.block_pool import BlockHashToBlockMap
from kvspec.impl.kv_cache_utils import KVCacheBlock
from tests.mutants import Mutant, replace

MACHINE = ("tests/test_hash_map_machine.py",)


def pop_leaves_empty_entry() -> None:
    """pop of a key's last block leaves the key in the map, holding no blocks: len() counts
    it and items() lists it (a dict of lists whose emptied list is never deleted)."""
    emptied: dict[int, set[bytes]] = {}
    original_remove = BlockHashToBlockMap.remove_unchecked
    original_insert = BlockHashToBlockMap.insert_unchecked
    original_len, original_items = BlockHashToBlockMap.__len__, BlockHashToBlockMap.items

    def _remove(self: BlockHashToBlockMap, group_id: int, block_hash: bytes,
                block: KVCacheBlock) -> None:
        original_remove(self, group_id, block_hash, block)
        if not self.blocks_under(group_id, block_hash):
            emptied.setdefault(id(self), set()).add(block_hash + group_id.to_bytes(4, "big"))

    def _insert(self: BlockHashToBlockMap, group_id: int, block_hash: bytes,
                block: KVCacheBlock) -> None:
        emptied.get(id(self), set()).discard(block_hash + group_id.to_bytes(4, "big"))
        original_insert(self, group_id, block_hash, block)

    def __len__(self: BlockHashToBlockMap) -> int:
        return original_len(self) + len(emptied.get(id(self), ()))

    def items(self: BlockHashToBlockMap) -> Iterator[tuple[bytes, list[KVCacheBlock]]]:
        yield from original_items(self)
        for key in sorted(emptied.get(id(self), ())):
            yield key, []

    replace(BlockHashToBlockMap, "remove_unchecked", _remove)
    replace(BlockHashToBlockMap, "insert_unchecked", _insert)
    replace(BlockHashToBlockMap, "__len__", __len__)
    replace(BlockHashToBlockMap, "items", items)


def get_one_block_returns_newest() -> None:
    """get_one_block answers with the block cached last under the key, not the first."""
    def get_one_block(self: BlockHashToBlockMap, key: Any) -> KVCacheBlock | None:
        block_hash, group_id = bp.split_key(key)
        blocks = self.blocks_under(group_id, block_hash)
        return blocks[-1] if blocks else None
    replace(BlockHashToBlockMap, "get_one_block", get_one_block)


def pop_ignores_block_id() -> None:
    """pop takes the key's first block whatever block id it is given."""
    def pop(self: BlockHashToBlockMap, key: Any, block_id: Any) -> KVCacheBlock | None:
        block_hash, group_id = bp.split_key(key)
        if type(block_id) is not int:
            raise bp.BlockNotInPoolError(f"block id must be an int, got {block_id!r}")
        blocks = self.blocks_under(group_id, block_hash)
        if not blocks:
            return None
        self.remove_unchecked(group_id, block_hash, blocks[0])
        return blocks[0]
    replace(BlockHashToBlockMap, "pop", pop)


MUTANTS = [
    Mutant("hash_map_pop_leaves_empty_entry", "pop of a key's last block leaves the key, empty",
           pop_leaves_empty_entry, MACHINE, "no_empty_entry"),
    Mutant("hash_map_get_one_block_returns_newest",
           "get_one_block returns the newest block under the key, not the first",
           get_one_block_returns_newest, MACHINE, "GetOneBlock"),
    Mutant("hash_map_pop_ignores_block_id", "pop takes the key's first block, whichever id",
           pop_ignores_block_id, MACHINE, "Pop("),
]
