"""Block pools with one planted bug each, for `kvspec audit --target package.module:Class`.

tests/test_audit.py audits them to check that the audit reports a non-conforming target
(exit status 1, a shrunk program, a runnable counterexample).
"""

from __future__ import annotations

from kvspec.impl.block_pool import BlockPool
from kvspec.impl.kv_cache_utils import KVCacheBlock


class ReversedAllocationPool(BlockPool):
    """Hands out newly allocated blocks in reverse of the free order (LRU order broken)."""

    def get_new_blocks(self, num_blocks: int | object) -> list[KVCacheBlock]:
        return list(reversed(super().get_new_blocks(num_blocks)))
